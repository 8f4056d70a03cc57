"""Checkpoints: exact round trip (bf16 too), verification errors, fallback, pruning, async, kill safety."""

import json
import logging
import os
import subprocess
import sys
import threading
import time
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from blumodels.checkpoint import format as fmt
from blumodels.checkpoint import manager as mgr_mod
from blumodels.checkpoint.format import (
    CheckpointError,
    load_checkpoint,
    read_checkpoint_meta,
    save_checkpoint,
)
from blumodels.checkpoint.manager import CheckpointManager


def _tensors(seed=0, n=64):
    rng = np.random.default_rng(seed)
    return {
        "model.w": rng.standard_normal((n, 3)).astype(np.float32),
        "model.b": rng.standard_normal(7).astype(np.float64),
        "optim.exp_avg.w": rng.standard_normal((n, 3)).astype(ml_dtypes.bfloat16),
        "rng.counter": rng.integers(-(2**62), 2**62, size=5, dtype=np.int64),
        "scalar": np.array(np.float32(1.5)),
        "empty": np.zeros((0, 4), np.float32),
        "noncontig": np.arange(24, dtype=np.float32).reshape(4, 6).T,
        "half": rng.standard_normal(3).astype(np.float16),
        "u8": rng.integers(0, 255, 9).astype(np.uint8),
        "flag": np.array([True, False]),
    }


