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
import threading
from collections import Counter, deque
from collections.abc import Iterator
from typing import Any

from .alignment import MIN_GRANULARITY, AlignmentChoice, AlignmentProfiler, round_up
from .backend import DeviceBackend
from .blocks import ALLOCATED, FREE, PENDING, Block, MemPool, Segment
from .errors import BackendOutOfMemory, OutOfMemoryError

MiB = 1 << 20
_get_ident = threading.get_ident


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
        if granularity < 1 or granularity & (granularity - 1):
            raise ValueError(f"CachingAllocator: granularity must be a power of two, got {granularity}")
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
        self._pools: dict[int, MemPool] = {0: MemPool(0)}
        self._next_pool_id = 1
        self._allocated: dict[int, Block] = {}
        self._pending: list[Block] = []
        self._deferred_capture: list[Block] = []
        self._event_cache: list[int] = []
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._deferred_frees: deque[int] = deque()
        self._capture_depth = 0
        self._profiler: AlignmentProfiler | None = None
        self._profile_remaining: int | None = None
        self.alignment_choice: AlignmentChoice | None = None
        self.startup_flushed = False
        # statistics
        self._allocated_bytes = 0
        self._requested_bytes = 0
        self._reserved_bytes = 0
        self._peak_allocated = 0
        self._peak_reserved = 0
        self._pending_bytes = 0
        self._counts = Counter[str]()
        self._num_allocs = 0
        self._num_frees = 0
        self._histogram = Counter[int]()
        self._active_histogram = Counter[int]()
        if profile_first_n is not None:
            self.begin_profile(first_n=profile_first_n)

    # ------------------------------------------------------------------ locking
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
                self._drain_deferred()
            finally:
                self._owner = None

    # ------------------------------------------------------------------ public: allocate / free
    def round_size(self, nbytes: int) -> int:
        """Block size a request of ``nbytes`` is served with (current granularities)."""
        n = max(int(nbytes), 1)
        return round_up(n, self.granularity_small if n <= self.small_size else self.granularity_large)

    def malloc(self, nbytes: int, stream: int | None = None) -> int:
        """Device pointer to at least ``nbytes`` bytes usable on ``stream`` (current stream if None)."""
        if nbytes < 0:
            raise ValueError(f"CachingAllocator.malloc: nbytes must be >= 0, got {nbytes}")
        if stream is None:
            stream = self.backend.current_stream()
        # hot path: the lock is taken inline (a generator context manager costs more than the work)
        with self._lock:
            self._owner = _get_ident()
            try:
                ptr = self._malloc_locked(int(nbytes), stream)
                if self._deferred_frees:
                    self._drain_deferred()
                return ptr
            finally:
                self._owner = None

    def free(self, ptr: int) -> None:
        """Return a pointer from :meth:`malloc` to the cache (deferred if other streams still use it)."""
        ident = _get_ident()
        if self._owner == ident:
            self._deferred_frees.append(ptr)
            return
        with self._lock:
            self._owner = ident
            try:
                self._free_locked(ptr)
                if self._deferred_frees:
                    self._drain_deferred()
            finally:
                self._owner = None

    def _drain_deferred(self) -> None:
        while self._deferred_frees:
            self._free_locked(self._deferred_frees.popleft())

    def record_stream(self, ptr: int, stream: int) -> None:
        """Mark that ``stream`` uses the block at ``ptr``: on free, reuse waits for that stream's work."""
        with self._locked():
            block = self._allocated.get(ptr)
            if block is None:
                raise ValueError(f"CachingAllocator.record_stream: {ptr:#x} is not an allocated block")
            if stream != block.stream:
                block.stream_uses.add(stream)

    def allocation_size(self, ptr: int) -> int:
        """Size of the block that serves the allocation at ``ptr``."""
        block = self._allocated.get(ptr)
        if block is None:
            raise ValueError(f"CachingAllocator.allocation_size: {ptr:#x} is not an allocated block")
        return block.size

    # ------------------------------------------------------------------ internals: allocate
    def _malloc_locked(self, nbytes: int, stream: int) -> int:
        if self._pending and self._capture_depth == 0:
            self._process_events()
        if self._profiler is not None:
            self._record_profile(nbytes)
        n = nbytes if nbytes > 0 else 1
        small = n <= self.small_size
        g = self.granularity_small if small else self.granularity_large
        size = -(-n // g) * g
        pool = self._current_pool()
        fl = pool.free_list(stream, small)
        block = fl.best_fit(size)
        if block is None:
            block = self._new_segment(pool, stream, small, size)
        else:
            fl.remove(block)
        remaining = block.size - size
        if remaining >= (self.granularity_small if small else self.small_size + 1):
            rest = Block(block.ptr + size, remaining, block.segment)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            fl.add(rest)
            self._counts["num_splits"] += 1
        block.state = ALLOCATED
        block.requested = nbytes
        self._allocated[block.ptr] = block
        self._allocated_bytes += block.size
        self._requested_bytes += nbytes
        if self._allocated_bytes > self._peak_allocated:
            self._peak_allocated = self._allocated_bytes
        self._num_allocs += 1
        self._histogram[1 << (n - 1).bit_length()] += 1
        self._active_histogram[1 << (block.size - 1).bit_length()] += 1
        return block.ptr

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
            raise ValueError(f"CachingAllocator.free: {ptr:#x} was not allocated here (or was freed twice)")
        self._allocated_bytes -= block.size
        self._requested_bytes -= block.requested
        self._active_histogram[1 << (block.size - 1).bit_length()] -= 1
        self._num_frees += 1
        if block.stream_uses:
            block.state = PENDING
            self._pending_bytes += block.size
            if self._capture_depth > 0 or any(self.backend.is_capturing(s) for s in block.stream_uses):
                self._deferred_capture.append(block)   # events cannot be recorded into a capture
            else:
                self._insert_events(block)
                self._pending.append(block)
            return
        self._return_block(block)

    def _insert_events(self, block: Block) -> None:
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
        self._event_cache.extend(block.events)
        block.events = []
        self._pending_bytes -= block.size
        self._return_block(block)

    def _synchronize_pending(self) -> None:
        for block in self._pending:
            for e in block.events:
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
        """Mark free, merge with free neighbours of the same segment, then cache (or release)."""
        block.state = FREE
        block.stream_uses.clear()
        seg = block.segment
        pool = seg.pool
        fl = pool.free_list(seg.stream, seg.is_small)
        prev = block.prev
        if prev is not None and prev.state == FREE:
            fl.remove(prev)
            prev.size += block.size
            prev.next = block.next
            if block.next is not None:
                block.next.prev = prev
            block = prev
            self._counts["num_merges"] += 1
        nxt = block.next
        if nxt is not None and nxt.state == FREE:
            fl.remove(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
            self._counts["num_merges"] += 1
        if pool.released and not block.is_split and self._capture_depth == 0:
            self._release_segment(seg)
        else:
            fl.add(block)

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
        self._profiler = AlignmentProfiler(self.small_size, self.class_weight)
        self._profile_remaining = first_n

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
        stack = self._pool_stack()
        stack.append(pool)
        try:
            yield pid
        finally:
            stack.pop()
            with self._locked():
                pool.active_users -= 1

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
        return max((p.largest_free() for p in self._pools.values()), default=0)

    def memory_stats(self) -> dict[str, Any]:
        """Counters and gauges: bytes allocated/reserved/peaks, fragmentation, counts, size histograms."""
        with self._locked():
            cached = self._cached_free_bytes()
            largest = self._largest_free_block()
            return {
                "allocated_bytes": self._allocated_bytes,
                "requested_bytes": self._requested_bytes,
                "reserved_bytes": self._reserved_bytes,
                "peak_allocated_bytes": self._peak_allocated,
                "peak_reserved_bytes": self._peak_reserved,
                "cached_free_bytes": cached,
                "pending_free_bytes": self._pending_bytes,
                "largest_cached_free_block": largest,
                "fragmentation": (1.0 - largest / cached) if cached else 0.0,
                "num_allocs": self._num_allocs,
                "num_frees": self._num_frees,
                "num_active_blocks": len(self._allocated),
                "num_splits": self._counts["num_splits"],
                "num_merges": self._counts["num_merges"],
                "segments": sum(len(p.segments) for p in self._pools.values()),
                "num_device_mallocs": self._counts["num_device_mallocs"],
                "num_device_frees": self._counts["num_device_frees"],
                "num_oom_retries": self._counts["num_oom_retries"],
                "num_ooms": self._counts["num_ooms"],
                "granularity_small": self.granularity_small,
                "granularity_large": self.granularity_large,
                "private_pools": sum(1 for p in self._pools.values() if p.private),
                "histogram": dict(sorted(self._histogram.items())),
                "active_histogram": {k: v for k, v in sorted(self._active_histogram.items()) if v},
            }

    def reset_peak_stats(self) -> None:
        """Peaks restart from the current values."""
        with self._locked():
            self._peak_allocated = self._allocated_bytes
            self._peak_reserved = self._reserved_bytes

    def snapshot(self) -> list[dict[str, Any]]:
        """Every segment with its blocks (address, size, state): for debugging and the profiler."""
        with self._locked():
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
