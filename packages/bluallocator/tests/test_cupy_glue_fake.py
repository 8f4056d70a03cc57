"""CPU twins of test_cupy.py: the CuPy glue driven through the repository's fake CUDA device (testing/fake_cuda/)
with simulated memory (bluallocator's FakeDeviceBackend): install, GC-driven frees, record_stream, the OOM retry run
for real; only the device is simulated."""

from __future__ import annotations

import gc

import bluallocator
import fake_cuda
import pytest
from bluallocator import FakeDeviceBackend, OutOfMemoryError, cupy_glue

MiB = 1 << 20


@pytest.fixture
def fcupy(monkeypatch):
    mod = fake_cuda.install(monkeypatch, memory=FakeDeviceBackend(256 * MiB))
    monkeypatch.setattr(cupy_glue, "_allocators", {})
    monkeypatch.setattr(cupy_glue, "_state", {"installed": False, "previous": None, "alloc_fn": None,
                                              "kwargs": {}})
    yield mod
    gc.collect()


def test_arrays_come_from_our_allocator_and_are_freed_on_gc(fcupy):
    a = bluallocator.install()
    assert bluallocator.is_installed() and fcupy.cuda.get_allocator() is not None
    x = fcupy.empty(4 * MiB)
    y = fcupy.empty(4 * MiB)
    assert a.memory_stats()["allocated_bytes"] == 8 * MiB
    xp = x.data.ptr
    del x, y
    gc.collect()
    assert a.memory_stats()["allocated_bytes"] == 0
    z = fcupy.empty(4 * MiB)
    assert z.data.ptr == xp


def test_views_keep_the_block_alive(fcupy):
    a = bluallocator.install()
    x = fcupy.empty(8000)
    v = x.view()
    ptr = x.data.mem.ptr
    del x
    gc.collect()
    assert ptr in a._allocated
    del v
    gc.collect()
    assert ptr not in a._allocated


def test_record_stream_on_an_array_defers_reuse(fcupy):
    a = bluallocator.install()
    x = fcupy.empty(16384)
    ptr = x.data.mem.ptr
    fcupy.device.memory.enqueue(77)  # stream 77 has queued work reading x
    bluallocator.record_stream(x, 77)
    del x
    gc.collect()
    assert a.memory_stats()["pending_free_bytes"] == 16384
    z = fcupy.empty(16384)
    assert z.data.ptr != ptr
    fcupy.device.memory.synchronize(77)
    w = fcupy.empty(16384)
    assert w.data.ptr == ptr


def test_allocations_follow_the_current_stream(fcupy):
    a = bluallocator.install()
    x = fcupy.empty(4096)
    p = x.data.ptr
    del x
    fcupy.cuda.Stream(ptr=5).use()
    y = fcupy.empty(4096)
    assert y.data.ptr != p and a.memory_stats()["segments"] == 2


def test_graph_pool_blocks_stay_in_the_graph_pool(fcupy):
    a = bluallocator.install()
    fcupy.device.memory.begin_capture(9)
    fcupy.cuda.Stream(ptr=9).use()
    with a.graph_pool() as pid:
        t = fcupy.empty(MiB)
        u = fcupy.empty(3 * MiB)
        del t
        out = fcupy.empty(MiB)
    fcupy.device.memory.end_capture(9)
    spans = [(s["ptr"], s["ptr"] + s["size"]) for s in a.snapshot() if s["pool"] == f"private:{pid}"]
    others = [fcupy.empty(n) for n in (MiB, MiB, 3 * MiB, 1000)]
    for o in others:
        assert not any(lo <= o.data.ptr < hi for lo, hi in spans)
    del u, out, others
    gc.collect()
    a.release_pool(pid)
    assert a.memory_stats()["private_pools"] == 0


def test_oom_runs_gc_then_retries(fcupy):
    a = bluallocator.install()

    class Cycle:
        pass

    c = Cycle()
    c.self = c
    c.buf = fcupy.empty(200 * MiB)  # only a reference cycle holds it
    del c
    gc.disable()
    try:
        y = fcupy.empty(200 * MiB)  # fails until the cycle is collected
    finally:
        gc.enable()
    assert a.memory_stats()["allocated_bytes"] == 200 * MiB
    with pytest.raises(OutOfMemoryError, match="tried to allocate"):
        fcupy.empty(400 * MiB)
    del y


