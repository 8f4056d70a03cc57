"""Pinned (page-locked) host buffers for the loader's double buffer and asynchronous checkpoints.

``PinnedHostAllocator.empty(shape, dtype)`` returns a NumPy array over a cached page-locked buffer
(``cudaHostAlloc``) so host-to-device copies can run asynchronously on a copy stream. When the last
array or view over the buffer is collected, the buffer goes back to the cache (after the events of
streams registered with :meth:`record_stream` complete). Without CuPy or a GPU the same API hands out
ordinary NumPy memory and ``pinned`` is False, which is what the loader's synchronous fallback needs.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import weakref
from collections import defaultdict, deque
from collections.abc import Iterator
from typing import Any

import numpy as np

from .cuda_backend import cuda_available

MiB = 1 << 20
_buffer_types: dict[int, type] = {}


def _buffer_type(nbytes: int) -> type:
    """ctypes array subclass of ``nbytes`` (weak-referenceable; one per size class, cached)."""
    t = _buffer_types.get(nbytes)
    if t is None:
        t = _buffer_types[nbytes] = type(f"PinnedBuffer{nbytes}", (ctypes.c_ubyte * nbytes,), {})
    return t


def host_size_class(nbytes: int) -> int:
    """Cache size class: powers of two up to 1 MiB, then multiples of 1 MiB."""
    n = max(int(nbytes), 1)
    if n <= MiB:
        return max(512, 1 << (n - 1).bit_length())
    return -(-n // MiB) * MiB


def _shape_tuple(shape: Any) -> tuple[int, ...]:
    """``shape`` (an int or a sequence of ints) as a tuple of ints, else a TypeError naming it."""
    if isinstance(shape, int | np.integer) and not isinstance(shape, bool):
        return (int(shape),)
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"PinnedHostAllocator.empty: shape must be an int or a tuple of ints, "
                        f"got {type(shape).__name__} {shape!r}") from None
    if isinstance(shape, str) or not all(isinstance(d, int | np.integer) and not isinstance(d, bool) for d in dims):
        raise TypeError(f"PinnedHostAllocator.empty: shape must be an int or a tuple of ints, got {shape!r}")
    return tuple(int(d) for d in dims)


class _HostBlock:
    __slots__ = ("ptr", "size", "keep", "stream_uses", "events")

    def __init__(self, ptr: int, size: int, keep: Any) -> None:
        self.ptr, self.size, self.keep = ptr, size, keep
        self.stream_uses: set[int] = set()
        self.events: list[int] = []


class PinnedHostAllocator:
    """Caching allocator of host buffers, page-locked when CUDA is available.

    ``pinned=None`` picks page-locked memory when CuPy sees a GPU, else plain memory; ``pinned=True``
    insists (error without CUDA). ``event_backend`` (a DeviceBackend) enables :meth:`record_stream`.
    """

    def __init__(self, pinned: bool | None = None, event_backend: Any = None) -> None:
        if pinned is None:
            pinned = cuda_available()
        if pinned and not cuda_available():
            raise RuntimeError("PinnedHostAllocator(pinned=True) needs CuPy and a CUDA device")
        self.pinned = bool(pinned)
        self._rt: Any = None
        if self.pinned:
            import cupy
            self._rt = cupy.cuda.runtime
            if event_backend is None:
                from .cuda_backend import CudaBackend
                event_backend = CudaBackend()
        self._events = event_backend
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._deferred: deque[_HostBlock] = deque()
        self._free: dict[int, list[_HostBlock]] = defaultdict(list)
        self._live: dict[int, _HostBlock] = {}
        self._pending: list[_HostBlock] = []
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.peak_reserved_bytes = 0
        self.num_allocs = 0
        self.num_host_allocs = 0

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The lock, plus: releases that fire re-entrantly (GC inside our own call) are applied at the end."""
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
                while self._deferred:
                    self._release_locked(self._deferred.popleft())
            finally:
                self._owner = None

    def _raw_alloc(self, size: int) -> _HostBlock:
        if self.pinned:
            try:
                ptr = int(self._rt.hostAlloc(size, 0))
            except self._rt.CUDARuntimeError:
                self._release_cached_locked()  # page-locked memory is scarce: drop the cache, retry once
                ptr = int(self._rt.hostAlloc(size, 0))
            keep = None
        else:
            keep = np.empty(size, dtype=np.uint8)
            ptr = int(keep.ctypes.data)
        self.reserved_bytes += size
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        self.num_host_allocs += 1
        return _HostBlock(ptr, size, keep)

    def _raw_free(self, block: _HostBlock) -> None:
        if self.pinned:
            self._rt.freeHost(block.ptr)
        block.keep = None
        self.reserved_bytes -= block.size

    def empty(self, shape: int | tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        """Uninitialised array of ``shape``/``dtype`` over a (pinned, when available) cached host buffer."""
        try:
            dt = np.dtype(dtype)
        except TypeError as e:
            raise TypeError(f"PinnedHostAllocator.empty: dtype {dtype!r} is not a NumPy dtype ({e})") from None
        if dt.hasobject:
            raise TypeError(f"PinnedHostAllocator.empty: dtype {dt} holds Python objects; host buffers hold "
                            f"plain numbers only")
        shp = _shape_tuple(shape)
        if any(s < 0 for s in shp):
            raise ValueError(f"PinnedHostAllocator.empty: negative dimension in shape {shp}")
        nbytes = int(np.prod(shp, dtype=np.int64)) * dt.itemsize
        size = host_size_class(nbytes)
        with self._locked():
            self._process_pending()
            free = self._free.get(size)
            block = free.pop() if free else self._raw_alloc(size)
            self._live[block.ptr] = block
            self.allocated_bytes += size
            self.num_allocs += 1
        buf = _buffer_type(block.size).from_address(block.ptr)  # one ctypes type per size class
        weakref.finalize(buf, self._release, block)
        return np.frombuffer(buf, dtype=np.uint8, count=nbytes).view(dt).reshape(shp)

    def empty_like(self, array: np.ndarray) -> np.ndarray:
        """:meth:`empty` with the shape and dtype of ``array``."""
        if not hasattr(array, "shape") or not hasattr(array, "dtype"):
            raise TypeError(f"PinnedHostAllocator.empty_like: expected an array, got {type(array).__name__}")
        return self.empty(array.shape, array.dtype)

    def record_stream(self, array: np.ndarray, stream: int) -> None:
        """Delay reuse of ``array``'s buffer until work now queued on ``stream`` (e.g. an async copy) ends."""
        ptr = self._block_ptr(array)  # checked without CUDA too: a foreign array is a bug on every machine
        if self._events is None:
            return
        with self._locked():
            self._live[ptr].stream_uses.add(int(stream))

    def _block_ptr(self, array: np.ndarray) -> int:
        base: Any = array
        while isinstance(base, np.ndarray):
            base = base.base
        if not isinstance(base, ctypes.Array):
            raise ValueError("PinnedHostAllocator: array was not allocated by this allocator")
        ptr = ctypes.addressof(base)
        if ptr not in self._live:
            raise ValueError("PinnedHostAllocator: array was not allocated by this allocator (or freed)")
        return ptr

    def _release(self, block: _HostBlock) -> None:
        if self._owner == threading.get_ident():
            self._deferred.append(block)
            return
        with self._locked():
            self._release_locked(block)

    def _release_locked(self, block: _HostBlock) -> None:
        self._live.pop(block.ptr, None)
        self.allocated_bytes -= block.size
        if block.stream_uses and self._events is not None:
            for s in block.stream_uses:
                ev = self._events.event_create()
                self._events.event_record(ev, s)
                block.events.append(ev)
            block.stream_uses.clear()
            self._pending.append(block)
        else:
            self._free[block.size].append(block)

    def _process_pending(self) -> None:
        still = []
        for block in self._pending:
            if all(self._events.event_query(e) for e in block.events):
                for e in block.events:
                    self._events.event_destroy(e)
                block.events = []
                self._free[block.size].append(block)
            else:
                still.append(block)
        self._pending = still

    def is_pinned(self, array: np.ndarray) -> bool:
        """True if ``array`` lives in page-locked memory handed out by this allocator."""
        try:
            self._block_ptr(array)
        except ValueError:
            return False
        return self.pinned

    def empty_cache(self) -> int:
        """Free cached (unused) buffers; returns bytes released."""
        with self._locked():
            self._process_pending()
            return self._release_cached_locked()

    def _release_cached_locked(self) -> int:
        released = 0
        for blocks in self._free.values():
            for b in blocks:
                released += b.size
                self._raw_free(b)
        self._free.clear()
        return released

    def memory_stats(self) -> dict[str, Any]:
        """allocated/reserved/peak bytes, counts and whether memory is page-locked."""
        with self._locked():
            return {"pinned": self.pinned, "allocated_bytes": self.allocated_bytes,
                    "reserved_bytes": self.reserved_bytes, "peak_reserved_bytes": self.peak_reserved_bytes,
                    "cached_free_bytes": sum(b.size for v in self._free.values() for b in v),
                    "pending_bytes": sum(b.size for b in self._pending),
                    "num_allocs": self.num_allocs, "num_host_allocs": self.num_host_allocs}
