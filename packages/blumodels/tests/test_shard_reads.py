"""No shard is memory-mapped: large shards are read window by window with positioned reads, and a shard changed
under a run (truncated, rewritten in place, replaced) is a ShardError naming it, never a SIGBUS; Hugging Face weight
files are read, not mapped, and validated like safetensors. Each case that could die of a signal runs in a
subprocess so that a SIGBUS shows as its exit status."""

import os
import subprocess
import sys

import numpy as np
import pytest
from blumodels.config import ConfigError
from blumodels.data import formats
from blumodels.data.loader import TokenLoader
from blumodels.data.shards import (
    HEADER_BYTES,
    IN_MEMORY_MAX_BYTES,
    MEMORY_ENV,
    ShardError,
    ShardTokens,
    in_memory_max_bytes,
    list_shards,
    open_shard,
    verify_shard,
    write_shard,
)
from blumodels.trainer import Trainer
from models_helpers import micro_config, micro_data

_SPARSE = """
import os, sys
import numpy as np
from blumodels.data.shards import HEADER_BYTES, ShardError, ShardTokens, open_shard, pack_header
path, count = sys.argv[1], int(sys.argv[2])
with open(path, "wb") as f:  # a sparse shard above the in-memory limit: a header, a few tokens, holes
    f.write(pack_header(count, np.dtype("<u2")))
    f.truncate(HEADER_BYTES + 2 * count)
    f.seek(HEADER_BYTES + 2 * (count - 4))
    f.write(np.array([7, 8, 9, 10], "<u2").tobytes())
t = open_shard(path)
assert isinstance(t, ShardTokens), type(t)
print("TAIL", t[count - 6:].tolist(), int(t[-1]), flush=True)
with open(path, "r+b") as f:  # cut short under the reader
    f.truncate(HEADER_BYTES + 2 * (count // 2))
try:
    t[count - 6:]
except ShardError as e:
    print("ERR", e, flush=True)
"""


