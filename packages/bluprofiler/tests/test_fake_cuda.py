"""The CUDA code paths (event timer, memory hook, NVTX, trace GPU lane) driven by a fake CuPy on CPU,
so a typo there fails CI even without a GPU; the cuda-marked twins check the real thing."""

from __future__ import annotations

import json

import blutensor as bt
import fake_cuda
import pytest
from bluprofiler import memory, profile, profiler
from bluprofiler.memory import MemoryTracker, make_cupy_hook


def fake_cupy(allocator=None):
    """The repository's fake CUDA device (testing/fake_cuda/) as these tests want it: the current stream's handle
    0x77, 1 KiB in CuPy's pool before the session, and ``allocator`` (when given) set as CuPy's allocator."""
    cp = fake_cuda.make_cupy(null_stream_ptr=0x77, pool_used_bytes=1024)
    if allocator is not None:
        cp.cuda.set_allocator(allocator)
    return cp


def test_memory_hook_records_and_attributes(monkeypatch):
    tr = MemoryTracker()
    hook = make_cupy_hook(fake_cupy(), tr.raw)
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
    fake = fake_cupy()
    monkeypatch.setattr(profiler, "cupy_or_none", lambda: fake)
    fake.device.nvtx_ranges.clear()
    x = bt.randn(32, 32, requires_grad=True)
    with profile(nvtx=True) as prof:
        assert len(fake.device.hooks) == 1
        bt.sum(bt.exp(x)).backward()
    assert fake.device.hooks == []
    res = prof.result
    assert res.device == "cuda" and res.gpu_timing and res.baseline_bytes == 1024
    ops = res.ops()
    assert [e.key for e in ops] == ["exp.forward", "sum.forward", "sum.backward", "exp.backward"]
    for e in ops:
        assert e.stream == 0x77 and e.gpu_ms is not None and 0 <= e.gpu_ms <= e.cpu_us / 1e3 + 1.0
        assert e.gpu_start_ms >= 0 and e._ev is None
    assert [n for n in fake.device.nvtx_ranges if n] == [e.key for e in ops]
    assert fake.device.nvtx_ranges.count(None) == len(ops)
    assert not res.mem_events  # the fake pool allocates nothing; NumPy arrays are not tracked in CUDA mode
    tr = json.loads(json.dumps(res.chrome_trace()))
    gpu = [e for e in tr["traceEvents"] if e["ph"] == "X" and e["pid"] == 2]
    assert len(gpu) == 4 and {e["tid"] for e in gpu} == {1}
    names = {e["args"]["name"] for e in tr["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "stream 0x77" in names
    assert "host ms" in res.table()
    assert set(fake.device.event_flags) == {0}  # timing events, no blocking sync


def test_foreign_allocator_falls_back_to_output_tracking(monkeypatch):
    """With an allocator that is not a CuPy MemoryPool (bluallocator), pool hooks would see nothing:
    the profiler tracks op outputs instead and says so."""
    fake = fake_cupy(allocator=lambda n: None)
    monkeypatch.setattr(profiler, "cupy_or_none", lambda: fake)
    a = bt.randn(16, 16)
    with profile() as prof:
        assert fake.device.hooks == []
        bt.exp(a)
    res = prof.result
    assert [(m.kind, m.owner, m.nbytes) for m in res.mem_events if m.kind == "alloc"] == [
        ("alloc", "exp.forward", 16 * 16 * 4)]
    assert "not a MemoryPool" in res.meta["memory_source"] and "not a MemoryPool" in res.table()


def test_failed_start_leaves_nothing_behind(monkeypatch):
    from bluprofiler import ProfilerError, active
    from blutensor import ext

    fake = fake_cupy()

    def broken(ev, stream):
        raise RuntimeError("cudaEventRecord failed")

    fake.cuda.runtime.eventRecord = broken
    monkeypatch.setattr(profiler, "cupy_or_none", lambda: fake)
    try:
        profile().start()
    except RuntimeError as e:
        assert "cudaEventRecord" in str(e)
    assert active() is None and ext.op_observers() == () and ext.backward_observers() == () and fake.device.hooks == []
    monkeypatch.setattr(profiler, "cupy_or_none", lambda: None)
    with profile():
        pass
    try:
        profile(device="cuda").start()
    except ProfilerError:
        pass
    assert active() is None


def test_nvtx_default_follows_an_attached_tool(monkeypatch):
    """nvtx=None (default): ranges only when an NVTX tool is injected (Nsight sets
    NVTX_INJECTION64_PATH); nvtx=False wins even then."""
    fake = fake_cupy()
    monkeypatch.setattr(profiler, "cupy_or_none", lambda: fake)
    monkeypatch.delenv("NVTX_INJECTION64_PATH", raising=False)
    monkeypatch.delenv("NVTX_INJECTION32_PATH", raising=False)
    x = bt.randn(4)
    fake.device.nvtx_ranges.clear()
    with profile(memory=False) as prof:
        bt.exp(x)
    assert fake.device.nvtx_ranges == [] and prof.result.meta["nvtx"] is False
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/opt/nsight/libToolsInjection64.so")
    with profile(memory=False) as prof:
        bt.exp(x)
    assert fake.device.nvtx_ranges == ["exp.forward", None] and prof.result.meta["nvtx"] is True
    fake.device.nvtx_ranges.clear()
    with profile(memory=False, nvtx=False):
        bt.exp(x)
    assert fake.device.nvtx_ranges == []


def test_view_ops_get_host_only_spans_and_no_events(monkeypatch, tmp_path):
    """View ops (blutensor's VIEW flag) launch no kernel: their spans are host-timed, consume no
    CUDA events, are listed with CUDA-event time 0 and marked host-only in table and trace; their backward
    is host-only too where it is a view (transpose always; view when the grad is contiguous), while
    expand's backward (a sum) keeps its events."""
    fake = fake_cupy()
    rt = fake.cuda.runtime
    monkeypatch.setattr(profiler, "cupy_or_none", lambda: fake)
    x = bt.randn(4, 6, requires_grad=True)
    b = bt.randn(1, 6, requires_grad=True)
    with profile(memory=False) as prof:
        r0 = rt.records
        y = x.view(6, 4)  # view: host-only
        n_view = rt.records - r0
        z = bt.exp(y.transpose(0, 1))  # transpose: host-only; exp: 2 events
        w = z + b.expand(4, 6)  # expand: events (bf16 widening; its backward sums)
        bt.sum(w).backward()
    res = prof.result
    assert n_view == 0
    by = {e.key: e for e in res.ops()}
    host = {k for k, e in by.items() if e.host_only}
    # expand is VIEW but not BF16_NATIVE (a bfloat16 input is widened by a kernel): keeps its events
    assert host == {"view.forward", "transpose.forward", "transpose.backward", "view.backward"}, host
    for e in by.values():
        if e.host_only:
            assert e.gpu_ms == 0.0 and e.gpu_start_ms is None and e.cpu_us >= 0 and e.stream == 0x77
        else:
            assert e.gpu_ms is not None and e.gpu_start_ms is not None
    evented = len(by) - len(host)
    # base event + two per evented span
    assert res.meta["cuda_events_recorded"] == 2 * evented and rt.records == 1 + 2 * evented
    rows = {r["name"]: r for r in res.summary()}
    assert rows["view.forward"]["host_only"] and rows["view.forward"]["gpu_ms"] == 0.0
    assert not rows["exp.forward"]["host_only"] and not rows["expand.backward"]["host_only"]
    table = res.table()
    assert "host-only" in [ln.split()[3] for ln in table.splitlines() if ln.startswith("view.forward")]
    assert "host-only: view ops" in table
    tr = res.chrome_trace()["traceEvents"]
    gpu_names = {e["name"] for e in tr if e.get("pid") == 2 and e["ph"] == "X"}
    assert "view.forward" not in gpu_names and "exp.forward" in gpu_names
    host_ev = [e for e in tr if e.get("pid") == 1 and e["ph"] == "X" and e["name"] == "view.forward"]
    assert host_ev and host_ev[0]["args"]["host_only"] is True
    from bluprofiler.sinks import JsonlSink, load_jsonl

    back = load_jsonl(JsonlSink.write(res, tmp_path))  # events.jsonl keeps the mark
    assert {e.key for e in back.ops() if e.host_only} == host
    assert {r["name"] for r in back.summary() if r["host_only"]} == {r["name"] for r in res.summary() if r["host_only"]}


def test_view_backward_of_a_non_contiguous_grad_keeps_its_events(monkeypatch):
    """view's backward reshapes the incoming grad: a copy (a kernel) when that grad is not
    C-contiguous, so the span keeps its events then."""
    fake = fake_cupy()
    monkeypatch.setattr(profiler, "cupy_or_none", lambda: fake)
    x = bt.randn(4, 6, requires_grad=True)
    with profile(memory=False) as prof:
        y = x.view(6, 4).transpose(0, 1).contiguous()  # view.backward gets a transposed grad
        bt.sum(bt.exp(y)).backward()
    by = {e.key: e for e in prof.result.ops()}
    assert by["transpose.backward"].host_only and not by["view.backward"].host_only
    assert by["view.backward"].gpu_start_ms is not None


def test_gpu_events_off_keeps_a_gpu_session_host_timed(monkeypatch):
    fake = fake_cupy()
    monkeypatch.setattr(profiler, "cupy_or_none", lambda: fake)
    with profile(memory=False, gpu_events=False) as prof:
        bt.exp(bt.randn(4))
    res = prof.result
    assert fake.cuda.runtime.records == 0 and not res.gpu_timing and res.device == "cuda"
    assert res.ops()[0].gpu_ms is None and not res.ops()[0].host_only


@pytest.mark.cuda
def test_view_ops_host_only_on_gpu():
    """The GPU twin of the fake-CuPy test: view spans carry no events, kernels keep theirs."""
    import cupy as cp

    a = bt.randn(64, 64, device="cuda", requires_grad=True)
    bt.sum(bt.matmul(a.transpose(0, 1), a)).backward()
    cp.cuda.Device().synchronize()
    with profile(memory=False) as prof:
        bt.sum(bt.matmul(a.transpose(0, 1), a)).backward()
    res = prof.result
    by = {e.key: e for e in res.ops()}
    assert by["transpose.forward"].host_only and by["transpose.forward"].gpu_ms == 0.0
    assert by["transpose.backward"].host_only
    assert not by["matmul.forward"].host_only and by["matmul.forward"].gpu_ms > 0
    assert res.meta["cuda_events_recorded"] == 2 * sum(not e.host_only for e in res.ops())


def test_identity_backward_is_host_only_and_plugin_view_kernels_keep_events(monkeypatch):
    """contiguous/clone backward return the grad itself (host-only); a plugin kernel chosen for a
    view op may launch work, so that op keeps its events."""
    from blutensor import ext

    fake = fake_cupy()
    monkeypatch.setattr(profiler, "cupy_or_none", lambda: fake)
    real = ext.resolve_kernel

    class PluginGetitem:
        PLUGIN_NAME = "test.getitem"

    monkeypatch.setattr(ext, "resolve_kernel", lambda op, be, dt: PluginGetitem if op == "getitem" and be == "cuda"
                        else real(op, be, dt))
    x = bt.randn(4, 6, requires_grad=True)
    with profile(memory=False) as prof:
        y = x.transpose(0, 1).contiguous()
        z = x[1:3]
        (bt.sum(bt.exp(y)) + bt.sum(z.clone())).backward()
    by = {e.key: e for e in prof.result.ops()}
    assert by["contiguous.backward"].host_only and by["clone.backward"].host_only
    assert not by["contiguous.forward"].host_only and not by["clone.forward"].host_only
    assert not by["getitem.forward"].host_only  # the (pretend) plugin kernel keeps its events
    assert by["transpose.forward"].host_only


def test_end_only_events_chain_spans(monkeypatch):
    """gpu_events="end": one event per evented op span; a span's GPU interval runs from the latest
    event recorded before it opened (the base event for the first) to its own end event, so
    consecutive spans tile the GPU lane; regions keep their own start and end events."""
    fake = fake_cupy()
    rt = fake.cuda.runtime
    monkeypatch.setattr(profiler, "cupy_or_none", lambda: fake)
    x = bt.randn(8, 8, requires_grad=True)
    with profile(memory=False, gpu_events="end") as prof:
        y = bt.exp(x)
        with prof.region("mid"):
            z = bt.tanh(y.transpose(0, 1))  # transpose: host-only, no event
        bt.sum(z).backward()
    res = prof.result
    ops = res.ops()
    evented = [e for e in ops if not e.host_only]
    assert res.meta["cuda_events_recorded"] == len(evented) + 2  # + the region's start and end
    assert rt.records == 1 + len(evented) + 2  # + the base event
    by = {e.key: e for e in res.events}
    assert by["exp.forward"].gpu_start_ms == 0.0  # the first span starts at the base event
    mid = by["mid"]
    tanh = by["tanh.forward"]
    # tanh opened right after the region's start event: its interval starts there
    assert abs(tanh.gpu_start_ms - mid.gpu_start_ms) < 1e-9
    assert mid.gpu_start_ms <= tanh.gpu_start_ms + tanh.gpu_ms <= mid.gpu_start_ms + mid.gpu_ms + 1e-9
    chain = sorted(evented, key=lambda e: e.index)
    for a, b in zip(chain, chain[1:]):
        if b.key not in ("tanh.forward", "sum.forward"):  # (the region's events sit in between)
            assert abs(b.gpu_start_ms - (a.gpu_start_ms + a.gpu_ms)) < 1e-6
    assert abs(by["sum.forward"].gpu_start_ms - (mid.gpu_start_ms + mid.gpu_ms)) < 1e-6  # after the region
    for e in evented:
        assert e.gpu_ms >= 0
    try:
        profile(gpu_events="both")
    except profiler.ProfilerError as e:
        assert "gpu_events" in str(e)
    else:
        raise AssertionError("bad gpu_events accepted")
