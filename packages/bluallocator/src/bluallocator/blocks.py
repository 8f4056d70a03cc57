"""Blocks, segments, best-fit free lists and memory pools: the data the caching allocator manages.

A *segment* is one driver allocation. It is cut into *blocks* laid out back to back (a doubly linked
list in address order) so that a freed block can merge with free neighbours of the same segment.
A *pool* owns segments; its free blocks sit in one best-fit list per (stream, small|large).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

FREE, ALLOCATED, PENDING = "free", "allocated", "pending"


class Segment:
    """One driver allocation, owned by exactly one pool and one stream."""

    __slots__ = ("ptr", "size", "stream", "pool", "is_small")

    def __init__(self, ptr: int, size: int, stream: int, pool: MemPool, is_small: bool) -> None:
        self.ptr, self.size, self.stream, self.pool, self.is_small = ptr, size, stream, pool, is_small


class Block:
    """A contiguous piece of a segment: free, allocated, or pending (freed, waiting for other streams)."""

    __slots__ = ("ptr", "size", "requested", "segment", "prev", "next", "state", "stream_uses", "events")

    def __init__(self, ptr: int, size: int, segment: Segment) -> None:
        self.ptr = ptr
        self.size = size
        self.requested = 0
        self.segment = segment
        self.prev: Block | None = None
        self.next: Block | None = None
        self.state = FREE
        self.stream_uses: set[int] = set()
        self.events: list[int] = []

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
    """Free blocks ordered by (size, address): ``best_fit`` is one bisection."""

    __slots__ = ("_keys", "_blocks", "bytes")

    def __init__(self) -> None:
        self._keys: list[tuple[int, int]] = []
        self._blocks: dict[int, Block] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, block: Block) -> None:
        bisect.insort(self._keys, (block.size, block.ptr))
        self._blocks[block.ptr] = block
        self.bytes += block.size

    def remove(self, block: Block) -> None:
        i = bisect.bisect_left(self._keys, (block.size, block.ptr))
        if i == len(self._keys) or self._keys[i] != (block.size, block.ptr):
            raise AssertionError(f"bluallocator: {block!r} missing from its free list (state corrupt)")
        del self._keys[i]
        del self._blocks[block.ptr]
        self.bytes -= block.size

    def best_fit(self, size: int) -> Block | None:
        """Smallest free block of at least ``size`` bytes (lowest address among equals)."""
        i = bisect.bisect_left(self._keys, (size, -1))
        if i == len(self._keys):
            return None
        return self._blocks[self._keys[i][1]]

    def largest(self) -> int:
        return self._keys[-1][0] if self._keys else 0

    def blocks(self) -> list[Block]:
        return [self._blocks[p] for _, p in self._keys]


@dataclass(eq=False)
class MemPool:
    """A set of segments and their free lists. Pool 0 is the default; others are private (graph) pools."""

    pool_id: int
    private: bool = False
    released: bool = False
    free_lists: dict[tuple[int, bool], FreeList] = field(default_factory=dict)
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
        return fl

    @property
    def reserved(self) -> int:
        return sum(s.size for s in self.segments.values())

    @property
    def cached_free(self) -> int:
        return sum(fl.bytes for fl in self.free_lists.values())

    def largest_free(self) -> int:
        return max((fl.largest() for fl in self.free_lists.values()), default=0)
