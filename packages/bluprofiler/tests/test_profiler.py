"""Profiler: every op's forward and backward is a span attributed to it; sessions leave no trace."""

from __future__ import annotations

import time

import blutensor as bt
import numpy as np
import pytest
from bluprofiler import Profiler, ProfilerError, active, profile, record_function
from blutensor import ext
from blutensor.ext import Node


def _mlp(device):
    bt.manual_seed(0)
    x = bt.randn(8, 16, device=device)
    w1 = bt.randn(16, 32, device=device, requires_grad=True)
    w2 = bt.randn(32, 4, device=device, requires_grad=True)
    return x, w1, w2


def _run(x, w1, w2):
    h = bt.relu(bt.matmul(x, w1))
    loss = bt.sum(bt.matmul(h, w2) * 2.0)
    loss.backward()
    return loss


def test_forward_and_backward_attributed_to_ops(device):
    x, w1, w2 = _mlp(device)
    with profile() as prof:
        _run(x, w1, w2)
    res = prof.result
    fwd = [e.name for e in res.ops() if e.phase == "forward"]
    bwd = [e.name for e in res.ops() if e.phase == "backward"]
    assert fwd == ["matmul", "relu", "matmul", "mul", "sum"]
    # backward runs in reverse creation order, one span per recorded node
    assert bwd == ["sum", "mul", "matmul", "relu", "matmul"]
    for e in res.ops():
        # on CUDA a plugin (e.g. a BluBLAS GEMM kernel) may serve the op: any named kernel will do
        assert e.kernel == f"blutensor.{e.name}" if device == "cpu" else e.kernel
        assert e.end_ns >= e.start_ns >= res.t0 and e.end_ns <= res.t1
    mm = next(e for e in res.ops() if e.name == "matmul")
    assert mm.shapes == ((8, 16), (16, 32)) and mm.out_shape == (8, 32)
    if device == "cuda":
        assert res.gpu_timing and all(e.gpu_ms is not None and e.gpu_ms >= 0 for e in res.ops())
    else:
        assert not res.gpu_timing and all(e.gpu_ms is None for e in res.ops())


def test_summary_rows_add_up(device):
    x, w1, w2 = _mlp(device)
    with profile(memory=False) as prof:
        for _ in range(3):
            with record_function("step"):
                _run(x, w1, w2)
    res = prof.result
    rows = {r["name"]: r for r in res.summary()}
    assert rows["matmul.forward"]["calls"] == 6 and rows["matmul.backward"]["calls"] == 6
    assert rows["relu.backward"]["calls"] == 3
    assert sum(r["calls"] for r in rows.values()) == len(res.ops()) == 30
    total = sum(r["total_ms"] for r in rows.values())
    assert total <= res.step_ms() * 1.0001 + (0.5 if device == "cuda" else 0)
    assert sum(r["share"] for r in rows.values()) == pytest.approx(100 * total / res.step_ms())
    assert [r["total_ms"] for r in res.summary()] == sorted((r["total_ms"] for r in rows.values()), reverse=True)
    for r in rows.values():
        assert r["mean_us"] == pytest.approx(1e3 * r["total_ms"] / r["calls"])
    assert len(res.regions("step")) == 3
    txt = res.table(top=3)
    assert res.summary()[0]["name"] in txt and "more rows" in txt and "share %" in txt
    with pytest.raises(ValueError, match="sort_by"):
        res.summary(sort_by="nope")


def test_host_time_is_measured_not_invented():
    """A region that sleeps 20 ms is reported as >= 20 ms; an op's span contains its real work."""
    a = bt.randn(400, 400)
    with profile() as prof:
        with record_function("sleep"):
            time.sleep(0.02)
        t = time.perf_counter_ns()
        bt.matmul(a, a)
        outer = time.perf_counter_ns() - t
    res = prof.result
    assert res.regions("sleep")[0].cpu_us >= 20000
    mm = res.ops()[0]
    assert 0 < mm.cpu_us * 1e3 <= outer


