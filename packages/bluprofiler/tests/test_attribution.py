"""Who owns an allocation: the op (forward or backward) or region running when it happens, read from
one global the observers set; the allocator callbacks (CuPy hook, bluallocator listener) only append
tuples; frees get their allocation's owner when the session stops. Also the reused CUDA event pool."""

from __future__ import annotations

import sys
import types

import blutensor as bt
import pytest
from bluprofiler import memory, profile, profiler, timing
from blutensor import ext
from test_fake_cuda import fake_cupy


def _inner_observers(on_forward, on_backward):
    """Observers added after the profiler's run inside its spans (as an allocator would)."""

    def fwd(op, inputs, attrs, run):
        res = run()
        on_forward(op)
        return res

    def bwd(node, grad, run):
        res = run()
        on_backward(node.op)
        return res

    return fwd, bwd


def test_owner_global_follows_ops_regions_and_backward():
    seen = []
    fwd, bwd = _inner_observers(lambda op: seen.append((op, memory.OWNER)),
                                lambda op: seen.append((op, memory.OWNER)))
    x = bt.randn(4, 4, requires_grad=True)
    with profile(memory=False) as prof:
        ext.add_op_observer(fwd)
        ext.add_backward_observer(bwd)
        try:
            with prof.region("fwd"):
                y = bt.sum(bt.exp(x))
                seen.append(("-", memory.OWNER))
            y.backward()
            seen.append(("-", memory.OWNER))
        finally:
            ext.remove_op_observer(fwd)
            ext.remove_backward_observer(bwd)
    assert seen == [("exp", "exp.forward"), ("sum", "sum.forward"), ("-", "fwd"),
                    ("sum", "sum.backward"), ("exp", "exp.backward"), ("-", "other")]
    assert memory.OWNER == "other"
    ev = prof.result.events
    assert [(e.key, e.depth) for e in ev] == [("fwd", 0), ("exp.forward", 1), ("sum.forward", 1),
                                             ("sum.backward", 0), ("exp.backward", 0)]
    assert [e.index for e in ev] == sorted(e.index for e in ev)


class _FakeBluallocator(types.ModuleType):
    def __init__(self):
        super().__init__("bluallocator")
        self.listeners = []

    def add_listener(self, fn):
        self.listeners.append(fn)

    def remove_listener(self, fn):
        self.listeners.remove(fn)

    def is_installed(self):
        return True

    def emit(self, event, ptr, size, stream=0x5):
        for fn in self.listeners:
            fn(event, ptr, size, stream, 123)


def test_bluallocator_listener_attributes_allocs_and_frees(monkeypatch):
    blu = _FakeBluallocator()
    monkeypatch.setitem(sys.modules, "bluallocator", blu)
    monkeypatch.setattr(profiler, "cupy_or_none", lambda: fake_cupy(allocator=lambda n: None))
    ptrs = iter(range(0x1000, 0x100000, 0x100))
    live = {}

    def on_fwd(op):
        p = next(ptrs)
        live[op] = p
        blu.emit("alloc", p, 1000 if op == "matmul" else 10)

    def on_bwd(op):
        if op == "sum":
            blu.emit("free", live["matmul"], 1000)  # freed during sum.backward, owned by matmul.forward
        blu.emit("alloc", next(ptrs), 7)

    fwd, bwd = _inner_observers(on_fwd, on_bwd)
    a, b = bt.randn(3, 4, requires_grad=True), bt.randn(4, 2, requires_grad=True)
    blu.emit("free", 0x42, 64)  # before the session: not recorded
    with profile(nvtx=False) as prof:
        assert len(blu.listeners) == 1
        ext.add_op_observer(fwd)
        ext.add_backward_observer(bwd)
        try:
            bt.sum(bt.matmul(a, b)).backward()
            blu.emit("free", 0x77777, 5)  # allocated before the session
        finally:
            ext.remove_op_observer(fwd)
            ext.remove_backward_observer(bwd)
    assert blu.listeners == []
    res = prof.result
    assert res.meta["memory_source"] == "bluallocator listener"
    got = [(m.kind, m.nbytes, m.owner, m.stream) for m in res.mem_events]
    assert got == [("alloc", 1000, "matmul.forward", 0x5), ("alloc", 10, "sum.forward", 0x5),
                   ("free", 1000, "matmul.forward", 0x5), ("alloc", 7, "sum.backward", 0x5),
                   ("alloc", 7, "matmul.backward", 0x5), ("free", 5, "?", 0x5)]
    p = res.peak_memory()
    assert p["peak_bytes"] == 1010 and p["by_owner"] == {"matmul.forward": 1000, "sum.forward": 10}


def test_listener_ignored_when_bluallocator_is_not_installed(monkeypatch):
    blu = _FakeBluallocator()
    blu.is_installed = lambda: False
    monkeypatch.setitem(sys.modules, "bluallocator", blu)
    monkeypatch.setattr(profiler, "cupy_or_none", lambda: fake_cupy(allocator=lambda n: None))
    with profile() as prof:
        assert blu.listeners == []
        bt.exp(bt.randn(4))
    assert "not a MemoryPool" in prof.result.meta["memory_source"]


def test_event_pool_grows_is_reused_and_every_span_gets_its_own_pair(monkeypatch):
    fake = fake_cupy()
    monkeypatch.setattr(profiler, "cupy_or_none", lambda: fake)
    monkeypatch.setattr(timing, "POOL_START", 4)
    x = bt.randn(8, 8, requires_grad=True)
    with profile() as prof:
        with prof.region("step"):
            bt.sum(bt.exp(bt.tanh(x))).backward()
    pool = prof.gpu.events
    ev = prof.result.events
    assert len(ev) == 7 and len(pool) >= 14 and len(pool) % 4 == 0  # grown by doubling from 4
    for e in ev:
        assert e.gpu_ms is not None and e.gpu_ms >= 0 and e.gpu_start_ms >= 0 and e.stream == 0x77
    step = ev[0]
    assert step.key == "step" and all(step.gpu_start_ms <= e.gpu_start_ms for e in ev)
    with profile() as prof2:
        bt.exp(x)
    assert prof2.gpu.events is pool  # one pool per device, kept between sessions
    assert prof2.result.events[0].gpu_ms is not None


@pytest.mark.cuda
def test_event_pool_on_gpu_matches_raw_events():
    import cupy as cp

    a = bt.randn(1024, 1024, device="cuda")
    bt.matmul(a, a)
    cp.cuda.Device().synchronize()
    with profile() as prof:
        for _ in range(3):
            bt.matmul(a, a)
    ops = prof.result.ops()
    assert len(ops) == 3 and all(e.gpu_ms > 0 and e.stream == cp.cuda.get_current_stream().ptr for e in ops)
    starts = [e.gpu_start_ms for e in ops]
    assert starts == sorted(starts)