def _assert_exact(got, want):
    assert set(got) == set(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, k
        assert g.tobytes() == np.ascontiguousarray(w).tobytes(), k


META = {"step": 12, "lr": 0.1 + 0.2, "nan": float("nan"), "config": {"model": {"n_layer": 2}}, "loader": {
    "shard": 1, "pos": 4096}, "rng": [1, 2, 3], "text": "ünïcödé"}


def test_round_trip_exact(tmp_path):
    t = _tensors()
    t["bf16_specials"] = np.array([np.nan, np.inf, -0.0, 1e-40, 3.0e38], dtype=ml_dtypes.bfloat16)
    p = tmp_path / "c.safetensors"
    save_checkpoint(p, t, META)
    got, meta = load_checkpoint(p)
    _assert_exact(got, t)
    assert meta["lr"] == 0.1 + 0.2 and np.isnan(meta["nan"]) and meta["text"] == "ünïcödé"
    assert meta["loader"] == {"shard": 1, "pos": 4096}
    assert read_checkpoint_meta(p)["step"] == 12
    assert not [q for q in tmp_path.iterdir() if q.name.startswith(".")]


def test_readable_by_safetensors(tmp_path):
    """Standard safetensors: other readers open it (NumPy for plain dtypes, PyTorch for bfloat16)."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    t = {k: v for k, v in _tensors().items() if v.dtype != ml_dtypes.bfloat16}
    p = tmp_path / "plain.safetensors"
    save_checkpoint(p, t, {"a": 1})
    for k, v in load_file(str(p)).items():
        np.testing.assert_array_equal(v, t[k])
    with safe_open(str(p), "np") as f:
        md = f.metadata()
    assert md["format_version"] == "2" and json.loads(md["meta"]) == {"a": 1}
    assert len(md["chunk_sha256"]) == 64 and int(md["chunk_bytes"]) == fmt.CHUNK_BYTES  # one chunk here
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file as torch_load

    bf = _tensors()["optim.exp_avg.w"]
    save_checkpoint(p, {"bf": bf}, {})
    tt = torch_load(str(p))["bf"]
    assert tt.dtype == torch.bfloat16
    assert tt.view(torch.int16).numpy().tobytes() == bf.tobytes()


def test_rejects_bad_input(tmp_path):
    with pytest.raises(TypeError, match="must be a NumPy array"):
        save_checkpoint(tmp_path / "x", {"a": [1, 2]}, {})
    with pytest.raises(ValueError, match="no safetensors equivalent"):
        save_checkpoint(tmp_path / "x", {"a": np.zeros(2, np.complex64)}, {})
    with pytest.raises(ValueError, match="bad tensor name"):
        save_checkpoint(tmp_path / "x", {"__metadata__": np.zeros(2)}, {})
    assert not list(tmp_path.iterdir())


def _saved(tmp_path):
    p = tmp_path / "c.safetensors"
    save_checkpoint(p, _tensors(), META)
    return p


def test_corrupted_payload_byte(tmp_path):
    p = _saved(tmp_path)
    b = bytearray(p.read_bytes())
    b[-10] ^= 0x01
    p.write_bytes(bytes(b))
    with pytest.raises(CheckpointError, match="checksum mismatch") as e:
        load_checkpoint(p)
    assert str(p) in str(e.value)


def test_tampered_meta(tmp_path):
    p = _saved(tmp_path)
    raw = p.read_bytes()
    i = raw.index(b'\\"step\\": 12')
    p.write_bytes(raw[:i] + b'\\"step\\": 99' + raw[i + 12:])
    with pytest.raises(CheckpointError, match="checksum mismatch: metadata"):
        load_checkpoint(p)


def test_truncated(tmp_path):
    p = _saved(tmp_path)
    size = p.stat().st_size
    with open(p, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CheckpointError, match=r"truncated: header claims \d+ payload bytes at offset \d+") \
            as e:
        load_checkpoint(p)
    assert str(p) in str(e.value)
    with open(p, "r+b") as f:
        f.truncate(50)
    with pytest.raises(CheckpointError, match=r"truncated: header claims \d+ bytes at offset 8, file has 42"):
        load_checkpoint(p)


def test_not_safetensors_and_version(tmp_path):
    p = tmp_path / "junk.safetensors"
    p.write_bytes(b"hello, this is not a checkpoint at all" * 3)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        load_checkpoint(p)
    p.write_bytes(b"abc")
    with pytest.raises(CheckpointError, match="not a safetensors file: 3 bytes"):
        load_checkpoint(p)
    q = _saved(tmp_path)
    raw = q.read_bytes()
    q.write_bytes(raw.replace(b'"format_version":"2"', b'"format_version":"7"', 1))
    with pytest.raises(CheckpointError, match="unsupported format_version 7"):
        load_checkpoint(q)
    with pytest.raises(CheckpointError, match="no such file"):
        load_checkpoint(tmp_path / "missing.safetensors")


# ------------------------------------------------------------------ manager
def test_manager_names_prune_and_latest(tmp_path):
    m = CheckpointManager(tmp_path, rank=1, keep=3)
    for step in (10, 20, 30, 40, 50):
        path = m.save(step, _tensors(step), {"loss": step / 10})
        assert path.name == f"step_{step:08d}.rank1.safetensors"
    assert [p.name for p in m.list()] == [f"step_{s:08d}.rank1.safetensors" for s in (30, 40, 50)]
    assert CheckpointManager(tmp_path, rank=0).list() == []  # other ranks' files are not ours
    path, tensors, meta = m.latest_good()
    assert path.name.startswith("step_00000050") and meta["step"] == 50 and meta["rank"] == 1
    assert meta["loss"] == 5.0
    _assert_exact(tensors, _tensors(50))


def _corrupt(p):
    b = bytearray(p.read_bytes())
    b[-3] ^= 0xFF
    p.write_bytes(bytes(b))


def test_fallback_corrupt_truncated_deleted(tmp_path, caplog):
    m = CheckpointManager(tmp_path, keep=None)
    for step in (1, 2, 3, 4):
        m.save(step, _tensors(step), {})
    files = m.list()
    _corrupt(files[3])
    with caplog.at_level(logging.WARNING, logger="blumodels.checkpoint.manager"):
        path, tensors, meta = m.latest_good()
    assert meta["step"] == 3
    _assert_exact(tensors, _tensors(3))
    assert files[3].name in caplog.text and "checksum mismatch" in caplog.text
    with open(files[2], "r+b") as f:  # truncated (a crash of a non-atomic writer)
        f.truncate(files[2].stat().st_size // 2)
    assert m.latest_good()[2]["step"] == 2
    files[1].unlink()  # deleted
    assert m.latest_good()[2]["step"] == 1
    assert m.good_steps() == [1]
    _corrupt(files[0])
    assert m.latest_good() is None and m.good_steps() == []


def test_max_step_and_load(tmp_path):
    m = CheckpointManager(tmp_path, keep=None)
    for step in (5, 10, 15):
        m.save(step, _tensors(step), {})
    assert m.good_steps() == [5, 10, 15]
    assert m.latest_good(max_step=12)[2]["step"] == 10
    assert m.latest_good(max_step=4) is None
    path, tensors, meta = m.load(15)
    assert meta["step"] == 15 and m.step_of(path) == 15
    _assert_exact(tensors, _tensors(15))
    with pytest.raises(CheckpointError, match="no such file"):
        m.load(7)


def test_prune_keeps_newest_good(tmp_path):
    m = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3):
        m.save(step, _tensors(step), {})
    assert [p.name[:13] for p in m.list()] == ["step_00000002", "step_00000003"]
    _corrupt(m.list()[-1])  # step 3 bad: pruning after step 4 must keep 4 and 2 (the good ones)
    fresh = CheckpointManager(tmp_path, keep=2)
    fresh.save(4, _tensors(4), {})
    assert [p.name[:13] for p in fresh.list()] == ["step_00000002", "step_00000003", "step_00000004"]
    fresh.save(5, _tensors(5), {})
    assert [p.name[:13] for p in fresh.list()] == ["step_00000004", "step_00000005"]


def test_async_snapshot_and_one_in_flight(tmp_path, monkeypatch):
    """save() returns while its write is still running (each write waits for the test to record that save()
    returned: a save() that blocked on its own write would never return first), the snapshot is the tensors as
    they were at the call, and at most one write is in flight (each starts after the previous one ended). The
    order of events is asserted, not a wall-clock bound."""
    events, active, peak, lock = [], [0], [0], threading.Lock()
    gates = {step: threading.Event() for step in range(1, 6)}
    real = mgr_mod.save_checkpoint

    def slow_save(path, tensors, meta):
        step = meta["s"]
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            events.append(("start", step))
        gates[step].wait(timeout=30)
        real(path, tensors, meta)
        with lock:
            active[0] -= 1
            events.append(("end", step))

    monkeypatch.setattr(mgr_mod, "save_checkpoint", slow_save)
    m = CheckpointManager(tmp_path, keep=None, async_save=True)
    t = _tensors(0)
    expect = {}
    for step in range(1, 6):
        t["model.w"][0, 0] = step
        expect[step] = {k: v.copy() for k, v in t.items()}
        m.save(step, t, {"s": step})
        with lock:
            events.append(("returned", step))
        assert m.in_flight
        t["model.w"][...] = -1.0  # mutate right after save(): the snapshot must not see it
        gates[step].set()
    m.wait()
    assert not m.in_flight and peak[0] == 1
    at = {e: i for i, e in enumerate(events)}
    for step in range(1, 6):
        assert at[("returned", step)] < at[("end", step)], events  # returned before its write ended
        if step > 1:
            assert at[("end", step - 1)] < at[("start", step)], events  # one write in flight
    for step, p in zip(range(1, 6), m.list()):
        got, meta = load_checkpoint(p)
        assert meta["s"] == step
        _assert_exact(got, expect[step])
    m.close()


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread nice is Linux's")
def test_async_writer_runs_at_background_priority(tmp_path):
    """The writer thread (where on_saved runs) is at nice WRITER_NICE; the training thread keeps its own."""
    seen = []

    def on_saved(path, step):
        seen.append((threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))

    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    m = CheckpointManager(tmp_path, async_save=True, on_saved=on_saved)
    m.save(1, _tensors(), {"x": 1})
    deadline = time.monotonic() + 60
    while m.in_flight and time.monotonic() < deadline:  # not wait(): that gives the writer its priority back
        time.sleep(0.01)
    m.wait()
    (tid, nice), = seen
    assert tid != threading.get_native_id() and nice == max(main, mgr_mod.WRITER_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main
    if main == 0 and os.geteuid() == 0:  # raising a nice value back needs privilege: root here
        gate, real = threading.Event(), mgr_mod.save_checkpoint

        def gated(path, tensors, meta):
            gate.wait(30)
            real(path, tensors, meta)

        mgr_mod.save_checkpoint = gated
        try:
            m.save(2, _tensors(), {"x": 2})
            while not m._lowered and time.monotonic() < deadline:
                time.sleep(0.01)
            tid = m._lowered[0][0]
            assert os.getpriority(os.PRIO_PROCESS, tid) == mgr_mod.WRITER_NICE
            waiter = threading.Thread(target=m.wait)
            waiter.start()
            while os.getpriority(os.PRIO_PROCESS, tid) != main and time.monotonic() < deadline:
                time.sleep(0.01)
            assert os.getpriority(os.PRIO_PROCESS, tid) == main  # the step waits on it: full priority
            gate.set()
            waiter.join()
        finally:
            mgr_mod.save_checkpoint = real
            gate.set()
    sync = CheckpointManager(tmp_path / "s", async_save=False, on_saved=on_saved)
    sync.save(1, _tensors(), {"x": 1})  # a sync save runs on the caller's thread at its priority
    assert seen[-1] == (threading.get_native_id(), main)


def test_async_error_surfaces(tmp_path, monkeypatch):
    def boom(path, tensors, meta):
        raise OSError("disk full")

    monkeypatch.setattr(mgr_mod, "save_checkpoint", boom)
    m = CheckpointManager(tmp_path, async_save=True)
    m.save(1, _tensors(), {})
    with pytest.raises(OSError, match="disk full"):
        m.wait()
    m.wait()  # reported once


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_async_memory_flat(tmp_path):
    t = {f"p{i}": np.random.default_rng(i).standard_normal(64 * 1024).astype(np.float32) for i in range(4)}
    m = CheckpointManager(tmp_path, keep=2, async_save=True)  # 1 MiB per checkpoint
    for s in range(3):
        m.save(s, t, {"s": s})
    m.wait()
    tracemalloc.start()
    base_py, base_rss = tracemalloc.get_traced_memory()[0], _rss()
    for s in range(3, 53):
        m.save(s, t, {"s": s})
    m.wait()
    grow_py, grow_rss = tracemalloc.get_traced_memory()[0] - base_py, _rss() - base_rss
    tracemalloc.stop()
    m.close()
    assert grow_py < 256 * 1024, grow_py  # 50 snapshots of 1 MiB would be 50 MiB
    assert grow_rss < 16 * 1024 * 1024, grow_rss
    assert len(m.list()) == 2


_KILLER = """
import os, sys
import numpy as np
from blumodels.checkpoint import format as fmt
fmt.os.fsync = lambda fd: os._exit(9)   # die after writing the data, before fsync + rename
fmt.save_checkpoint(sys.argv[1], {"w": np.ones(1 << 20, np.float32)}, {"step": 2})
"""


def test_kill_during_write_is_never_a_checkpoint(tmp_path):
    m = CheckpointManager(tmp_path, keep=3)
    m.save(1, _tensors(1), {})
    target = m.path_for(2)
    r = subprocess.run([sys.executable, "-c", _KILLER, str(target)], capture_output=True, timeout=60)
    assert r.returncode == 9, r.stderr.decode()
    assert not target.exists()
    temps = [p for p in tmp_path.iterdir() if p.name.startswith(".step_00000002")]
    assert len(temps) == 1 and temps[0].stat().st_size > 4 << 20  # the partial write is there ...
    assert [p.name[:13] for p in m.list()] == ["step_00000001"]  # ... but never listed
    assert m.latest_good()[2]["step"] == 1
    CheckpointManager(tmp_path, keep=3)  # a restarted process removes the stale temporary file
    assert not temps[0].exists()


def test_sync_save_failure_leaves_previous(tmp_path, monkeypatch):
    m = CheckpointManager(tmp_path)
    m.save(1, _tensors(1), {})

    def fail(*a):
        raise OSError("rename failed")

    monkeypatch.setattr(fmt.os, "replace", fail)
    with pytest.raises(OSError, match="rename failed"):
        m.save(2, _tensors(2), {})
    monkeypatch.undo()
    assert [p.name[:13] for p in m.list()] == ["step_00000001"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def _cuda_ok():
    try:
        import blutensor as bt

        return bt.cuda.is_available()
    except Exception:
        return False


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not _cuda_ok(), reason="needs CuPy and a CUDA GPU")])])
def test_async_blutensor_tensors(tmp_path, device):
    """save() takes blutensor Tensors (fp32 + bf16) on any device; later in-place updates do not leak in."""
    import blutensor as bt

    w = bt.randn(64, 32, device=device)
    h = w.to(bt.bfloat16)
    expect_w, expect_h = w.numpy().copy(), h.numpy().copy()
    m = CheckpointManager(tmp_path, async_save=True)
    m.save(1, {"w": w, "h": h}, {})
    w.zero_()
    h.zero_()
    m.wait()
    got, _ = load_checkpoint(m.list()[-1])
    assert got["h"].dtype == ml_dtypes.bfloat16
    _assert_exact(got, {"w": expect_w, "h": expect_h})
    m.close()


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_ok(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("staged", [True, False])
def test_async_snapshot_of_raw_cupy_arrays_and_device_tensors_is_taken_at_save(tmp_path, monkeypatch, staged):
    """A raw CuPy array and CUDA Tensors (fp32, bf16) saved asynchronously are written as they were when save()
    returned, whatever the device does to them afterwards: through a device staging copy (its device-to-host
    copies on a side stream) or, without room for one, copies queued on the current stream."""
    import blutensor as bt
    import cupy as cp
    from blumodels.checkpoint import manager as mgr_mod

    if not staged:
        monkeypatch.setattr(mgr_mod, "STAGING_MARGIN", 1 << 60)
    w = bt.randn(1024, 1024, device="cuda")
    h = w.to(bt.bfloat16)
    raw = cp.arange(1 << 20, dtype=cp.float32)
    expect = {"w": w.numpy().copy(), "h": h.numpy().copy(), "raw": cp.asnumpy(raw)}
    m = CheckpointManager(tmp_path, keep=2, async_save=True)
    assert m.reserve({"w": w, "h": h, "raw": raw}) >= 0
    m.save(1, {"w": w, "h": h, "raw": raw}, {"k": 1})
    assert (m._staging is not None) == staged
    raw *= 0
    w._data[...] = 0
    m.wait()
    assert m._staging is None
    got, meta = load_checkpoint(m.list()[-1])
    assert got["h"].dtype == ml_dtypes.bfloat16 and meta["k"] == 1
    _assert_exact(got, expect)
    m.close()


# ------------------------------------------------------------------ chunked digests, parallel I/O
def _small_chunks(monkeypatch, size=4096):
    """Chunks of ``size`` bytes, so that a small checkpoint has many (the I/O threads then all take part)."""
    monkeypatch.setattr(fmt, "CHUNK_BYTES", size)


def _payload(p):
    import struct

    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw, 8 + n, json.loads(raw[8:8 + n])["__metadata__"]


def _big(seed=0):
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal((300, 50)).astype(np.float32), "b": rng.standard_normal(1001),
            "c": rng.standard_normal(777).astype(ml_dtypes.bfloat16), "d": np.arange(13, dtype=np.int8)}


@pytest.mark.parametrize("threads", [1, 4])
def test_recorded_digests_are_hashlib_sha256_of_each_chunk(tmp_path, monkeypatch, threads):
    """Every recorded chunk digest equals an independent hashlib.sha256 of those bytes of the file, and the
    header digest a receipt records is hashlib's of the file's first 8 + N bytes."""
    import hashlib

    _small_chunks(monkeypatch)
    t = _big()
    p = tmp_path / "c.safetensors"
    save_checkpoint(p, t, {"step": 3}, threads=threads)
    raw, start, md = _payload(p)
    payload, chunk = raw[start:], int(md["chunk_bytes"])
    assert chunk == 4096 and int(md["payload_bytes"]) == len(payload) == sum(v.nbytes for v in t.values())
    want = [hashlib.sha256(payload[i:i + chunk]).hexdigest() for i in range(0, len(payload), chunk)]
    assert len(want) > 4 * threads and md["chunk_sha256"] == "".join(want)
    assert fmt.header_sha256(p) == hashlib.sha256(raw[:start]).hexdigest()
    got, meta = load_checkpoint(p, threads=threads)
    _assert_exact(got, t)
    assert meta == {"step": 3} and fmt.verify_checkpoint(p, threads=threads) == {"step": 3}


def test_a_flipped_byte_in_any_chunk_is_detected(tmp_path, monkeypatch):
    """One bit flipped in any chunk (first, middle, last byte of the payload) fails load and verify, naming
    the chunk; the same file unflipped loads."""
    _small_chunks(monkeypatch)
    p = tmp_path / "c.safetensors"
    save_checkpoint(p, _big(), {"step": 1}, threads=3)
    raw, start, md = _payload(p)
    size = len(raw) - start
    for off in sorted({0, 4095, 4096, size // 2, size - 1}):
        b = bytearray(raw)
        b[start + off] ^= 0x10
        p.write_bytes(bytes(b))
        for fn in (load_checkpoint, fmt.verify_checkpoint):
            with pytest.raises(CheckpointError, match=rf"checksum mismatch: payload bytes {off // 4096 * 4096}\.\."
                                                      rf".*\(chunk {off // 4096} of "):
                fn(p, threads=3)
    p.write_bytes(raw)
    _assert_exact(load_checkpoint(p)[0], _big())


def test_damaged_chunk_digests_are_refused(tmp_path):
    p = _saved(tmp_path)
    raw = p.read_bytes()
    i = raw.index(b'"chunk_sha256":"') + len(b'"chunk_sha256":"')
    for bad in (b"g", b"A"):  # not lower-case hex: named, before any payload is read
        p.write_bytes(raw[:i] + bad + raw[i + 1:])
        with pytest.raises(CheckpointError, match="chunk_sha256 holds"):
            load_checkpoint(p)
    p.write_bytes(raw[:i] + (b"1" if raw[i:i + 1] != b"1" else b"2") + raw[i + 1:])
    with pytest.raises(CheckpointError, match=r"checksum mismatch: payload bytes 0\.\."):
        load_checkpoint(p)


def test_version_1_files_still_load_and_are_verified(tmp_path):
    """A file written with one SHA-256 of the whole payload (format_version 1) loads, and a flipped byte in it
    is still a checksum mismatch."""
    import hashlib
    import struct

    t = _tensors()
    index, arrays, payload = fmt._index_and_arrays(t)
    body = b"".join(a.tobytes() for a in arrays)
    meta_json = json.dumps(META, sort_keys=True, allow_nan=True)
    md = {"format": fmt.FORMAT_NAME, "format_version": "1", "meta": meta_json,
          "meta_sha256": fmt._meta_digest(meta_json, index), "payload_bytes": str(payload),
          "sha256": hashlib.sha256(body).hexdigest()}
    head = fmt._header_bytes(index, md)
    p = tmp_path / "v1.safetensors"
    p.write_bytes(struct.pack("<Q", len(head)) + head + body)
    got, meta = load_checkpoint(p)
    _assert_exact(got, t)
    assert meta["text"] == "ünïcödé" and fmt.verify_checkpoint(p)["step"] == 12
    _corrupt(p)
    with pytest.raises(CheckpointError, match="checksum mismatch: payload sha256"):
        fmt.verify_checkpoint(p)


def test_threads_must_be_positive(tmp_path):
    for bad in (0, -1, 1.5, True, "4"):
        with pytest.raises(ValueError, match=r"threads=.* must be a positive integer"):
            save_checkpoint(tmp_path / "x", _tensors(), {}, threads=bad)
    assert not list(tmp_path.iterdir())


def test_parallel_write_fails_cleanly_on_a_short_disk(tmp_path, monkeypatch):
    """An I/O thread's OSError (disk full half-way) ends the save with that error and leaves no file; the writes
    the other threads had in flight are finished first (no thread writes to a removed file)."""
    import errno

    from blumodels.checkpoint import chunkio

    _small_chunks(monkeypatch)
    real, calls, lock = chunkio.pwrite_all, [0], threading.Lock()

    def full(fd, pieces, offset):
        with lock:
            calls[0] += 1
            n = calls[0]
        if n == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        time.sleep(0.002)
        real(fd, pieces, offset)

    monkeypatch.setattr(chunkio, "pwrite_all", full)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(tmp_path / "c.safetensors", _big(), {}, threads=4)
    assert not list(tmp_path.iterdir())
    assert not [t for t in threading.enumerate() if t.name.startswith("blumodels-ckpt-io")]


def test_receipt_pins_the_header_and_a_swapped_file_is_refused(tmp_path, caplog):
    """The receipt records the file's header SHA-256; a file of the same name and size but other contents (a
    stray rewrite) is not the committed one: latest_good falls back to the previous step."""
    m = CheckpointManager(tmp_path, keep=None)
    m.save(1, _tensors(1), {})
    m.save(2, _tensors(2), {})
    rec = json.loads(m.receipt_for(2).read_text())
    assert rec["header_sha256"] == fmt.header_sha256(m.path_for(2)) and rec["bytes"] == m.path_for(2).stat().st_size
    save_checkpoint(m.path_for(2), _tensors(3), {"step": 2, "rank": 0})  # same shapes: same size, verifies alone
    assert m.path_for(2).stat().st_size == rec["bytes"]
    with caplog.at_level(logging.WARNING, logger="blumodels.checkpoint.manager"):
        path, tensors, meta = m.latest_good()
    assert meta["step"] == 1 and "header's SHA-256 differs" in caplog.text
    _assert_exact(tensors, _tensors(1))
    assert m.good_steps() == [1]


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread nice is Linux's")
def test_async_io_workers_run_at_background_priority(tmp_path, monkeypatch):
    """The async writer's hashing threads are lowered with it (and recorded, so wait() can restore them); a sync
    save's keep the caller's priority."""
    from blumodels.checkpoint import chunkio

    _small_chunks(monkeypatch)
    monkeypatch.setattr(chunkio, "MAX_DEFAULT_THREADS", 3)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})  # three I/O threads: two hash
    seen, real = [], chunkio._digest

    def record(pieces):
        tid = threading.get_native_id()
        seen.append((threading.current_thread().name, tid, os.getpriority(os.PRIO_PROCESS, tid)))
        time.sleep(0.005)  # a chunk takes a while, so that both hashing threads get chunks on a loaded machine
        return real(pieces)

    monkeypatch.setattr(chunkio, "_digest", record)
    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    m = CheckpointManager(tmp_path / "a", async_save=True)
    m.save(1, _big(), {})
    m._thread.join()  # not wait(): that gives the threads their priority back
    workers = {(tid, nice) for name, tid, nice in seen if name.startswith("blumodels-ckpt-io")}
    assert len(workers) >= 2 and {nice for _, nice in workers} == {max(main, mgr_mod.WRITER_NICE)}
    assert {tid for tid, _ in workers} <= {tid for tid, _ in m._lowered}
    m.wait()
    seen.clear()
    CheckpointManager(tmp_path / "s").save(1, _big(), {})
    assert seen and {nice for _, _, nice in seen} == {main}


def test_training_state_without_copy_shares_cpu_storage_and_saves_the_same_file(tmp_path):
    """copy=False (what the Trainer passes) hands over the CPU tensors' storage itself; the checkpoint written
    from it is byte for byte the one written from copies, and the copies do not follow a later update."""
    import blutensor as bt
    from blumodels.state import training_state

    model = bt.nn.Linear(8, 4)
    opt = bt.optim.AdamW(model.parameters(), lr=0.1)
    model(bt.randn(3, 8)).sum().backward()
    opt.step()
    views, meta = training_state(model, opt, 1, copy=False)
    copies, _ = training_state(model, opt, 1)
    w = model.weight
    assert np.shares_memory(views["model.weight"], w.numpy()) and not np.shares_memory(copies["model.weight"],
                                                                                       w.numpy())
    assert set(views) == set(copies) and len(views) == 6
    save_checkpoint(tmp_path / "v.safetensors", views, meta)
    save_checkpoint(tmp_path / "c.safetensors", copies, meta)
    assert (tmp_path / "v.safetensors").read_bytes() == (tmp_path / "c.safetensors").read_bytes()
    before = copies["model.weight"].copy()
    with bt.no_grad():
        w.mul_(2.0)
    np.testing.assert_array_equal(views["model.weight"], before * 2)
    np.testing.assert_array_equal(copies["model.weight"], before)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not _cuda_ok(), reason="needs CuPy and a CUDA GPU")])])
def test_training_state_without_copy_hands_device_tensors_to_the_async_snapshot(tmp_path, device):
    """training_state(copy=False) gives CPU storage as arrays and device parameters as their Tensors (the
    manager's snapshot copies them); reserve() allocates the buffers the first async save then reuses, and the
    file holds the values at save time."""
    import blutensor as bt
    from blumodels.state import training_state

    model = bt.nn.Linear(16, 8).to(device)
    tensors, meta = training_state(model, None, 3, copy=False)
    kinds = {type(v).__name__ for v in tensors.values()}
    assert kinds == ({"ndarray"} if device == "cpu" else {"Tensor"})
    expect = {k: (v.numpy() if hasattr(v, "numpy") and not isinstance(v, np.ndarray) else v).copy()
              for k, v in tensors.items()}
    m = CheckpointManager(tmp_path, async_save=True)
    m.reserve(tensors)
    bufs = {k: id(b) for k, b in m._buffers.items()}
    m.save(3, tensors, meta)
    assert {k: id(b) for k, b in m._buffers.items()} == bufs  # the reserved buffers were used
    with bt.no_grad():
        model.weight.zero_()
    m.wait()
    got, _ = load_checkpoint(m.list()[-1])
    _assert_exact(got, expect)
    m.close()
