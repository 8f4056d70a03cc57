"""Plugging the caching allocator into CuPy: ``install()`` / ``uninstall()`` and stream bookkeeping.

CuPy calls our ``alloc(nbytes)`` for every device buffer. We hand back a ``MemoryPointer`` over an
``UnownedMemory`` whose owner is a tiny object; when CuPy drops the last array using the buffer the
owner is collected and its ``__del__`` returns the block to the allocator (on the stream it was
allocated on; use :func:`record_stream` when another stream used it).
"""

from __future__ import annotations

import gc
import numbers
import sys
import threading
from typing import Any

from .caching import CachingAllocator
from .cuda_backend import CudaBackend
from .errors import OutOfMemoryError

_lock = threading.Lock()
_allocators: dict[int, CachingAllocator] = {}
_state: dict[str, Any] = {"installed": False, "previous": None, "alloc_fn": None, "kwargs": {}}


class _BlockOwner:
    """Keeps a block allocated while CuPy memory references it; frees it when collected."""

    __slots__ = ("allocator", "ptr")

    def __init__(self, allocator: CachingAllocator, ptr: int) -> None:
        self.allocator = allocator
        self.ptr = ptr

    def __del__(self) -> None:
        if sys.is_finalizing():
            return
        self.allocator.free(self.ptr)


def _require_cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError("bluallocator.install needs CuPy: pip install 'bluallocator[cuda13]'") from exc
    return cupy


def get_allocator(device: int | None = None) -> CachingAllocator:
    """The caching allocator of ``device`` (the current CuPy device if None), created on first use."""
    cupy = _require_cupy()
    if device is not None and (isinstance(device, bool) or not isinstance(device, numbers.Integral)):
        raise TypeError(f"bluallocator: device must be a CUDA device index (int) or None, got "
                        f"{type(device).__name__} {device!r}")
    if device is None:
        try:
            device = cupy.cuda.runtime.getDevice()
        except cupy.cuda.runtime.CUDARuntimeError as e:  # CuPy present, no usable GPU / driver
            raise RuntimeError(f"bluallocator needs a usable CUDA device: CuPy is installed but the CUDA runtime "
                               f"says {e} (no GPU, or a driver older than the CUDA build of CuPy)") from None
    dev = int(device)
    a = _allocators.get(dev)
    if a is None:
        with _lock:
            a = _allocators.get(dev)
            if a is None:
                a = _allocators[dev] = CachingAllocator(CudaBackend(dev), **_state["kwargs"])
    return a


def _make_alloc_fn(cupy: Any) -> Any:
    runtime = cupy.cuda.runtime
    get_stream = cupy.cuda.get_current_stream
    memory_pointer = cupy.cuda.MemoryPointer
    unowned = cupy.cuda.UnownedMemory
    allocators = _allocators

    def alloc(nbytes: int) -> Any:
        dev = runtime.getDevice()
        a = allocators.get(dev) or get_allocator(dev)
        stream = get_stream().ptr
        try:
            ptr = a.malloc(nbytes, stream)
        except OutOfMemoryError:
            gc.collect()  # arrays only held by reference cycles give their blocks back, then retry once
            ptr = a.malloc(nbytes, stream)
        return memory_pointer(unowned(ptr, nbytes, _BlockOwner(a, ptr), dev), 0)

    return alloc


def install(allocator: CachingAllocator | None = None, **kwargs: Any) -> CachingAllocator:
    """Make CuPy allocate through bluallocator (``cupy.cuda.set_allocator``); returns this device's allocator.

    ``allocator`` (built on a CudaBackend) is used for its device; ``kwargs`` configure allocators created
    later for other devices (e.g. ``profile_first_n``). Arrays allocated before keep their old pool.
    """
    cupy = _require_cupy()
    if allocator is not None and not isinstance(allocator.backend, CudaBackend):
        raise TypeError(f"bluallocator.install: the allocator must run on a CudaBackend, "
                        f"not {type(allocator.backend).__name__}")
    with _lock:
        if allocator is not None:
            _allocators[int(allocator.backend.device_id)] = allocator
        if kwargs:
            _state["kwargs"] = dict(kwargs)
        if not _state["installed"]:
            _state["previous"] = cupy.cuda.get_allocator()
            _state["alloc_fn"] = _make_alloc_fn(cupy)
            cupy.cuda.set_allocator(_state["alloc_fn"])
            _state["installed"] = True
    if allocator is not None:
        return allocator
    try:
        return get_allocator()
    except Exception:  # no usable device: leave CuPy on the allocator it had
        uninstall()
        raise


def uninstall() -> None:
    """Restore the allocator CuPy had before :func:`install`. Blocks still alive free into ours later."""
    cupy = _require_cupy()
    with _lock:
        if _state["installed"]:
            cupy.cuda.set_allocator(_state["previous"])
            _state.update(installed=False, previous=None, alloc_fn=None)


def is_installed() -> bool:
    """True between :func:`install` and :func:`uninstall`."""
    return bool(_state["installed"])


def _stream_ptr(stream: Any) -> int:
    return int(stream) if isinstance(stream, int) else int(stream.ptr)


def record_stream(array: Any, stream: Any) -> None:
    """Tell the allocator that ``stream`` (cupy Stream or handle) uses ``array``'s buffer, like torch's."""
    mem = array.data.mem
    get_allocator(array.device.id).record_stream(int(mem.ptr), _stream_ptr(stream))


def memory_stats(device: int | None = None) -> dict[str, Any]:
    """``memory_stats()`` of the device's caching allocator."""
    return get_allocator(device).memory_stats()


def reset_peak_stats(device: int | None = None) -> None:
    """``reset_peak_stats()`` of the device's caching allocator (peaks restart from the current values)."""
    get_allocator(device).reset_peak_stats()


def empty_cache() -> int:
    """``empty_cache()`` on every device's allocator; total bytes released."""
    return sum(a.empty_cache() for a in list(_allocators.values()))