def test_uninstall_restores_the_previous_allocator(fcupy):
    prev = fcupy.cuda.get_allocator()
    bluallocator.install()
    bluallocator.install()  # idempotent
    bluallocator.uninstall()
    assert fcupy.cuda.get_allocator() is prev and not bluallocator.is_installed()


def test_plugins_with_fake_cupy(fcupy):
    from bluallocator.hooks import CachingAllocatorPlugin
    assert CachingAllocatorPlugin.is_available()
    a = CachingAllocatorPlugin.install()
    x = fcupy.empty(4 * MiB)
    assert CachingAllocatorPlugin.memory_stats()["allocated_bytes"] == 4 * MiB
    del x
    gc.collect()
    assert CachingAllocatorPlugin.empty_cache() == 20 * MiB
    CachingAllocatorPlugin.uninstall()
    assert a.memory_stats()["reserved_bytes"] == 0


def test_no_usable_gpu_and_bad_device_are_named(fcupy, monkeypatch):
    """CuPy installed but no usable GPU (cudaErrorInsufficientDriver here): a RuntimeError saying so, not the raw
    CUDARuntimeError from deep inside; a device that is not an index is refused by name."""
    def no_driver():
        raise fcupy.cuda.runtime.CUDARuntimeError(35)

    with pytest.raises(TypeError, match=r"device must be a CUDA device index \(int\) or None, got str 'x'"):
        bluallocator.memory_stats("x")
    monkeypatch.setattr(fcupy.cuda.runtime, "getDevice", no_driver)
    for call in (bluallocator.install, bluallocator.memory_stats):
        with pytest.raises(RuntimeError, match="bluallocator needs a usable CUDA device: CuPy is installed but"):
            call()
    assert not bluallocator.is_installed() and fcupy.cuda.get_allocator() == "cupy-pool"  # left as it was


def test_plugin_stats_and_peak_reset_per_device(monkeypatch):
    """Two fake GPUs: the plugin's memory_stats / reset_peak_stats take a device index, as blutensor's
    bt.cuda.max_memory_allocated(device) asks them; is_installed() tells that CuPy allocates through us."""
    from bluallocator.hooks import CachingAllocatorPlugin

    fcp = fake_cuda.install(monkeypatch, memory=FakeDeviceBackend(256 * MiB), device_count=2)
    monkeypatch.setattr(cupy_glue, "_allocators", {})
    monkeypatch.setattr(cupy_glue, "_state", {"installed": False, "previous": None, "alloc_fn": None, "kwargs": {}})
    assert not CachingAllocatorPlugin.is_installed()
    CachingAllocatorPlugin.install()
    assert CachingAllocatorPlugin.is_installed()
    x = fcp.empty(4 * MiB)
    with fcp.cuda.Device(1):
        y = fcp.empty(MiB)
    del x
    gc.collect()
    s0, s1 = CachingAllocatorPlugin.memory_stats(0), CachingAllocatorPlugin.memory_stats(device=1)
    assert (s0["allocated_bytes"], s0["peak_allocated_bytes"], s0["reserved_bytes"]) == (0, 4 * MiB, 20 * MiB)
    assert (s1["allocated_bytes"], s1["peak_allocated_bytes"], s1["reserved_bytes"]) == (MiB, MiB, 2 * MiB)
    assert CachingAllocatorPlugin.memory_stats() == s0  # the current device
    CachingAllocatorPlugin.reset_peak_stats(0)
    assert CachingAllocatorPlugin.memory_stats(0)["peak_allocated_bytes"] == 0
    assert CachingAllocatorPlugin.memory_stats(1)["peak_allocated_bytes"] == MiB  # device 1 untouched
    del y
    gc.collect()
    CachingAllocatorPlugin.uninstall()
    assert not CachingAllocatorPlugin.is_installed()
