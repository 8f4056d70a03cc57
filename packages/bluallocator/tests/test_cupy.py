"""bluallocator installed into CuPy (GPU only); CPU twins: the fake-backend tests in test_caching*.py."""

from __future__ import annotations

import gc

import numpy as np
import pytest

pytestmark = pytest.mark.cuda
MiB = 1 << 20


@pytest.fixture
def installed():
    import bluallocator
    import cupy
    from bluallocator import CachingAllocator, CudaBackend
    before = cupy.cuda.get_allocator()
    a = bluallocator.install(CachingAllocator(CudaBackend()))
    try:
        yield a
    finally:
        cupy.cuda.Device().synchronize()
        gc.collect()
        bluallocator.uninstall()
        assert cupy.cuda.get_allocator() is before
        a.synchronize_pending()
        a.empty_cache()


def test_cupy_arrays_come_from_our_allocator_and_are_freed_on_gc(installed):
    import cupy
    a = installed
    st0 = a.memory_stats()
    x = cupy.arange(1 << 20, dtype=cupy.float32)  # 4 MiB: large pool
    y = x * 2 + 1
    st1 = a.memory_stats()
    assert st1["allocated_bytes"] - st0["allocated_bytes"] >= 8 * MiB
    assert a.allocation_size(int(x.data.mem.ptr)) >= 4 * MiB
    np.testing.assert_array_equal(cupy.asnumpy(y), np.arange(1 << 20, dtype=np.float32) * 2 + 1)
    xp = int(x.data.ptr)
    del x, y
    gc.collect()
    st2 = a.memory_stats()
    assert st2["allocated_bytes"] == st0["allocated_bytes"]
    z = cupy.empty(1 << 20, dtype=cupy.float32)
    assert int(z.data.ptr) == xp, "the freed block is reused (same stream, same size)"


def test_views_keep_the_block_alive(installed):
    import cupy
    a = installed
    x = cupy.ones(1000, dtype=cupy.float64)
    v = x[10:20]
    ptr = int(x.data.mem.ptr)
    del x
    gc.collect()
    assert ptr in a._allocated
    assert float(v.sum()) == 10.0
    del v
    gc.collect()
    assert ptr not in a._allocated


def test_record_stream_on_cupy_array_defers_reuse(installed):
    import threading

    import bluallocator
    import cupy
    a = installed
    s2 = cupy.cuda.Stream(non_blocking=True)
    x = cupy.ones(4096, dtype=cupy.float32)
    cupy.cuda.Device().synchronize()
    ptr = int(x.data.mem.ptr)
    gate = threading.Event()
    s2.launch_host_func(lambda _arg: gate.wait(30), None)  # s2 cannot run until the gate opens
    with s2:
        y = x * 3  # queued on s2 behind the gate: reads x later
    bluallocator.record_stream(x, s2)
    del x
    gc.collect()
    assert a.memory_stats()["pending_free_bytes"] >= 4096 * 4
    z = cupy.empty(4096, dtype=cupy.float32)
    assert int(z.data.ptr) != ptr, "x's block must not be reused while s2 may still read it"
    gate.set()
    s2.synchronize()
    assert float(y[0]) == 3.0
    w = cupy.empty(4096, dtype=cupy.float32)
    assert int(w.data.ptr) == ptr
    del y, z, w


def test_graph_capture_on_a_private_pool(installed):
    import cupy
    a = installed
    s = cupy.cuda.Stream(non_blocking=True)
    x = cupy.arange(1 << 16, dtype=cupy.float32)
    ((x * 2.0 + 1.0) * 3.0).sum()  # compile the kernels before capture
    cupy.cuda.Device().synchronize()
    with s:
        with a.graph_pool() as pid:
            s.begin_capture()
            t = x * 2.0  # allocated during capture in the private pool
            u = t + 1.0
            del t  # freed during capture: may be reused by this graph only
            out = u * 3.0
            g = s.end_capture()
        g.launch(stream=s)
    s.synchronize()
    expect = (np.arange(1 << 16, dtype=np.float32) * 2 + 1) * 3
    np.testing.assert_allclose(cupy.asnumpy(out), expect)
    graph_segments = [seg for seg in a.snapshot() if seg["pool"] == f"private:{pid}"]
    assert graph_segments
    spans = [(seg["ptr"], seg["ptr"] + seg["size"]) for seg in graph_segments]
    # allocations outside the graph pool never land in the graph's memory
    others = [cupy.empty(n, dtype=cupy.float32) for n in (1 << 16, 1 << 16, 1000, 1 << 20)]
    for o in others:
        p = int(o.data.ptr)
        assert not any(lo <= p < hi for lo, hi in spans)
    # replay after other allocations still gives the right answer
    x[...] = 1.0
    cupy.cuda.Device().synchronize()
    g.launch(stream=s)
    s.synchronize()
    np.testing.assert_allclose(cupy.asnumpy(out), np.full(1 << 16, 9.0, np.float32))
    del g, u, out, others
    gc.collect()
    a.release_pool(pid)


def test_uninstall_restores_cupy_pool():
    import bluallocator
    import cupy
    prev = cupy.cuda.get_allocator()
    bluallocator.install()
    assert bluallocator.is_installed()
    bluallocator.uninstall()
    assert cupy.cuda.get_allocator() is prev and not bluallocator.is_installed()


def test_plugins_install_and_report_stats():
    from bluallocator.hooks import CachingAllocatorPlugin, CupyDefaultAllocatorPlugin
    assert CachingAllocatorPlugin.is_available() and CupyDefaultAllocatorPlugin.is_available()
    import cupy
    CachingAllocatorPlugin.install()
    try:
        x = cupy.zeros(1 << 20, dtype=cupy.float32)
        assert CachingAllocatorPlugin.memory_stats()["allocated_bytes"] >= 4 * MiB
        del x
    finally:
        CachingAllocatorPlugin.uninstall()
    CupyDefaultAllocatorPlugin.install()
    y = cupy.zeros(1 << 20, dtype=cupy.float32)
    assert CupyDefaultAllocatorPlugin.memory_stats()["allocated_bytes"] >= 4 * MiB
    del y
