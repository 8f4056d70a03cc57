"""The CUDA code paths (event timer, memory hook, NVTX, trace GPU lane) driven by a fake CuPy on CPU,
so a typo there fails CI even without a GPU; the cuda-marked twins check the real thing."""

from __future__ import annotations

import json
import time
import types

import blutensor as bt
from bluprofiler import memory, profile, profiler
from bluprofiler.memory import MemoryTracker, make_cupy_hook


class _Hook:
    def __enter__(self):
        FakeCupy.hooks.append(self)
        return self

    def __exit__(self, *a):
        FakeCupy.hooks.remove(self)


class _Event:
    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass


class _Pool:
    def malloc(self, n):
        raise AssertionError("not called")


class FakeCupy:
    hooks: list = []
    pushed: list = []

    def __init__(self, allocator=None):
        pool = _Pool()
        self.cuda = types.SimpleNamespace(
            MemoryPool=_Pool, get_allocator=lambda: allocator or pool.malloc,
            MemoryHook=_Hook, Event=_Event, get_current_stream=lambda: types.SimpleNamespace(ptr=0x77),
            get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3,
            Device=lambda *a: types.SimpleNamespace(synchronize=lambda: None),
            nvtx=types.SimpleNamespace(available=True, RangePush=lambda n: FakeCupy.pushed.append(n),
                                       RangePop=lambda: FakeCupy.pushed.append(None)))
        self.get_default_memory_pool = lambda: types.SimpleNamespace(used_bytes=lambda: 1024)


def test_memory_hook_records_and_attributes(monkeypatch):
    tr = MemoryTracker()
    hook = make_cupy_hook(FakeCupy(), tr.raw)
    monkeypatch.setattr(memory, "OWNER", "matmul.forward")
    hook.alloc_postprocess(device_id=0, mem_size=2 << 20, mem_ptr=0x1000)
    hook.malloc_postprocess(device_id=0, size=1000, mem_size=1024, mem_ptr=0x1000, pmem_id=1)
    monkeypatch.setattr(memory, "OWNER", "exp.forward")
    hook.malloc_postprocess(device_id=0, size=500, mem_size=512, mem_ptr=0x1400, pmem_id=2)
    hook.free_postprocess(device_id=0, mem_size=1024, mem_ptr=0x1000, pmem_id=1)
    hook.free_postprocess(device_id=0, mem_size=256, mem_ptr=0x9000, pmem_id=3)  # allocated before the session
    assert all(type(r) is tuple for r in tr.raw)  # the hot path builds no objects beyond one tuple
    kinds = [(e.kind, e.nbytes, e.owner, e.stream, e.device) for e in tr.build_events()]
    assert kinds == [("reserve", 2 << 20, "matmul.forward", 0x77, "cuda:0"),
                     ("alloc", 1024, "matmul.forward", 0x77, "cuda:0"),
                     ("alloc", 512, "exp.forward", 0x77, "cuda:0"),
                     ("free", 1024, "matmul.forward", 0x77, "cuda:0"),  # the free keeps the allocating owner
                     ("free", 256, "?", 0, "cuda:0")]


def test_profiler_cuda_path_with_fake_cupy(monkeypatch, tmp_path):
    fake = FakeCupy()
    monkeypatch.setattr(profiler, "cupy_or_none", lambda: fake)
    FakeCupy.pushed.clear()
    x = bt.randn(32, 32, requires_grad=True)
    with profile() as prof:
        assert len(FakeCupy.hooks) == 1
        bt.sum(bt.exp(x)).backward()
    assert FakeCupy.hooks == []
    res = prof.result
    assert res.device == "cuda" and res.gpu_timing and res.baseline_bytes == 1024
    ops = res.ops()
    assert [e.key for e in ops] == ["exp.forward", "sum.forward", "sum.backward", "exp.backward"]
    for e in ops:
        assert e.stream == 0x77 and e.gpu_ms is not None and 0 <= e.gpu_ms <= e.cpu_us / 1e3 + 1.0
        assert e.gpu_start_ms >= 0 and e._ev is None
    assert [n for n in FakeCupy.pushed if n] == [e.key for e in ops]
    assert FakeCupy.pushed.count(None) == len(ops)
    assert not res.mem_events  # the fake pool allocates nothing; NumPy arrays are not tracked in CUDA mode
    tr = json.loads(json.dumps(res.chrome_trace()))
    gpu = [e for e in tr["traceEvents"] if e["ph"] == "X" and e["pid"] == 2]
    assert len(gpu) == 4 and {e["tid"] for e in gpu} == {1}
    names = {e["args"]["name"] for e in tr["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "stream 0x77" in names
    assert "host ms" in res.table()


def test_foreign_allocator_falls_back_to_output_tracking(monkeypatch):
    """With an allocator that is not a CuPy MemoryPool (bluallocator), pool hooks would see nothing:
    the profiler tracks op outputs instead and says so."""
    fake = FakeCupy(allocator=lambda n: None)
    monkeypatch.setattr(profiler, "cupy_or_none", lambda: fake)
    a = bt.randn(16, 16)
    with profile() as prof:
        assert FakeCupy.hooks == []
        bt.exp(a)
    res = prof.result
    assert [(m.kind, m.owner, m.nbytes) for m in res.mem_events if m.kind == "alloc"] == [
        ("alloc", "exp.forward", 16 * 16 * 4)]
    assert "not a MemoryPool" in res.meta["memory_source"] and "not a MemoryPool" in res.table()


def test_failed_start_leaves_nothing_behind(monkeypatch):
    from bluprofiler import ProfilerError, active
    from blutensor.autograd import engine
    from blutensor.ops import dispatch

    fake = FakeCupy()

    class Broken(_Event):
        def record(self):
            raise RuntimeError("cudaEventRecord failed")

    fake.cuda.Event = Broken
    monkeypatch.setattr(profiler, "cupy_or_none", lambda: fake)
    try:
        profile().start()
    except RuntimeError as e:
        assert "cudaEventRecord" in str(e)
    assert active() is None and dispatch.observers == [] and engine.backward_observers == [] and FakeCupy.hooks == []
    monkeypatch.setattr(profiler, "cupy_or_none", lambda: None)
    with profile():
        pass
    try:
        profile(device="cuda").start()
    except ProfilerError:
        pass
    assert active() is None
