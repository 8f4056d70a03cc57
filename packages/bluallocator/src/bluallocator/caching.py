"""The caching device allocator: best-fit block pools per stream, split/coalesce, events, private pools.

Requests are rounded to a granularity (512 B until the step-0 profile picks better ones), served from
the current pool's free list for (stream, small|large) by best fit, split when the remainder is worth
keeping, and returned to the same list on free, merged with free neighbours of the same segment.
Small requests (<= 1 MiB) are carved from 2 MiB segments, large ones from 20 MiB segments (requests
under 10 MiB) or segments rounded up to 2 MiB. Nothing goes back to the driver except through
``empty_cache()``, ``flush_after_step0()``, the out-of-memory retry, or a released private pool.
"""

from __future__ import annotations

import contextlib
import math
import operator
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from typing import Any

from .alignment import MIN_GRANULARITY, AlignmentChoice, AlignmentProfiler, round_up
from .backend import DeviceBackend
from .blocks import ALLOCATED, FREE, MERGED, PENDING, Block, FreeList, MemPool, Segment
from .errors import BackendOutOfMemory, OutOfMemoryError

MiB = 1 << 20
_get_ident = threading.get_ident
_now_ns = time.perf_counter_ns
#: callbacks ``fn(event, ptr, size, stream, ts_ns)`` with event 'alloc' | 'free', shared by every allocator
_LISTENERS: list = []
#: with blocks pending on other streams' events, poll them every this many mallocs (not on every call)
EVENT_POLL_INTERVAL = 64
_BACKEND_METHODS = ("malloc", "free", "mem_get_info", "current_stream", "event_create", "event_record",
                    "event_query", "event_synchronize", "event_destroy", "is_capturing")


def _ptr_text(ptr: Any) -> str:
    """``ptr`` for an error message: hex for an int, else its type and repr (a pointer of the wrong type)."""
    try:
        return f"{operator.index(ptr):#x}"
    except TypeError:
        return f"{ptr!r} (a {type(ptr).__name__}, not an int pointer)"


