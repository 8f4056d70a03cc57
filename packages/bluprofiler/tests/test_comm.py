"""Communication profiling: NCCL's bus-bandwidth formulas, overlap, and 2-rank MPI DDP/FSDP profiles."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bluprofiler.comm import CommEvent, bandwidth, bus_factor, comm_summary, compute_overlap
from bluprofiler.events import OpEvent

WORKER = Path(__file__).parent / "comm_worker.py"


# ---- formulas (NCCL doc/PERFORMANCE.md) ----
@pytest.mark.parametrize("op,n,factor", [
    ("all_reduce", 2, 1.0), ("all_reduce", 8, 1.75), ("all_reduce", 1, 0.0),
    ("reduce_scatter", 4, 0.75), ("all_gather", 8, 0.875), ("all_to_all", 2, 0.5),
    ("broadcast", 8, 1.0), ("send", 2, 1.0), ("recv", 2, 1.0), ("barrier", 4, 0.0),
])
def test_bus_factor_matches_nccl(op, n, factor):
    assert bus_factor(op, n) == pytest.approx(factor)


def test_bandwidth_values():
    # 1 GiB all-reduce in 10 ms on 8 ranks: algbw 107.37 GB/s, busbw * 2*7/8
    alg, bus = bandwidth("all_reduce", 2**30, 0.010, 8)
    assert alg == pytest.approx(2**30 / 0.010)
    assert bus == pytest.approx(2**30 / 0.010 * 1.75)
    alg, bus = bandwidth("all_gather", 4 * 10**6, 0.002, 4)  # all_gather: S is the whole output
    assert (alg, bus) == (pytest.approx(2e9), pytest.approx(1.5e9))
    assert bandwidth("all_reduce", 0, 0.1, 2) == (0.0, 0.0)
    assert bandwidth("barrier", 0, 0.1, 2) == (0.0, 0.0)


def test_bandwidth_bad_input_is_named():
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        bus_factor("allreduce", 2)
    with pytest.raises(ValueError, match="world must be an int >= 1"):
        bus_factor("all_reduce", 0)
    with pytest.raises(ValueError, match="seconds must be >= 0"):
        bandwidth("all_reduce", 8, float("nan"), 2)


def _op(name, t0, t1):
    return OpEvent(name, "backward", "k", 0, 0, 1, t0, t1)


def _comm(t0, t1, nbytes=1000, op="all_reduce"):
    return CommEvent(op, "mpi", (0, 1), 0, nbytes, "float32", "sum", True, t0, t0, t1)


def test_overlap_fraction_against_interval_arithmetic():
    ops = [_op("a", 0, 40), _op("b", 30, 60), _op("c", 90, 120)]  # union: [0, 60] and [90, 120]
    comms = [_comm(50, 100), _comm(60, 90), _comm(0, 10)]
    compute_overlap(comms, ops)
    assert comms[0].overlap == pytest.approx((10 + 10) / 50)
    assert comms[0].overlapped == {"b.backward": 1, "c.backward": 1}
    assert comms[1].overlap == 0.0 and comms[1].overlapped == {}
    assert comms[2].overlap == 1.0
    rows = comm_summary(comms)
    assert len(rows) == 1 and rows[0]["calls"] == 3 and rows[0]["bytes"] == 3000
    assert rows[0]["total_ms"] == pytest.approx(90 / 1e6)
    assert rows[0]["overlap"] == pytest.approx((20 + 0 + 10) / 90)  # weighted by time
    assert rows[0]["busbw_GBps"] == pytest.approx(3000 / 90e-9 * 1.0 / 1e9)


def test_dtms_observer_reports_start_then_end_at_wait():
    import dtms
    from dtms.backends.local import LocalProcessGroup

    seen = []
    dtms.add_collective_observer(lambda ph, r: seen.append((ph, r.op, r.nbytes, r.end_ns)))
    fn = dtms.process_group._COLLECTIVE_OBSERVERS[-1]
    try:
        pg = LocalProcessGroup()
        x = np.zeros(10, np.float32)
        w = pg.all_reduce(x, async_op=True)
        assert [s[0] for s in seen] == ["start"]  # not complete until waited on
        w.wait()
        pg.all_gather(np.zeros(10, np.float64), np.zeros(10, np.float64))
        pg.barrier()
    finally:
        dtms.remove_collective_observer(fn)
    assert [(s[0], s[1], s[2]) for s in seen] == [
        ("start", "all_reduce", 40), ("end", "all_reduce", 40), ("start", "all_gather", 80),
        ("end", "all_gather", 80), ("start", "barrier", 0), ("end", "barrier", 0)]
    assert all(s[3] is None for s in seen if s[0] == "start") and all(s[3] > 0 for s in seen if s[0] == "end")
    assert not dtms.process_group._COLLECTIVE_OBSERVERS
    with pytest.raises(TypeError, match="fn must be callable"):
        dtms.add_collective_observer(3)


# ---- two MPI ranks ----
def _run(mode: str, out: Path) -> None:
    from dtms.mpi import find_mpiexec, mpi4py_available, mpiexec_command, mpiexec_env

    if find_mpiexec() is None or not mpi4py_available():
        pytest.skip("needs mpiexec and mpi4py (pip install dtms[mpi])")
    cmd = mpiexec_command(2, [sys.executable, str(WORKER), mode, str(out)])
    p = subprocess.run(cmd, env=mpiexec_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


N_PARAM_BYTES = 4 * (64 * 48 + 4 * (48 * 48 + 48) + 48 * 64 + 64)  # comm_worker.Net, float32


def test_two_rank_ddp_trace_holds_collectives_overlapping_backward(tmp_path):
    _run("ddp", tmp_path)
    for rank in (0, 1):
        d = tmp_path / f"rank{rank}"
        ev = json.loads((d / "trace.json").read_text())["traceEvents"]
        comms = [e for e in ev if e.get("cat") == "collective"]
        bwd = [e for e in ev if e.get("ph") == "X" and e.get("cat") == "backward"]
        assert comms and bwd
        assert {c["name"] for c in comms} == {"all_reduce"}
        # every gradient byte is all-reduced once per profiled step (2 steps), in several buckets
        assert sum(c["args"]["bytes"] for c in comms) == 2 * N_PARAM_BYTES
        assert len(comms) > 2
        # from the recorded timestamps: some bucket's all-reduce was in flight during a backward op span
        overlapping = [(c, b) for c in comms for b in bwd
                       if b["ts"] < c["ts"] + c["dur"] and c["ts"] < b["ts"] + b["dur"]
                       and c["ts"] < b["ts"]]
        assert overlapping, "no collective overlapped a backward op"
        assert any(c["args"]["overlap"] > 0 and any(k.endswith(".backward") for k in c["args"]["overlapped"])
                   for c in comms)
        s = json.loads((d / "summary.json").read_text())
        (row,) = s["collectives"]
        assert row["op"] == "all_reduce" and row["group"] == [0, 1] and row["calls"] == len(comms)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"])  # 2 ranks: 2(n-1)/n = 1
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / (row["total_ms"] / 1e3) / 1e9)
        assert "collectives:" in (d / "summary.txt").read_text()
        lines = [json.loads(x) for x in (d / "events.jsonl").read_text().splitlines()]
        assert sum(1 for x in lines if x["type"] == "comm") == len(comms)


def test_two_rank_fsdp_profile_has_gathers_and_reduce_scatters(tmp_path):
    _run("fsdp", tmp_path)
    s = json.loads((tmp_path / "rank0" / "summary.json").read_text())
    rows = {r["op"]: r for r in s["collectives"]}
    assert set(rows) == {"all_gather", "reduce_scatter"}
    # reduce_scatter sizes are the whole (padded) gradient input, once per step
    assert rows["reduce_scatter"]["bytes"] >= 2 * N_PARAM_BYTES
    for r in rows.values():
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 0.5)  # (n-1)/n for n = 2


@pytest.fixture
def world1(device, monkeypatch):
    """A world-size-1 dtms group: local on CPU, NCCL on the GPU (the cuda twin)."""
    import dtms

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    pg = dtms.init_process_group("local" if device == "cpu" else "nccl")
    yield device, pg
    dtms.destroy_process_group()


def test_collective_in_a_session_is_timed_on_its_clock(world1):
    import bluprofiler as bp
    import blutensor as bt

    device, pg = world1
    ref = np.arange(1 << 16, dtype=np.float32)
    if device == "cuda":
        import cupy

        buf = cupy.asarray(ref)
    else:
        buf = ref.copy()
    x = bt.tensor(np.ones((64, 64), np.float32), device=device)
    with bp.profile(memory=False) as prof:
        w = pg.all_reduce(buf, async_op=True)
        y = (x @ x).sum()
        w.wait()
        float(y.item())
    res = prof.result
    (c,) = res.comms
    assert (c.op, c.nbytes, c.group, c.backend) == ("all_reduce", ref.nbytes, (0,), pg.backend)
    assert res.t0 <= c.start_ns <= c.issued_ns <= c.end_ns <= res.t1
    if device == "cuda":  # CUDA events on the communication stream, on the GPU lane's clock
        assert c.gpu_ms is not None and c.gpu_ms >= 0 and c.gpu_start_ms is not None and c.gpu_start_ms >= 0
        assert c.stream == pg.stream.ptr
    else:
        assert c.gpu_ms is None and c.stream == 0
    np.testing.assert_array_equal(np.asarray(buf.get() if device == "cuda" else buf), ref)  # world 1: unchanged
    assert c.bandwidth() == (pytest.approx(ref.nbytes / c.seconds), 0.0)  # 2(n-1)/n = 0 for n = 1
    tr = [e for e in bp.chrome_trace(res)["traceEvents"] if e.get("cat") == "collective"]
    assert len(tr) == 1 and tr[0]["args"]["clock"] == ("gpu" if device == "cuda" else "host")