def test_off_leaves_nothing_installed_even_after_errors():
    obs = list(ext.op_observers())
    orig = Node.apply
    x, w1, w2 = _mlp("cpu")
    with pytest.raises(RuntimeError, match="boom"):
        with profile():
            assert list(ext.op_observers()) and list(ext.backward_observers()) and active() is not None
            assert Node.apply is orig  # the engine's observer hook, no class patching
            _run(x, w1, w2)
            raise RuntimeError("boom")
    assert list(ext.op_observers()) == obs and ext.backward_observers() == () and Node.apply is orig
    assert active() is None
    # results of a plain run equal those of a profiled run
    w1.grad = w2.grad = None
    g_off = (_run(x, w1, w2), w1.grad.numpy().copy())
    w1.grad = w2.grad = None
    with profile():
        g_on = (_run(x, w1, w2), w1.grad.numpy().copy())
    assert g_on[0].item() == g_off[0].item()
    np.testing.assert_array_equal(g_on[1], g_off[1])


def test_sessions_do_not_nest_and_result_needs_stop():
    p = Profiler()
    with p:
        with pytest.raises(ProfilerError, match="already active"):
            Profiler().start()
        with pytest.raises(ProfilerError, match="not stopped"):
            _ = p.result
    assert p.result is not None
    with pytest.raises(ProfilerError, match="not running"):
        p.stop()
    with pytest.raises(ProfilerError, match="device"):
        Profiler(device="tpu")


def test_record_function_is_noop_without_session():
    with record_function("nothing"):
        pass
    assert active() is None


def test_cuda_request_without_gpu_is_a_clear_error():
    from bluprofiler.timing import cupy_or_none

    if cupy_or_none() is not None:
        pytest.skip("a GPU is present")
    with pytest.raises(ProfilerError, match="CuPy"):
        Profiler(device="cuda").start()
    assert active() is None


def test_nvtx_ranges_pushed_and_popped(monkeypatch, device):
    """On CUDA each span is one NVTX push and one pop, named op.phase (checked with a fake on CPU)."""
    x, w1, w2 = _mlp(device)
    calls = []
    prof = Profiler(memory=False)
    prof_start = prof.start

    def start():
        p = prof_start()
        p._push, p._pop = (lambda n: calls.append(("push", n))), (lambda: calls.append(("pop",)))
        return p

    monkeypatch.setattr(prof, "start", start)
    with prof:
        _run(x, w1, w2)
    pushes = [c[1] for c in calls if c[0] == "push"]
    assert pushes[:2] == ["matmul.forward", "relu.forward"] and "matmul.backward" in pushes
    assert len(pushes) == len([c for c in calls if c[0] == "pop"]) == 10


@pytest.mark.cuda
def test_nvtx_available_on_gpu():
    from bluprofiler.timing import Nvtx, cupy_or_none

    assert Nvtx(cupy_or_none()).available


def test_nested_op_spans_are_not_counted_twice():
    """An op run inside another op's span (e.g. a checkpointed forward recomputed in backward)."""
    from bluprofiler.events import OpEvent
    from bluprofiler.result import ProfileResult

    ms = 1_000_000
    ev = [OpEvent("step", "region", "", 0, 0, 1, 0, 100 * ms),
          OpEvent("mm", "backward", "k", 1, 1, 1, 10 * ms, 50 * ms),
          OpEvent("mm", "forward", "k", 2, 2, 1, 20 * ms, 30 * ms),
          OpEvent("gelu", "forward", "k", 3, 2, 1, 32 * ms, 36 * ms),
          OpEvent("mm", "forward", "k", 4, 1, 1, 60 * ms, 70 * ms)]
    res = ProfileResult(ev, [], 0, 100 * ms, 0, "cpu", False)
    rows = {r["name"]: r for r in res.summary()}
    assert rows["mm.backward"]["total_ms"] == pytest.approx(40) and rows["mm.backward"]["self_ms"] == pytest.approx(26)
    assert rows["mm.forward"]["self_ms"] == pytest.approx(20) and rows["gelu.forward"]["self_ms"] == pytest.approx(4)
    assert sum(r["share"] for r in rows.values()) == pytest.approx(50.0)
    assert res.summary(sort_by="self")[0]["name"] == "mm.backward"