def _as_count(value: Any, what: str, minimum: int) -> int:
    """``value`` as an int >= ``minimum`` (NumPy integers pass; bool, float, str do not), else an error naming it."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None
    if n < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {n}")
    return n


def add_listener(fn) -> None:
    """Call ``fn(event, ptr, size, stream, ts_ns)`` on every malloc ('alloc') and free ('free') of every
    caching allocator (profilers); costs nothing while no listener is installed."""
    if fn not in _LISTENERS:
        _LISTENERS.append(fn)


def remove_listener(fn) -> None:
    """Stop calling ``fn`` (no error when it is not installed)."""
    if fn in _LISTENERS:
        _LISTENERS.remove(fn)


def size_bucket(n: int) -> int:
    """Power of two >= n (the histogram bucket of a request)."""
    return 1 << max(0, (max(n, 1) - 1).bit_length())


class CachingAllocator:
    """Caching allocator over a :class:`~bluallocator.backend.DeviceBackend` (fake or CUDA).

    ``malloc(nbytes, stream)`` returns a device pointer (int); ``free(ptr)`` returns it to the cache.
    Thread-safe; a free that arrives re-entrantly (a garbage-collector finaliser running inside an
    allocator call on the same thread) is queued and applied when the outer call finishes.
    """

    def __init__(
        self,
        backend: DeviceBackend,
        *,
        small_size: int = 1 * MiB,
        small_segment_size: int = 2 * MiB,
        large_segment_size: int = 20 * MiB,
        min_large_alloc: int = 10 * MiB,
        large_segment_round: int = 2 * MiB,
        granularity: int = MIN_GRANULARITY,
        profile_first_n: int | None = None,
        class_weight: float = 1.0,
    ) -> None:
        missing = [m for m in _BACKEND_METHODS if not callable(getattr(backend, m, None))]
        if missing:
            raise TypeError(f"CachingAllocator: backend must be a DeviceBackend (FakeDeviceBackend, CudaBackend), "
                            f"got {type(backend).__name__} without {', '.join(missing)}")
        small_size = _as_count(small_size, "CachingAllocator: small_size", 1)
        small_segment_size = _as_count(small_segment_size, "CachingAllocator: small_segment_size", 1)
        large_segment_size = _as_count(large_segment_size, "CachingAllocator: large_segment_size", 1)
        min_large_alloc = _as_count(min_large_alloc, "CachingAllocator: min_large_alloc", 0)
        large_segment_round = _as_count(large_segment_round, "CachingAllocator: large_segment_round", 1)
        granularity = _as_count(granularity, "CachingAllocator: granularity", 1)
        if granularity & (granularity - 1):
            raise ValueError(f"CachingAllocator: granularity must be a power of two, got {granularity}")
        if isinstance(class_weight, bool) or not isinstance(class_weight, int | float) or not (
                math.isfinite(class_weight) and class_weight >= 0):
            raise ValueError(f"CachingAllocator: class_weight must be a finite number >= 0, got {class_weight!r}")
        if small_size % granularity or small_segment_size < small_size:
            raise ValueError(f"CachingAllocator: small_size ({small_size}) must be a multiple of granularity "
                             f"({granularity}) and fit in small_segment_size ({small_segment_size})")
        self.backend = backend
        self.small_size = small_size
        self.small_segment_size = small_segment_size
        self.large_segment_size = large_segment_size
        self.min_large_alloc = min_large_alloc
        self.large_segment_round = large_segment_round
        self.granularity_small = granularity
        self.granularity_large = granularity
        self.class_weight = class_weight
        self._default_pool = MemPool(0)
        self._small_lists = self._default_pool.small_lists  # stream -> FreeList (the malloc fast path)
        self._large_lists = self._default_pool.large_lists
        self._pools: dict[int, MemPool] = {0: self._default_pool}
        self._private_users = 0  # `with private_pool()` blocks open on any thread (0: default pool fast path)
        self._fast = True  # no profile running and no private pool open: malloc may take its inline path
        self._poll_tick = 0
        self._next_pool_id = 1
        self._allocated: dict[int, Block] = {}
        self._pending: list[Block] = []
        self._deferred_capture: list[Block] = []
        self._event_cache: list[int] = []
        self._tls = threading.local()
        self._lock = threading.RLock()
        self._busy = False  # an allocator call is running (a free arriving re-entrantly is queued)
        self._deferred_frees: deque[int] = deque()
        self._capture_depth = 0
        self._profiler: AlignmentProfiler | None = None
        self._profile_remaining: int | None = None
        self.alignment_choice: AlignmentChoice | None = None
        self.startup_flushed = False
        # statistics
        self._allocated_bytes = 0
        self._reserved_bytes = 0
        self._peak_allocated = 0
        self._peak_reserved = 0
        self._pending_bytes = 0
        self._counts = Counter[str]()
        self._num_frees = 0
        self._num_splits = 0
        self._num_merges = 0
        self._histogram: dict[int, int] = {}  # request size rounded up to a power of two -> count
        if profile_first_n is not None:
            self.begin_profile(first_n=profile_first_n)

    # ------------------------------------------------------------------ locking
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            busy, self._busy = self._busy, True
            try:
                yield
                if not busy:
                    self._drain_deferred()
            finally:
                self._busy = busy

    # ------------------------------------------------------------------ public: allocate / free
    def round_size(self, nbytes: int) -> int:
        """Block size a request of ``nbytes`` is served with (current granularities)."""
        n = max(int(nbytes), 1)
        return round_up(n, self.granularity_small if n <= self.small_size else self.granularity_large)

    def malloc(self, nbytes: int, stream: int | None = None) -> int:
        """Device pointer to at least ``nbytes`` bytes usable on ``stream`` (current stream if None)."""
        if stream is None:
            stream = self.backend.current_stream()
        # hot path, inline: a cached block of exactly the rounded size in the default pool (what a training
        # step asks for again and again): one dict pop; no split, no event query, no container churn
        with self._lock:
            if self._busy:
                raise RuntimeError("CachingAllocator.malloc: re-entered from a callback inside the allocator")
            self._busy = True
            try:
                if self._fast and nbytes.__class__ is int and nbytes > 0 and not _LISTENERS:
                    if nbytes <= self.small_size:
                        g = self.granularity_small
                        fl = self._small_lists.get(stream)
                    else:
                        g = self.granularity_large
                        fl = self._large_lists.get(stream)
                    size = -(-nbytes // g) * g
                    bucket = fl._buckets.get(size) if fl is not None else None
                    if bucket and not self._pending:
                        block = bucket.popitem()[1] if len(bucket) == 1 else bucket.pop(min(bucket))
                        block.state = ALLOCATED
                        block.requested = nbytes
                        ptr = block.ptr
                        self._allocated[ptr] = block
                        self._allocated_bytes += size
                        if self._allocated_bytes > self._peak_allocated:
                            self._peak_allocated = self._allocated_bytes
                        k = 1 << (nbytes - 1).bit_length()
                        h = self._histogram
                        h[k] = h.get(k, 0) + 1
                        if self._deferred_frees:
                            self._drain_deferred()
                        return ptr
                if nbytes.__class__ is not int or nbytes < 0:
                    nbytes = _as_count(nbytes, "CachingAllocator.malloc: nbytes", 0)
                if stream.__class__ is not int or stream < 0:
                    stream = _as_count(stream, "CachingAllocator.malloc: stream (a stream handle)", 0)
                ptr = self._malloc_locked(nbytes, stream)
                if self._deferred_frees:
                    self._drain_deferred()
                return ptr
            finally:
                self._busy = False

    def free(self, ptr: int) -> None:
        """Return a pointer from :meth:`malloc` to the cache (deferred if other streams still use it)."""
        with self._lock:  # re-entrant: a finaliser run by the GC inside an allocator call queues its free
            if self._busy:
                self._deferred_frees.append(ptr)
                return
            self._busy = True
            try:
                block = self._allocated.pop(ptr, None)
                if block is None:
                    raise ValueError(f"CachingAllocator.free: {_ptr_text(ptr)} was not allocated here "
                                     f"(or was freed twice)")
                seg = block.segment
                fl = seg.free_list
                if fl is not None and not block.stream_uses and not _LISTENERS:
                    # hot path: cache the block as it is (merging with free neighbours is deferred)
                    size = block.size
                    self._allocated_bytes -= size
                    self._num_frees += 1
                    block.state = FREE
                    prev, nxt = block.prev, block.next
                    if (prev is not None and prev.state is FREE) or (nxt is not None and nxt.state is FREE):
                        d = fl.dirty
                        d.append(block)
                        if len(d) > 4096:
                            fl.dirty = list({id(b): b for b in d if b.state is FREE}.values())
                    bucket = fl._buckets.get(size)
                    if bucket is None:
                        fl.add(block)
                    else:
                        bucket[ptr] = block
                else:
                    self._free_block(block)
                if self._deferred_frees:
                    self._drain_deferred()
            finally:
                self._busy = False

    def _drain_deferred(self) -> None:
        while self._deferred_frees:
            self._free_locked(self._deferred_frees.popleft())

    def record_stream(self, ptr: int, stream: int) -> None:
        """Mark that ``stream`` uses the block at ``ptr``: on free, reuse waits for that stream's work."""
        with self._locked():
            block = self._allocated.get(ptr)
            if block is None:
                raise ValueError(f"CachingAllocator.record_stream: {_ptr_text(ptr)} is not an allocated block")
            stream = _as_count(stream, "CachingAllocator.record_stream: stream (a stream handle)", 0)
            if stream != block.stream:
                if block.stream_uses is None:
                    block.stream_uses = set()
                block.stream_uses.add(stream)

    def allocation_size(self, ptr: int) -> int:
        """Size of the block that serves the allocation at ``ptr``."""
        block = self._allocated.get(ptr)
        if block is None:
            raise ValueError(f"CachingAllocator.allocation_size: {_ptr_text(ptr)} is not an allocated block")
        return block.size

    # ------------------------------------------------------------------ internals: allocate
    def _malloc_locked(self, nbytes: int, stream: int) -> int:
        if self._pending and self._capture_depth == 0:
            self._poll_tick += 1
            if self._poll_tick >= EVENT_POLL_INTERVAL:
                self._poll_tick = 0
                self._process_events()
        if self._profiler is not None:
            self._record_profile(nbytes)
        n = nbytes if nbytes > 0 else 1
        small = n <= self.small_size
        if small:
            size = -(-n // self.granularity_small) * self.granularity_small
        else:
            size = -(-n // self.granularity_large) * self.granularity_large
        pool = self._default_pool if not self._private_users else self._current_pool()
        fl = (pool.small_lists if small else pool.large_lists).get(stream)
        if fl is None:
            fl = pool.free_list(stream, small)
        block = fl.take_exact(size)  # the hot path: a block of this very size, no split, no event query
        if block is None:
            if self._pending and self._capture_depth == 0:
                self._process_events()
            if fl.dirty:  # best fit over merged blocks (as with eager merging: keeps fragmentation low)
                self._coalesce(fl)
            block = fl.take(size)  # best fit by bisection
            if block is None:
                block = self._malloc_slow(fl, pool, stream, small, size)
        remaining = block.size - size
        if remaining and remaining >= (self.granularity_small if small else self.small_size + 1):
            rest = Block(block.ptr + size, remaining, block.segment)
            nxt = block.next
            rest.prev, rest.next = block, nxt
            if nxt is not None:
                nxt.prev = rest
                if nxt.state is FREE:
                    fl.dirty.append(rest)
            block.next = rest
            block.size = size
            fl.add(rest)
            self._num_splits += 1
        block.state = ALLOCATED
        block.requested = nbytes
        ptr = block.ptr
        self._allocated[ptr] = block
        self._allocated_bytes += block.size
        if self._allocated_bytes > self._peak_allocated:
            self._peak_allocated = self._allocated_bytes
        k = 1 << (n - 1).bit_length()
        h = self._histogram
        h[k] = h.get(k, 0) + 1
        if _LISTENERS:
            ts = _now_ns()
            for fn in tuple(_LISTENERS):
                fn("alloc", ptr, block.size, stream, ts)
        return ptr

    def _malloc_slow(self, fl: FreeList, pool: MemPool, stream: int, small: bool, size: int) -> Block:
        """Nothing free is big enough: merge deferred neighbours, recycle blocks whose events completed,
        then ask the driver for a new segment."""
        if fl.dirty:
            self._coalesce(fl)
            block = fl.take(size)
            if block is not None:
                return block
        if self._pending and self._capture_depth == 0:
            self._process_events()
            if fl.dirty:
                self._coalesce(fl)
            block = fl.take(size)
            if block is not None:
                return block
        return self._new_segment(pool, stream, small, size)

    def _segment_size(self, size: int, small: bool) -> int:
        if small:
            return self.small_segment_size
        if size < self.min_large_alloc:
            return self.large_segment_size
        return round_up(size, self.large_segment_round)

    def _new_segment(self, pool: MemPool, stream: int, small: bool, size: int) -> Block:
        seg_size = self._segment_size(size, small)
        ptr = self._device_malloc(seg_size, size, stream, pool)
        if isinstance(ptr, tuple):
            ptr, seg_size = ptr
        seg = Segment(ptr, seg_size, stream, pool, small)
        if not pool.private:
            seg.free_list = pool.free_list(stream, small)  # frees of its blocks may take the fast path
        pool.segments[ptr] = seg
        self._reserved_bytes += seg_size
        self._peak_reserved = max(self._peak_reserved, self._reserved_bytes)
        self._counts["num_device_mallocs"] += 1
        return Block(ptr, seg_size, seg)

    def _device_malloc(self, seg_size: int, size: int, stream: int, pool: MemPool) -> int | tuple[int, int]:
        try:
            return self.backend.malloc(seg_size)
        except BackendOutOfMemory:
            pass
        capturing = self._capture_depth > 0 or self.backend.is_capturing(stream)
        if not capturing:
            # Retry after waiting for pending blocks and returning every cached segment we may free
            # (cudaFree synchronises the device, so never during a graph capture).
            self._counts["num_oom_retries"] += 1
            self._synchronize_pending()
            self._release_cached(self._releasable_pools())
            try:
                return self.backend.malloc(seg_size)
            except BackendOutOfMemory:
                pass
        tight = round_up(size, self.large_segment_round) if size > self.small_size else size
        if tight < seg_size:
            try:
                return self.backend.malloc(tight), tight
            except BackendOutOfMemory:
                pass
        self._counts["num_ooms"] += 1
        free, total = self.backend.mem_get_info()
        raise OutOfMemoryError(
            size, free, total, self._reserved_bytes, self._cached_free_bytes(), self._largest_free_block(),
            allocated=self._allocated_bytes, stream=stream, pool=pool.name,
            note="during CUDA-graph capture cached segments cannot be returned to the driver; "
                 "reserve memory for the graph pool before capturing" if capturing else "")

    # ------------------------------------------------------------------ internals: free
    def _free_locked(self, ptr: int) -> None:
        block = self._allocated.pop(ptr, None)
        if block is None:
            raise ValueError(f"CachingAllocator.free: {_ptr_text(ptr)} was not allocated here (or was freed twice)")
        self._free_block(block)

    def _free_block(self, block: Block) -> None:
        ptr = block.ptr
        self._allocated_bytes -= block.size
        self._num_frees += 1
        if _LISTENERS:
            ts = _now_ns()
            for fn in tuple(_LISTENERS):
                fn("free", ptr, block.size, block.segment.stream, ts)
        if block.stream_uses:
            block.state = PENDING
            self._pending_bytes += block.size
            if self._capture_depth > 0 or any(self.backend.is_capturing(s) for s in block.stream_uses):
                self._deferred_capture.append(block)   # events cannot be recorded into a capture
            else:
                self._insert_events(block)
                self._pending.append(block)
            return
        # hot path: cache the block as it is; merging with free neighbours waits until a request needs it
        seg = block.segment
        pool = seg.pool
        if pool.released:
            self._return_block(block)
            return
        block.state = FREE
        fl = (pool.small_lists if seg.is_small else pool.large_lists).get(seg.stream)
        if fl is None:
            fl = pool.free_list(seg.stream, seg.is_small)
        prev, nxt = block.prev, block.next
        if (prev is not None and prev.state is FREE) or (nxt is not None and nxt.state is FREE):
            fl.dirty.append(block)
        fl.add(block)

    def _insert_events(self, block: Block) -> None:
        if block.events is None:
            block.events = []
        for s in sorted(block.stream_uses):
            ev = self._event_cache.pop() if self._event_cache else self.backend.event_create()
            self.backend.event_record(ev, s)
            block.events.append(ev)

    def _process_events(self) -> None:
        if not self._pending:
            return
        still: list[Block] = []
        for block in self._pending:
            if all(self.backend.event_query(e) for e in block.events):
                self._finish_pending(block)
            else:
                still.append(block)
        self._pending = still

    def _finish_pending(self, block: Block) -> None:
        self._event_cache.extend(block.events or ())
        block.events = None
        self._pending_bytes -= block.size
        self._return_block(block)

    def _synchronize_pending(self) -> None:
        for block in self._pending:
            for e in block.events or ():
                self.backend.event_synchronize(e)
            self._finish_pending(block)
        self._pending = []

    def _flush_deferred_capture(self) -> None:
        keep: list[Block] = []
        for block in self._deferred_capture:
            if any(self.backend.is_capturing(s) for s in block.stream_uses):
                keep.append(block)
            else:
                self._insert_events(block)
                self._pending.append(block)
        self._deferred_capture = keep

    def _return_block(self, block: Block) -> None:
        """Mark free and cache it, merged with its free neighbours (blocks of a released pool: merged at
        once, and the segment goes back to the driver when it is whole)."""
        block.state = FREE
        block.stream_uses = None
        seg = block.segment
        pool = seg.pool
        fl = pool.free_list(seg.stream, seg.is_small)
        block = self._merge_neighbours(fl, block)
        if pool.released and not block.is_split and self._capture_depth == 0:
            self._release_segment(seg)
        else:
            fl.add(block)

    def _merge_neighbours(self, fl: FreeList, block: Block) -> Block:
        """Merge ``block`` (not in ``fl``) with the free neighbours that are; returns the merged block."""
        prev = block.prev
        while prev is not None and prev.state is FREE:
            fl.remove(prev)
            block.state = MERGED
            prev.size += block.size
            prev.next = block.next
            if block.next is not None:
                block.next.prev = prev
            block = prev
            prev = block.prev
            self._num_merges += 1
        nxt = block.next
        while nxt is not None and nxt.state is FREE:
            fl.remove(nxt)
            nxt.state = MERGED
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
            nxt = block.next
            self._num_merges += 1
        return block

    def _coalesce(self, fl: FreeList) -> None:
        """Merge the runs of adjacent free blocks in ``fl`` that deferred frees left (``fl.dirty``)."""
        dirty, fl.dirty = fl.dirty, []
        for block in dirty:
            if block.state is not FREE:
                continue  # handed out again, or merged into a neighbour already
            while block.prev is not None and block.prev.state is FREE:
                block = block.prev  # the head of the run
            if block.next is not None and block.next.state is FREE:
                fl.remove(block)
                fl.add(self._merge_neighbours(fl, block))

    def _coalesce_all(self) -> None:
        for pool in self._pools.values():
            for fl in pool.free_lists.values():
                if fl.dirty:
                    self._coalesce(fl)

    def coalesce(self) -> None:
        """Merge adjacent free blocks now (otherwise done lazily, when a request finds nothing big enough)."""
        with self._locked():
            self._coalesce_all()

    def _release_segment(self, seg: Segment) -> None:
        pool = seg.pool
        del pool.segments[seg.ptr]
        self.backend.free(seg.ptr)
        self._reserved_bytes -= seg.size
        self._counts["num_device_frees"] += 1
        if pool.released and not pool.segments:
            self._pools.pop(pool.pool_id, None)

    def _release_cached(self, pools: list[MemPool]) -> int:
        released = 0
        for pool in pools:
            for fl in pool.free_lists.values():
                if fl.dirty:
                    self._coalesce(fl)
                for block in fl.blocks():
                    if not block.is_split:
                        fl.remove(block)
                        released += block.size
                        self._release_segment(block.segment)
        return released

    def _releasable_pools(self) -> list[MemPool]:
        return [p for p in list(self._pools.values()) if not p.private or p.released]

    # ------------------------------------------------------------------ cache control
    def empty_cache(self) -> int:
        """Return every fully free cached segment (default pool, released private pools) to the driver.

        Live private pools keep theirs: a captured graph may still address them. Nothing is released
        while a ``graph_pool`` capture is running (cudaFree would break the capture). Returns bytes released.
        """
        with self._locked():
            if self._capture_depth > 0:
                return 0
            self._process_events()
            return self._release_cached(self._releasable_pools())

    def synchronize_pending(self) -> None:
        """Wait for the events of blocks freed while other streams used them and recycle those blocks."""
        with self._locked():
            self._synchronize_pending()

    # ------------------------------------------------------------------ step-0 profile
    def begin_profile(self, first_n: int | None = None) -> None:
        """Start recording request sizes (step 0); with ``first_n`` it ends by itself after n requests."""
        if first_n is not None:
            first_n = _as_count(first_n, "CachingAllocator.begin_profile: first_n (profile_first_n)", 1)
        self._profiler = AlignmentProfiler(self.small_size, self.class_weight)
        self._profile_remaining = first_n
        self._fast = False

    def _record_profile(self, nbytes: int) -> None:
        assert self._profiler is not None
        self._profiler.record(nbytes)
        if self._profile_remaining is not None:
            self._profile_remaining -= 1
            if self._profile_remaining <= 0:
                self._end_profile_locked(True)

    def end_profile(self, apply: bool = True) -> AlignmentChoice:
        """Stop recording and choose the granularities (applied to later requests when ``apply``)."""
        with self._locked():
            return self._end_profile_locked(apply)

    def _end_profile_locked(self, apply: bool) -> AlignmentChoice:
        if self._profiler is None:
            raise RuntimeError("CachingAllocator.end_profile: no profile running (call begin_profile first)")
        choice = self._profiler.choose()
        self._profiler = None
        self._profile_remaining = None
        self._fast = not self._private_users
        if apply:
            self.granularity_small = choice.granularity_small
            self.granularity_large = choice.granularity_large
        self.alignment_choice = choice
        return choice

    @property
    def profiling(self) -> bool:
        """True while step-0 request sizes are being recorded."""
        return self._profiler is not None

    def flush_after_step0(self) -> dict[str, Any]:
        """End a running profile (applying its choice) and return the start-up cache to the driver."""
        choice = self.end_profile(apply=True) if self._profiler is not None else self.alignment_choice
        released = self.empty_cache()
        self.startup_flushed = True
        out: dict[str, Any] = {"released_bytes": released, "granularity_small": self.granularity_small,
                               "granularity_large": self.granularity_large}
        if choice is not None:
            out["profiled_requests"] = choice.num_requests
        return out

    release_startup_memory = flush_after_step0

    # ------------------------------------------------------------------ private pools
    def _pool_stack(self) -> list[MemPool]:
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        return stack

    def _current_pool(self) -> MemPool:
        stack = self._pool_stack()
        return stack[-1] if stack else self._pools[0]

    def create_pool(self) -> int:
        """A new private pool id (blocks freed into it are reused only by allocations routed to it)."""
        with self._locked():
            pid = self._next_pool_id
            self._next_pool_id += 1
            self._pools[pid] = MemPool(pid, private=True)
            return pid

    @contextlib.contextmanager
    def private_pool(self, pool_id: int | None = None) -> Iterator[int]:
        """Route this thread's allocations inside the block to private pool ``pool_id`` (new one if None)."""
        pid = self.create_pool() if pool_id is None else pool_id
        with self._locked():
            pool = self._pools.get(pid)
            if pool is None or not pool.private or pool.released:
                raise ValueError(f"CachingAllocator.private_pool: no live private pool with id {pid}")
            pool.active_users += 1
            self._private_users += 1
            self._fast = False
        stack = self._pool_stack()
        stack.append(pool)
        try:
            yield pid
        finally:
            stack.pop()
            with self._locked():
                pool.active_users -= 1
                self._private_users -= 1
                self._fast = self._profiler is None and not self._private_users

    @contextlib.contextmanager
    def graph_pool(self, pool_id: int | None = None) -> Iterator[int]:
        """Private pool for CUDA-graph capture: also defers cross-stream events until capture has ended."""
        with self.private_pool(pool_id) as pid:
            with self._locked():
                self._capture_depth += 1
            try:
                yield pid
            finally:
                with self._locked():
                    self._capture_depth -= 1
                    self._flush_deferred_capture()
                    if self._capture_depth == 0:
                        self._process_events()

    def reserve(self, pool_id: int, nbytes: int, stream: int | None = None) -> None:
        """Pre-fill pool ``pool_id`` with a cached segment of ``nbytes`` on ``stream``, before a capture."""
        with self.private_pool(pool_id):
            self.free(self.malloc(nbytes, stream))

    def release_pool(self, pool_id: int) -> int:
        """Give up private pool ``pool_id`` (its graph is gone): free segments now, busy ones when freed."""
        with self._locked():
            pool = self._pools.get(pool_id)
            if pool is None or not pool.private or pool.released:
                raise ValueError(f"CachingAllocator.release_pool: no live private pool with id {pool_id}")
            if pool.active_users:
                raise RuntimeError(f"CachingAllocator.release_pool: pool {pool_id} is in use by a `with`")
            pool.released = True
            released = self._release_cached([pool]) if self._capture_depth == 0 else 0
            if not pool.segments:
                self._pools.pop(pool_id, None)
            return released

    def pool_ids(self) -> list[int]:
        """Ids of the pools that still hold memory (0 is the default pool)."""
        return sorted(self._pools)

    # ------------------------------------------------------------------ statistics
    def _cached_free_bytes(self) -> int:
        return sum(p.cached_free for p in self._pools.values())

    def _largest_free_block(self) -> int:
        """Largest block a request could get after merging free neighbours (read-only)."""
        best = 0
        for p in self._pools.values():
            for fl in p.free_lists.values():
                if not fl.dirty:
                    best = max(best, fl.largest())
                    continue
                for b in fl.blocks():
                    if b.prev is not None and b.prev.state is FREE:
                        continue
                    run, nxt = b.size, b.next
                    while nxt is not None and nxt.state is FREE:
                        run, nxt = run + nxt.size, nxt.next
                    best = max(best, run)
        return best

    def memory_stats(self) -> dict[str, Any]:
        """Counters and gauges: bytes allocated/reserved/peaks, fragmentation, counts, size histograms."""
        with self._locked():
            cached = self._cached_free_bytes()
            largest = self._largest_free_block()
            active = Counter(1 << (b.size - 1).bit_length() for b in self._allocated.values())
            return {
                "allocated_bytes": self._allocated_bytes,
                "requested_bytes": sum(b.requested for b in self._allocated.values()),
                "reserved_bytes": self._reserved_bytes,
                "peak_allocated_bytes": self._peak_allocated,
                "peak_reserved_bytes": self._peak_reserved,
                "cached_free_bytes": cached,
                "pending_free_bytes": self._pending_bytes,
                "largest_cached_free_block": largest,
                "fragmentation": (1.0 - largest / cached) if cached else 0.0,
                "num_allocs": self._num_frees + len(self._allocated),
                "num_frees": self._num_frees,
                "num_active_blocks": len(self._allocated),
                "num_splits": self._num_splits,
                "num_merges": self._num_merges,
                "segments": sum(len(p.segments) for p in self._pools.values()),
                "num_device_mallocs": self._counts["num_device_mallocs"],
                "num_device_frees": self._counts["num_device_frees"],
                "num_oom_retries": self._counts["num_oom_retries"],
                "num_ooms": self._counts["num_ooms"],
                "granularity_small": self.granularity_small,
                "granularity_large": self.granularity_large,
                "private_pools": sum(1 for p in self._pools.values() if p.private),
                "histogram": dict(sorted(self._histogram.items())),
                "active_histogram": dict(sorted(active.items())),
            }

    def reset_peak_stats(self) -> None:
        """Peaks restart from the current values."""
        with self._locked():
            self._peak_allocated = self._allocated_bytes
            self._peak_reserved = self._reserved_bytes

    def snapshot(self) -> list[dict[str, Any]]:
        """Every segment with its blocks (address, size, state), free neighbours merged first: for
        debugging and the profiler."""
        with self._locked():
            self._coalesce_all()
            out = []
            for pool in self._pools.values():
                for seg in sorted(pool.segments.values(), key=lambda s: s.ptr):
                    blocks = []
                    b: Block | None = self._first_block(seg)
                    while b is not None:
                        blocks.append({"ptr": b.ptr, "size": b.size, "state": b.state,
                                       "requested": b.requested})
                        b = b.next
                    out.append({"ptr": seg.ptr, "size": seg.size, "stream": seg.stream, "pool": pool.name,
                                "small": seg.is_small, "blocks": blocks})
            return out

    def _first_block(self, seg: Segment) -> Block | None:
        for b in self._allocated.values():
            if b.segment is seg:
                while b.prev is not None:
                    b = b.prev
                return b
        for fl in seg.pool.free_lists.values():
            for b in fl.blocks():
                if b.segment is seg:
                    while b.prev is not None:
                        b = b.prev
                    return b
        for b in self._pending + self._deferred_capture:
            if b.segment is seg:
                while b.prev is not None:
                    b = b.prev
                return b
        return None

    def __repr__(self) -> str:
        return (f"CachingAllocator(device={getattr(self.backend, 'device_id', '?')}, "
                f"allocated={self._allocated_bytes}, reserved={self._reserved_bytes})")
