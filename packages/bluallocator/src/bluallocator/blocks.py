"""Blocks, segments, best-fit free lists and memory pools: the data the caching allocator manages.

A *segment* is one driver allocation. It is cut into *blocks* laid out back to back (a doubly linked
list in address order) so that a freed block can merge with free neighbours of the same segment.
A *pool* owns segments; its free blocks sit in one best-fit list per (stream, small|large).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

FREE, ALLOCATED, PENDING = "free", "allocated", "pending"
MERGED = "merged"  # absorbed into a free neighbour (no longer a block)


class Segment:
    """One driver allocation, owned by exactly one pool and one stream."""

    __slots__ = ("ptr", "size", "stream", "pool", "is_small", "free_list")

    def __init__(self, ptr: int, size: int, stream: int, pool: MemPool, is_small: bool) -> None:
        self.ptr, self.size, self.stream, self.pool, self.is_small = ptr, size, stream, pool, is_small
        self.free_list: FreeList | None = None  # set for default-pool segments: their frees take the fast path


class Block:
    """A contiguous piece of a segment: free, allocated, or pending (freed, waiting for other streams).

    ``stream_uses`` and ``events`` stay None until another stream touches the block (no per-call churn).
    """

    __slots__ = ("ptr", "size", "requested", "segment", "prev", "next", "state", "stream_uses", "events")

    def __init__(self, ptr: int, size: int, segment: Segment) -> None:
        self.ptr = ptr
        self.size = size
        self.requested = 0
        self.segment = segment
        self.prev: Block | None = None
        self.next: Block | None = None
        self.state = FREE
        self.stream_uses: set[int] | None = None
        self.events: list[int] | None = None

    @property
    def stream(self) -> int:
        """Stream whose pool this block returns to."""
        return self.segment.stream

    @property
    def is_split(self) -> bool:
        """True if the block does not cover its whole segment."""
        return self.prev is not None or self.next is not None

    def __repr__(self) -> str:
        return f"Block({self.ptr:#x}, {self.size}, {self.state}, stream={self.stream:#x})"


class FreeList:
    """Free blocks bucketed by exact size: an exact-size request is one dict pop (the hot path of a
    training loop, which asks for the same sizes every step); otherwise best fit is one bisection over
    the sorted distinct sizes. ``dirty`` lists blocks freed next to a free neighbour: merging them is
    deferred until a request misses the exact-size path, or stats/empty_cache need it."""

    __slots__ = ("_sizes", "_buckets", "dirty")

    def __init__(self) -> None:
        self._sizes: list[int] = []                   # sorted; may hold sizes whose bucket is empty
        self._buckets: dict[int, dict[int, Block]] = {}  # size -> {ptr: block}
        self.dirty: list[Block] = []  # freed next to a free neighbour, not merged yet

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())

    @property
    def bytes(self) -> int:
        """Bytes of the free blocks held (computed: the hot path keeps no running sums)."""
        return sum(s * len(b) for s, b in self._buckets.items())

    def add(self, block: Block) -> None:
        b = self._buckets.get(block.size)
        if b is None:
            self._buckets[block.size] = {block.ptr: block}
            bisect.insort(self._sizes, block.size)
        else:
            b[block.ptr] = block

    def remove(self, block: Block) -> None:
        b = self._buckets.get(block.size)
        if b is None or b.pop(block.ptr, None) is None:
            raise AssertionError(f"bluallocator: {block!r} missing from its free list (state corrupt)")

    def take_exact(self, size: int) -> Block | None:
        """Remove and return a free block of exactly ``size`` bytes (lowest address), or None."""
        b = self._buckets.get(size)
        if not b:
            return None
        return b.popitem()[1] if len(b) == 1 else b.pop(min(b))

    def take(self, size: int) -> Block | None:
        """Remove and return the smallest free block of at least ``size`` bytes (lowest address among
        equals), or None."""
        b = self._buckets.get(size)
        if b:
            return self.take_exact(size)
        sizes = self._sizes
        i = j = bisect.bisect_left(sizes, size)
        n = len(sizes)
        while j < n and not self._buckets[sizes[j]]:
            j += 1
        if j > i:  # drop empty buckets passed over (keeps the scan short)
            for s in sizes[i:j]:
                del self._buckets[s]
            del sizes[i:j]
        if i == len(sizes):
            return None
        return self.take_exact(sizes[i])

    def best_fit(self, size: int) -> Block | None:
        """Smallest free block of at least ``size`` bytes, left in the list."""
        for s in self._sizes[bisect.bisect_left(self._sizes, size):]:
            b = self._buckets[s]
            if b:
                return b[min(b)]
        return None

    def largest(self) -> int:
        for s in reversed(self._sizes):
            if self._buckets[s]:
                return s
        return 0

    def blocks(self) -> list[Block]:
        """Every free block, ordered by (size, address)."""
        return [b[p] for s in self._sizes for b in (self._buckets[s],) for p in sorted(b)]


@dataclass(eq=False)
class MemPool:
    """A set of segments and their free lists. Pool 0 is the default; others are private (graph) pools."""

    pool_id: int
    private: bool = False
    released: bool = False
    free_lists: dict[tuple[int, bool], FreeList] = field(default_factory=dict)
    small_lists: dict[int, FreeList] = field(default_factory=dict)  # stream -> list (fast lookup)
    large_lists: dict[int, FreeList] = field(default_factory=dict)
    segments: dict[int, Segment] = field(default_factory=dict)
    active_users: int = 0

    @property
    def name(self) -> str:
        return "default" if not self.private else f"private:{self.pool_id}"

    def free_list(self, stream: int, small: bool) -> FreeList:
        key = (stream, small)
        fl = self.free_lists.get(key)
        if fl is None:
            fl = self.free_lists[key] = FreeList()
            (self.small_lists if small else self.large_lists)[stream] = fl
        return fl

    @property
    def reserved(self) -> int:
        return sum(s.size for s in self.segments.values())

    @property
    def cached_free(self) -> int:
        return sum(fl.bytes for fl in self.free_lists.values())

    def largest_free(self) -> int:
        return max((fl.largest() for fl in self.free_lists.values()), default=0)
