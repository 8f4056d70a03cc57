"""Bad input to the CPU-side API gets an error naming the culprit (argument, value, pointer, stream)."""

from __future__ import annotations

import numpy as np
import pytest
from bluallocator import CachingAllocator, FakeDeviceBackend, OutOfMemoryError, PinnedHostAllocator


def _alloc(**kw) -> CachingAllocator:
    return CachingAllocator(FakeDeviceBackend(1 << 26), **kw)


@pytest.mark.parametrize(("kw", "exc", "frag"), [
    ({"small_size": -1}, ValueError, "small_size must be >= 1, got -1"),
    ({"large_segment_size": -5}, ValueError, "large_segment_size must be >= 1, got -5"),
    ({"small_segment_size": 0}, ValueError, "small_segment_size must be >= 1, got 0"),
    ({"min_large_alloc": -1}, ValueError, "min_large_alloc must be >= 0, got -1"),
    ({"large_segment_round": 0}, ValueError, "large_segment_round must be >= 1, got 0"),
    ({"granularity": 0}, ValueError, "granularity must be >= 1, got 0"),
    ({"granularity": 768}, ValueError, "granularity must be a power of two, got 768"),
    ({"granularity": 512.0}, TypeError, "granularity must be an int, got float 512.0"),
    ({"granularity": "512"}, TypeError, "granularity must be an int, got str '512'"),
    ({"class_weight": -1.0}, ValueError, "class_weight must be a finite number >= 0, got -1.0"),
    ({"class_weight": float("nan")}, ValueError, "class_weight must be a finite number >= 0, got nan"),
    ({"profile_first_n": 0}, ValueError, "profile_first_n) must be >= 1, got 0"),
])
def test_constructor_options_out_of_range(kw, exc, frag):
    with pytest.raises(exc, match=frag.replace("(", r"\(").replace(")", r"\)")):
        _alloc(**kw)


def test_constructor_unknown_option_and_bad_backend():
    with pytest.raises(TypeError, match="granulrity"):
        _alloc(granulrity=512)
    with pytest.raises(TypeError, match="backend must be a DeviceBackend.*got NoneType without malloc"):
        CachingAllocator(None)


@pytest.mark.parametrize(("nbytes", "exc", "frag"), [
    (-1, ValueError, "nbytes must be >= 0, got -1"),
    (10.5, TypeError, "nbytes must be an int, got float 10.5"),
    ("10", TypeError, "nbytes must be an int, got str '10'"),
    (None, TypeError, "nbytes must be an int, got NoneType None"),
    (True, TypeError, "nbytes must be an int, got bool True"),
])
def test_malloc_bad_size(nbytes, exc, frag):
    a = _alloc()
    # a cached block of the rounded size exists, so a float would have been served by the fast path before
    a.free(a.malloc(512))
    with pytest.raises(exc, match=frag):
        a.malloc(nbytes)
    assert a.memory_stats()["allocated_bytes"] == 0


def test_malloc_numpy_int_and_zero_are_served():
    a = _alloc()
    p = a.malloc(np.int64(100))
    q = a.malloc(0)
    assert a.allocation_size(p) == 512 and a.allocation_size(q) == 512
    assert type(a.memory_stats()["allocated_bytes"]) is int


@pytest.mark.parametrize(("stream", "exc", "frag"), [
    ("s", TypeError, "stream \\(a stream handle\\) must be an int, got str 's'"),
    (1.5, TypeError, "must be an int, got float 1.5"),
    (-1, ValueError, "stream \\(a stream handle\\) must be >= 0, got -1"),
])
def test_stream_of_wrong_type(stream, exc, frag):
    a = _alloc()
    with pytest.raises(exc, match=frag):
        a.malloc(64, stream=stream)
    p = a.malloc(64)
    with pytest.raises(exc, match=frag):
        a.record_stream(p, stream)
    a.free(p)


