"""Pinned host allocator: caching, lifetime through views, stream-deferred reuse, CPU fallback."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from bluallocator import FakeDeviceBackend, PinnedHostAllocator
from bluallocator.pinned import host_size_class


def _ptr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def test_fallback_gives_plain_numpy_and_says_so():
    h = PinnedHostAllocator(pinned=False)
    x = h.empty((3, 4), np.float32)
    assert x.shape == (3, 4) and x.dtype == np.float32 and x.flags.c_contiguous and x.flags.writeable
    x[...] = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert x.sum() == 66
    assert h.pinned is False and h.is_pinned(x) is False
    assert h.memory_stats()["pinned"] is False


def test_buffers_are_reused_after_the_last_view_dies():
    h = PinnedHostAllocator(pinned=False)
    x = h.empty(1000, np.float64)
    base = _ptr(x)
    v = x[10:].reshape(-1, 10)
    del x
    gc.collect()
    y = h.empty(1000, np.float64)
    assert _ptr(y) != base, "a view still holds the first buffer"
    del v
    gc.collect()
    z = h.empty(990, np.float64)  # same size class (8 KiB)
    assert _ptr(z) == base
    st = h.memory_stats()
    assert st["num_host_allocs"] == 2 and st["num_allocs"] == 3
    assert st["allocated_bytes"] == 2 * host_size_class(8000)
    del y, z
    gc.collect()
    assert h.empty_cache() == 2 * host_size_class(8000)
    assert h.memory_stats()["reserved_bytes"] == 0


def test_record_stream_defers_reuse_until_the_copy_finished():
    be = FakeDeviceBackend()
    h = PinnedHostAllocator(pinned=False, event_backend=be)
    x = h.empty(4096, np.uint8)
    base = _ptr(x)
    be.enqueue(3)  # an async copy from x is queued on stream 3
    h.record_stream(x, 3)
    del x
    gc.collect()
    y = h.empty(4096, np.uint8)
    assert _ptr(y) != base
    be.synchronize(3)
    z = h.empty(4096, np.uint8)
    assert _ptr(z) == base


def test_size_classes_and_bad_input():
    assert host_size_class(1) == 512 and host_size_class(5000) == 8192
    assert host_size_class((1 << 20) + 1) == 2 << 20
    h = PinnedHostAllocator(pinned=False)
    with pytest.raises(ValueError, match="negative"):
        h.empty((2, -1))
    with pytest.raises(ValueError, match="not allocated"):
        h.record_stream(np.zeros(3), 0) if h._events else h._block_ptr(np.zeros(3))
    assert h.empty((0,), np.float32).shape == (0,)


def test_pinned_true_without_cuda_is_refused_or_pinned():
    from bluallocator.cuda_backend import cuda_available
    if cuda_available():
        pytest.skip("a GPU is present: covered by the cuda test")
    with pytest.raises(RuntimeError, match="needs CuPy and a CUDA device"):
        PinnedHostAllocator(pinned=True)


@pytest.mark.cuda
def test_pinned_memory_is_page_locked_and_copies_asynchronously():
    import cupy
    h = PinnedHostAllocator()
    assert h.pinned
    x = h.empty((256, 1024), np.float32)
    x[...] = np.random.default_rng(0).standard_normal(x.shape, dtype=np.float32)
    attrs = cupy.cuda.runtime.pointerGetAttributes(_ptr(x))
    assert attrs.type == cupy.cuda.runtime.memoryTypeHost
    s = cupy.cuda.Stream(non_blocking=True)
    d = cupy.empty(x.shape, np.float32)
    d.set(x, stream=s)
    h.record_stream(x, s.ptr)
    s.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(d), x)
    assert h.is_pinned(x)
