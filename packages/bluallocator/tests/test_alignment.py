"""The step-0 alignment profile picks the granularity a brute-force search over requests picks."""

from __future__ import annotations

import random

import pytest
from bluallocator import CachingAllocator, FakeDeviceBackend
from bluallocator.alignment import (
    LARGE_CANDIDATES,
    SMALL_CANDIDATES,
    AlignmentProfiler,
    choose_granularity,
    round_up,
    rounding_cost,
)
from conftest import MiB


def brute_force(requests: list[int], candidates, class_weight: float = 1.0) -> int:
    """Independent reference: walk every individual request for every candidate."""
    best = None
    for g in sorted(candidates):
        waste = 0
        classes = set()
        for s in requests:
            r = g * ((s + g - 1) // g)
            waste += r - s
            classes.add(r)
        cost = waste + class_weight * sum(classes)
        if best is None or cost < best[0]:
            best = (cost, g)
    return best[1]


def test_round_up_and_cost_by_hand():
    assert round_up(1, 512) == 512 and round_up(512, 512) == 512 and round_up(513, 512) == 1024
    assert round_up(0, 512) == 512
    hist = {1000: 3, 3000: 1}
    # g=512: 1000->1024 (24 wasted x3), 3000->3072 (72); classes 1024 + 3072
    assert rounding_cost(hist, 512) == (3 * 24 + 72, 1024 + 3072, 3 * 24 + 72 + 4096)
    # g=4096: both -> 4096: waste 3*3096 + 1096, one class
    assert rounding_cost(hist, 4096) == (3 * 3096 + 1096, 4096, 3 * 3096 + 1096 + 4096)


def test_a_single_repeated_size_keeps_the_finest_granularity():
    hist = {3 * MiB + 100: 1000}
    assert choose_granularity(hist, LARGE_CANDIDATES) == 512


def test_many_nearby_sizes_pick_a_coarser_granularity():
    reqs = [3 * MiB + k * 4096 + 7 for k in range(64)]
    hist = {s: 1 for s in reqs}
    g = choose_granularity(hist, LARGE_CANDIDATES)
    assert g > 512
    assert g == brute_force(reqs, LARGE_CANDIDATES)


@pytest.mark.parametrize("seed", range(12))
def test_profile_choice_equals_brute_force_optimum(seed):
    rng = random.Random(seed)
    reqs: list[int] = []
    for _ in range(rng.randint(5, 60)):
        kind = rng.random()
        if kind < 0.4:
            base = rng.randint(1, MiB)
        elif kind < 0.8:
            base = rng.randint(MiB + 1, 64 * MiB)
        else:
            base = rng.choice([768 * 768 * 4, 768 * 3072 * 4, 8 * 1024 * 768 * 4])
        reqs += [base + rng.randint(0, 3000) for _ in range(rng.randint(1, 5))] * rng.randint(1, 20)
    weight = rng.choice([0.25, 1.0, 4.0])
    prof = AlignmentProfiler(class_weight=weight)
    for s in reqs:
        prof.record(s)
    choice = prof.choose()
    small = [s for s in reqs if s <= MiB]
    large = [s for s in reqs if s > MiB]
    assert choice.granularity_small == (brute_force(small, SMALL_CANDIDATES, weight) if small else 512)
    assert choice.granularity_large == (brute_force(large, LARGE_CANDIDATES, weight) if large else 512)
    assert choice.num_requests == len(reqs)
    if large:
        assert choice.costs_large[choice.granularity_large] == min(choice.costs_large.values())


def test_allocator_applies_the_profiled_granularity():
    be = FakeDeviceBackend()
    a = CachingAllocator(be)
    reqs = [3 * MiB + k * 4096 + 7 for k in range(64)] + [1000 + 8 * k for k in range(40)]
    a.begin_profile()
    for s in reqs:
        a.free(a.malloc(s, 0))
    assert a.round_size(3 * MiB + 7) == 3 * MiB + 512  # profile not applied yet
    info = a.flush_after_step0()
    gl = brute_force([s for s in reqs if s > MiB], LARGE_CANDIDATES)
    gs = brute_force([s for s in reqs if s <= MiB], SMALL_CANDIDATES)
    assert (info["granularity_large"], info["granularity_small"]) == (gl, gs)
    assert a.round_size(3 * MiB + 7) == round_up(3 * MiB + 7, gl)
    assert a.round_size(1000) == round_up(1000, gs)
    assert a.memory_stats()["reserved_bytes"] == 0
    p = a.malloc(3 * MiB + 7, 0)
    assert a.allocation_size(p) == round_up(3 * MiB + 7, gl)
    a.free(p)


def test_end_profile_without_begin_is_an_error():
    a = CachingAllocator(FakeDeviceBackend())
    with pytest.raises(RuntimeError, match="begin_profile"):
        a.end_profile()