def test_double_free_and_unknown_pointer_name_the_pointer():
    a = _alloc()
    p = a.malloc(1000)
    a.free(p)
    with pytest.raises(ValueError, match=f"free: {p:#x} was not allocated here \\(or was freed twice\\)"):
        a.free(p)
    with pytest.raises(ValueError, match="free: 0x3039 was not allocated here"):
        a.free(12345)
    with pytest.raises(ValueError, match="free: None \\(a NoneType, not an int pointer\\)"):
        a.free(None)
    with pytest.raises(ValueError, match="free: '0x10' \\(a str, not an int pointer\\)"):
        a.free("0x10")
    with pytest.raises(ValueError, match="allocation_size: None \\(a NoneType"):
        a.allocation_size(None)
    # the cache is intact: the freed block is served again and the books balance
    q = a.malloc(1000)
    assert q == p
    a.free(q)
    st = a.memory_stats()
    assert st["allocated_bytes"] == 0


def test_oom_error_says_what_was_asked_free_and_largest_block():
    a = CachingAllocator(FakeDeviceBackend(8 << 20))
    p = a.malloc(1 << 20)
    with pytest.raises(OutOfMemoryError) as ei:
        a.malloc(64 << 20)
    msg = str(ei.value)
    assert "tried to allocate 64.00 MiB (67108864 bytes)" in msg
    assert "free on device" in msg and "largest cached free block" in msg
    assert ei.value.requested == 64 << 20 and ei.value.device_total == 8 << 20
    a.free(p)
    assert a.empty_cache() > 0


def test_begin_profile_bad_first_n():
    a = _alloc()
    with pytest.raises(ValueError, match="first_n \\(profile_first_n\\) must be >= 1, got -1"):
        a.begin_profile(-1)
    assert not a.profiling


@pytest.mark.parametrize(("shape", "dtype", "exc", "frag"), [
    (-1, np.float32, ValueError, "negative dimension in shape \\(-1,\\)"),
    (2.5, np.float32, TypeError, "shape must be an int or a tuple of ints, got float 2.5"),
    ("a", np.float32, TypeError, "shape must be an int or a tuple of ints, got 'a'"),
    ((2, 1.5), np.float32, TypeError, "shape must be an int or a tuple of ints, got \\(2, 1.5\\)"),
    (4, "float99", TypeError, "dtype 'float99' is not a NumPy dtype"),
    (4, object, TypeError, "dtype object holds Python objects"),
])
def test_pinned_bad_sizes(shape, dtype, exc, frag):
    h = PinnedHostAllocator(pinned=False)
    with pytest.raises(exc, match=frag):
        h.empty(shape, dtype)
    assert h.memory_stats()["allocated_bytes"] == 0


def test_pinned_foreign_array_is_refused_without_cuda_too():
    h = PinnedHostAllocator(pinned=False)
    with pytest.raises(ValueError, match="not allocated by this allocator"):
        h.record_stream(np.zeros(3), 0)
    with pytest.raises(TypeError, match="empty_like: expected an array, got list"):
        h.empty_like([1, 2])
    x = h.empty((2, 3), np.float64)
    h.record_stream(x, 0)  # its own array is fine
    assert x.shape == (2, 3) and x.dtype == np.float64


@pytest.mark.parametrize(("kw", "exc", "frag"), [
    ({"capacity": 1.5}, TypeError, "capacity must be an int, got float 1.5"),
    ({"capacity": 0}, ValueError, "capacity must be positive, got 0"),
    ({"alignment": 0}, ValueError, "alignment must be a power of two, got 0"),
    ({"alignment": 3}, ValueError, "alignment must be a power of two, got 3"),
    ({"base": 100}, ValueError, "base must be a non-negative multiple of alignment \\(512\\), got 0x64"),
])
def test_fake_backend_bad_options(kw, exc, frag):
    with pytest.raises(exc, match=frag):
        FakeDeviceBackend(**kw)