def test_sparse_shard_above_the_limit_is_read_not_mapped_and_truncation_is_named(tmp_path):
    count = IN_MEMORY_MAX_BYTES // 2 + 8  # 1 GiB + 16 bytes of tokens: the default limit, no knob
    p = tmp_path / "train_00000.bin"
    env = {k: v for k, v in os.environ.items() if k != MEMORY_ENV}
    r = subprocess.run([sys.executable, "-c", _SPARSE, str(p), str(count)], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr[-2000:]  # -7 (SIGBUS) with a memory map
    assert "TAIL [0, 0, 7, 8, 9, 10] 10" in r.stdout
    assert f"ERR shard {p}: changed under the run: {HEADER_BYTES + count} bytes now" in r.stdout, r.stdout


def test_knob_sets_the_in_memory_limit(monkeypatch, tmp_path):
    monkeypatch.delenv(MEMORY_ENV, raising=False)
    assert in_memory_max_bytes() == 1 << 30
    p = tmp_path / "s.bin"
    write_shard(p, np.arange(1000, dtype=np.uint16))
    assert not isinstance(open_shard(p), ShardTokens)
    monkeypatch.setenv(MEMORY_ENV, "1999")  # 2000 token bytes: one byte over
    t = open_shard(p)
    assert isinstance(t, ShardTokens) and len(t) == 1000 and t.dtype == np.uint16
    ref = np.arange(1000, dtype=np.uint16)
    for key in (slice(None), slice(10, 20), slice(-5, None), slice(990, 2000), slice(5, 50, 7), slice(40, 3, -3)):
        np.testing.assert_array_equal(t[key], ref[key])
    assert int(t[-1]) == 999 and t[3] == 3 and np.asarray(t).tolist() == ref.tolist()
    with pytest.raises(IndexError, match="out of bounds for a shard of 1000 tokens"):
        t[1000]
    verify_shard(p)  # checksum over positioned reads
    monkeypatch.setenv(MEMORY_ENV, "lots")
    with pytest.raises(ConfigError, match=f"{MEMORY_ENV}='lots' must be a byte count"):
        open_shard(p)


def test_positioned_reads_refuse_an_in_place_rewrite(monkeypatch, tmp_path):
    monkeypatch.setenv(MEMORY_ENV, "0")
    p = tmp_path / "s.bin"
    write_shard(p, np.arange(1000, dtype=np.uint16))
    t = open_shard(p)
    assert t[:3].tolist() == [0, 1, 2]
    with open(p, "r+b") as f:  # same size, other bytes
        f.seek(HEADER_BYTES)
        f.write(b"\xff\xff")
    st = os.stat(p)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # coarse clocks: make the change visible
    with pytest.raises(ShardError, match=r"s\.bin: changed under the run: 2064 bytes now, 2064 when opened "
                                         r"\(rewritten in place\)"):
        t[:3]
    t.close()


def test_llmc_and_raw_files_are_not_mapped(monkeypatch, tmp_path):
    monkeypatch.setenv(MEMORY_ENV, "0")
    toks = (np.arange(3000) % 500).astype(np.uint16)
    formats.write_llmc(tmp_path / "a.bin", toks)
    (tmp_path / "raw.bin").write_bytes(toks.tobytes())
    for t in (formats.open_shard(tmp_path / "a.bin"), formats.open_raw_uint16(tmp_path / "raw.bin")):
        assert isinstance(t, ShardTokens)
        np.testing.assert_array_equal(t[100:2000], toks[100:2000])
    formats.check_token_range(tmp_path / "a.bin", 500)
    with pytest.raises(ShardError, match=r"a\.bin: token id 499 \(token 499\) is >= the vocabulary size 499"):
        formats.check_token_range(tmp_path / "a.bin", 499)


def test_batches_and_training_equal_through_positioned_reads(monkeypatch, tmp_path):
    d = micro_data()
    monkeypatch.delenv(MEMORY_ENV, raising=False)
    a = TokenLoader(d, "train", 4, 32, rank=1, world_size=2)
    want = [[x.numpy().tolist() for x in a.next_batch()] for _ in range(40)]
    ta = Trainer(micro_config(steps=3, eval_interval=2), tmp_path / "a", quiet=True)
    ra = [(r["loss"], r.get("val_loss")) for r in (ta.fit(), ta.history)[1]]
    ta.close()
    monkeypatch.setenv(MEMORY_ENV, "0")
    b = TokenLoader(d, "train", 4, 32, rank=1, world_size=2)
    assert isinstance(b._shard_tokens(), ShardTokens)
    assert [[x.numpy().tolist() for x in b.next_batch()] for _ in range(40)] == want
    tb = Trainer(micro_config(steps=3, eval_interval=2), tmp_path / "b", quiet=True)
    rb = [(r["loss"], r.get("val_loss")) for r in (tb.fit(), tb.history)[1]]
    tb.close()
    assert rb == ra  # bit-exact


_UNDER_A_RUN = """
import os, sys
from pathlib import Path
import numpy as np
from blumodels.data.loader import TokenLoader
from blumodels.data.shards import ShardError, write_shard
d, how = Path(sys.argv[1]), sys.argv[2]
for i in range(2):
    write_shard(d / f"train_0000{i}.bin", (np.arange(4096) % 500).astype(np.uint16))
ld = TokenLoader(d, "train", 4, 32, vocab_size=512)
ld.next_batch()
p = d / "train_00000.bin"
if how == "truncate":
    with open(p, "r+b") as f:
        f.truncate(100)
elif how == "replace":  # a new shard renamed over the old one
    write_shard(p, (np.arange(4096) % 400).astype(np.uint16))
try:
    for _ in range(80):
        ld.next_batch()
except ShardError as e:
    print("ERR", e)
"""


@pytest.mark.parametrize("how", ["truncate", "replace"])
def test_shard_changed_under_a_positioned_reader_is_named(tmp_path, how):
    env = {**os.environ, MEMORY_ENV: "0"}
    r = subprocess.run([sys.executable, "-c", _UNDER_A_RUN, str(tmp_path), how], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr[-2000:]  # -7 (SIGBUS) with a memory map
    p = tmp_path / "train_00000.bin"
    if how == "truncate":  # the open reader notices at its next read
        assert f"ERR shard {p}: changed under the run: 100 bytes now, 8256 when opened" in r.stdout, r.stdout
    else:  # the replaced file is named when the loader comes back to it
        assert f"ERR shard {p}: changed under the run (size, modification time or file differ" in r.stdout, r.stdout
    assert len(list_shards(tmp_path, "train")) == 2  # the shards themselves are left as they are


def _safetensors(path, index, payload):
    import json
    import struct

    head = json.dumps(index).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + payload)


def test_hf_weights_are_validated_like_safetensors_and_read_not_mapped(tmp_path):
    from blumodels.hf import HFError, read_hf_weights

    w = np.arange(6, dtype=np.float32)
    ok = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}
    _safetensors(tmp_path / "model.safetensors", ok, w.tobytes())
    np.testing.assert_array_equal(read_hf_weights(tmp_path)["a"], w.reshape(2, 3))
    bad = [
        ({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
          "b": {"dtype": "F32", "shape": [1], "data_offsets": [20, 24]}}, 24, "overlaps the previous tensor"),
        ({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 24]}}, 24, "leaves a gap of 8 bytes"),
        ({"a": {"dtype": "F32", "shape": [-1, 6], "data_offsets": [0, 24]}}, 24, "non-negative integers"),
        ({"a": {"dtype": "F32", "shape": [1 << 40, 1 << 40], "data_offsets": [0, 24]}}, 24, "overflow"),
        ({"a": {"dtype": "Q9", "shape": [6], "data_offsets": [0, 24]}}, 24, "unknown dtype"),
        ({"a": {"dtype": "F32", "shape": [6]}}, 24, "needs exactly dtype, shape, data_offsets"),
        ({"a": {"dtype": "F32", "shape": [[[[[6]]]]], "data_offsets": [0, 24]}}, 24, "at most 4 levels"),
        ({"a": {"dtype": "I32", "shape": [6], "data_offsets": [0, 24]}}, 24, "only floating-point weights"),
    ]
    for index, n, msg in bad:
        _safetensors(tmp_path / "model.safetensors", index, bytes(n))
        with pytest.raises(HFError, match=msg):
            read_hf_weights(tmp_path)
    deep = b"[" * 100_000 + b"]" * 100_000
    import struct

    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(deep)) + deep)
    with pytest.raises(HFError, match="at most 4 levels"):
        read_hf_weights(tmp_path)
