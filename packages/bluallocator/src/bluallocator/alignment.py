"""Rounding granularity chosen from the first step's allocation profile instead of fixed size classes.

During step 0 the allocator records every request size. For each candidate granularity ``g`` (powers of two
from 512 B) the cost of rounding every request up to a multiple of ``g`` is

    cost(g) = sum_s count(s) * (round_up(s, g) - s)      # wasted bytes, weighted by how often s is asked
            + class_weight * sum_{c in classes(g)} c     # one cached block stranded per distinct size class

The first term grows with ``g``; the second shrinks with ``g`` because neighbouring sizes fall into the
same class and can then reuse each other's freed blocks exactly (no split, no fragmentation). The
granularity with the lowest cost wins (ties: the smaller one). Small requests (<= 1 MiB) and large ones
are profiled separately, because they live in separate pools.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

MIN_GRANULARITY = 512
SMALL_CANDIDATES: tuple[int, ...] = tuple(1 << k for k in range(9, 21))  # 512 B .. 1 MiB
LARGE_CANDIDATES: tuple[int, ...] = tuple(1 << k for k in range(9, 22))  # 512 B .. 2 MiB


def round_up(n: int, g: int) -> int:
    """Smallest multiple of ``g`` that is >= ``n`` (at least ``g``)."""
    return max(g, -(-n // g) * g)


def rounding_cost(histogram: Mapping[int, int], g: int, class_weight: float = 1.0) -> tuple[int, int, float]:
    """(wasted bytes, bytes of distinct classes, total cost) of rounding the profiled sizes to ``g``."""
    waste = 0
    classes: set[int] = set()
    for size, count in histogram.items():
        r = round_up(size, g)
        waste += count * (r - size)
        classes.add(r)
    class_bytes = sum(classes)
    return waste, class_bytes, waste + class_weight * class_bytes


def choose_granularity(histogram: Mapping[int, int], candidates: Iterable[int] = LARGE_CANDIDATES,
                       class_weight: float = 1.0, default: int = MIN_GRANULARITY) -> int:
    """The candidate with the lowest :func:`rounding_cost` (smallest on ties; ``default`` if no data)."""
    if not histogram:
        return default
    best_g, best_cost = None, None
    for g in sorted(candidates):
        cost = rounding_cost(histogram, g, class_weight)[2]
        if best_cost is None or cost < best_cost:
            best_g, best_cost = g, cost
    assert best_g is not None
    return best_g


@dataclass
class AlignmentChoice:
    """Result of a profile: the granularities to apply and the evidence behind them."""

    granularity_small: int
    granularity_large: int
    num_requests: int
    costs_small: dict[int, float] = field(default_factory=dict)
    costs_large: dict[int, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        """JSON-friendly summary."""
        return {"granularity_small": self.granularity_small, "granularity_large": self.granularity_large,
                "num_requests": self.num_requests}


class AlignmentProfiler:
    """Counts request sizes (split into small/large at ``small_size``) and picks granularities."""

    def __init__(self, small_size: int = 1 << 20, class_weight: float = 1.0) -> None:
        self.small_size = small_size
        self.class_weight = class_weight
        self.small: Counter[int] = Counter()
        self.large: Counter[int] = Counter()

    def record(self, nbytes: int) -> None:
        """Count one request of ``nbytes``."""
        (self.small if nbytes <= self.small_size else self.large)[nbytes] += 1

    @property
    def num_requests(self) -> int:
        """Requests recorded so far."""
        return sum(self.small.values()) + sum(self.large.values())

    def choose(self) -> AlignmentChoice:
        """Pick the small- and large-pool granularity minimising :func:`rounding_cost`."""
        small_c = [g for g in SMALL_CANDIDATES if g <= self.small_size]
        gs = choose_granularity(self.small, small_c, self.class_weight)
        gl = choose_granularity(self.large, LARGE_CANDIDATES, self.class_weight)
        return AlignmentChoice(
            granularity_small=gs, granularity_large=gl, num_requests=self.num_requests,
            costs_small={g: rounding_cost(self.small, g, self.class_weight)[2] for g in small_c},
            costs_large={g: rounding_cost(self.large, g, self.class_weight)[2] for g in LARGE_CANDIDATES},
        )
