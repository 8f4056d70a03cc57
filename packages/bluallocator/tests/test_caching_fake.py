"""Rules that need a device the test fully controls (capacity, injected failures, capture flags)."""

from __future__ import annotations

import random
import threading

import pytest
from bluallocator import CachingAllocator, FakeDeviceBackend, OutOfMemoryError
from bluallocator.errors import BackendOutOfMemory
from conftest import MiB


def test_oom_retry_frees_cached_segments_first():
    be = FakeDeviceBackend(64 * MiB)
    a = CachingAllocator(be)
    p = a.malloc(40 * MiB, 0)
    a.free(p)  # 40 MiB cached, 24 MiB free on the device
    q = a.malloc(50 * MiB, 0)  # needs the cache back: must succeed through the retry
    st = a.memory_stats()
    assert st["num_oom_retries"] == 1 and st["reserved_bytes"] == 50 * MiB and st["num_device_frees"] == 1
    a.free(q)


def test_oom_falls_back_to_a_tight_segment():
    be = FakeDeviceBackend(12 * MiB)
    a = CachingAllocator(be)
    p = a.malloc(3 * MiB, 0)  # would want a 20 MiB segment; 4 MiB (rounded to 2 MiB) fits
    assert a.memory_stats()["reserved_bytes"] == 4 * MiB
    a.free(p)


def test_oom_message_numbers_on_fake_device():
    be = FakeDeviceBackend(64 * MiB)
    a = CachingAllocator(be)
    keep = a.malloc(30 * MiB, 0)
    with pytest.raises(OutOfMemoryError) as ei:
        a.malloc(40 * MiB, 0)
    msg = str(ei.value)
    assert "tried to allocate 40.00 MiB (41943040 bytes)" in msg
    assert "free on device 34.00 MiB (35651584 bytes) of total 64.00 MiB (67108864 bytes)" in msg
    assert "reserved by allocator 30.00 MiB" in msg and "largest cached free block 0 B" in msg
    a.free(keep)


def test_pending_blocks_are_synchronised_before_giving_up():
    be = FakeDeviceBackend(24 * MiB)
    a = CachingAllocator(be)
    p = a.malloc(20 * MiB, 0)
    a.record_stream(p, 7)
    be.enqueue(7)
    a.free(p)
    assert a.memory_stats()["pending_free_bytes"] == 20 * MiB
    q = a.malloc(20 * MiB, 0)  # only possible after waiting for stream 7 and reusing/releasing p
    assert q == p
    a.free(q)


def test_graph_pool_defers_cross_stream_events_until_capture_ends():
    be = FakeDeviceBackend()
    a = CachingAllocator(be)
    be.begin_capture(5)
    with a.graph_pool() as pid:
        p = a.malloc(4096, 5)
        a.record_stream(p, 6)
        a.free(p)
        assert be.events_created == 0, "no event may be recorded into a capture"
        assert a.memory_stats()["pending_free_bytes"] == 4096
        be.end_capture(5)
    assert be.events_created == 1 and a.memory_stats()["pending_free_bytes"] == 0  # event already complete
    with a.private_pool(pid):
        assert a.malloc(4096, 5) == p


def test_graph_pool_allocations_are_invisible_to_the_default_pool():
    be = FakeDeviceBackend()
    a = CachingAllocator(be)
    graph_ptrs = set()
    with a.graph_pool() as pid:
        for n in (4096, 100_000, 3 * MiB, 512):
            ptr = a.malloc(n, 5)
            graph_ptrs.add(ptr)
            a.free(ptr)  # freed during capture: reusable within the graph pool only
    outside = [a.malloc(n, 5) for n in (4096, 100_000, 3 * MiB, 512)]
    assert not graph_ptrs & set(outside)
    seg_pools = {s["pool"] for s in a.snapshot()}
    assert seg_pools == {"default", f"private:{pid}"}


def test_reentrant_free_from_a_finaliser_is_deferred():
    """A GC finaliser may free a block while malloc runs on the same thread: it must be queued."""
    be = FakeDeviceBackend()
    a = CachingAllocator(be)
    victim = a.malloc(4096, 0)

    class ReentrantBackend:
        def __getattr__(self, name):
            return getattr(be, name)

        def malloc(self, n):
            a.free(victim)  # as if a finaliser ran here
            assert a.memory_stats.__self__._deferred_frees, "free must have been deferred"
            return be.malloc(n)

    a.backend = ReentrantBackend()
    big = a.malloc(3 * MiB, 0)  # new segment -> backend.malloc -> re-entrant free
    st = a.memory_stats()
    assert st["num_frees"] == 1 and st["allocated_bytes"] == 3 * MiB
    a.free(big)


def test_profile_first_n_ends_by_itself_and_applies():
    be = FakeDeviceBackend()
    a = CachingAllocator(be, profile_first_n=4)
    sizes = [3 * MiB + k * 4096 for k in range(4)]
    ptrs = [a.malloc(n, 0) for n in sizes]
    assert not a.profiling and a.alignment_choice is not None
    assert a.granularity_large == a.alignment_choice.granularity_large
    for p in ptrs:
        a.free(p)


def _check_invariants(a: CachingAllocator, be: FakeDeviceBackend, live: dict[int, int]) -> None:
    st = a.memory_stats()
    assert st["allocated_bytes"] == sum(a.allocation_size(p) for p in live)
    assert st["reserved_bytes"] == be.used
    assert st["reserved_bytes"] == st["allocated_bytes"] + st["cached_free_bytes"] + st["pending_free_bytes"]
    spans = sorted((p, p + a.allocation_size(p)) for p in live)
    for (_s0, e0), (s1, _) in zip(spans, spans[1:]):
        assert e0 <= s1, "live allocations overlap"
    for seg in a.snapshot():
        total = 0
        addr = seg["ptr"]
        for b in seg["blocks"]:
            assert b["ptr"] == addr
            addr += b["size"]
            total += b["size"]
        assert total == seg["size"], "blocks must tile their segment exactly"
        states = [b["state"] for b in seg["blocks"]]
        assert all(not (x == y == "free") for x, y in zip(states, states[1:])), "free neighbours not merged"


@pytest.mark.parametrize("seed", range(5))
def test_random_trace_keeps_invariants(seed):
    rng = random.Random(seed)
    be = FakeDeviceBackend(2 << 30)
    a = CachingAllocator(be)
    streams = [0, 11, 12]
    live: dict[int, int] = {}
    for step in range(1500):
        if live and rng.random() < 0.45:
            p = rng.choice(list(live))
            if rng.random() < 0.2:
                a.record_stream(p, rng.choice(streams))
                be.enqueue(rng.choice(streams))
            a.free(p)
            del live[p]
        else:
            n = rng.choice([rng.randint(1, 4096), rng.randint(1, MiB), rng.randint(MiB, 24 * MiB)])
            live[a.malloc(n, rng.choice(streams))] = n
        if step % 97 == 0:
            be.synchronize()
            _check_invariants(a, be, live)
        if step % 400 == 399:
            a.empty_cache()
    for p in list(live):
        a.free(p)
    be.synchronize()
    a.empty_cache()
    assert a.memory_stats()["reserved_bytes"] == 0 and be.used == 0


def test_threads_share_one_allocator_safely():
    be = FakeDeviceBackend(4 << 30)
    a = CachingAllocator(be)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[int] = []
        try:
            for _ in range(800):
                if mine and rng.random() < 0.5:
                    a.free(mine.pop(rng.randrange(len(mine))))
                else:
                    mine.append(a.malloc(rng.randint(1, 3 * MiB), 0))
            for p in mine:
                a.free(p)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    st = a.memory_stats()
    assert st["allocated_bytes"] == 0 and st["num_allocs"] == st["num_frees"]
    assert st["reserved_bytes"] == st["cached_free_bytes"] == be.used


def test_fake_backend_rejects_bad_use():
    be = FakeDeviceBackend(MiB)
    with pytest.raises(BackendOutOfMemory):
        be.malloc(2 * MiB)
    with pytest.raises(ValueError, match="not allocated"):
        be.free(1)
    with pytest.raises(ValueError, match="unknown event"):
        be.event_query(99)
    with pytest.raises(ValueError, match="capacity"):
        FakeDeviceBackend(0)


def test_capture_never_returns_memory_to_the_driver():
    be = FakeDeviceBackend(64 * MiB)
    a = CachingAllocator(be)
    a.free(a.malloc(40 * MiB, 0))  # 40 MiB cached in the default pool
    pid = a.create_pool()
    a.reserve(pid, 4 * MiB, 5)
    frees_before = be.num_frees
    be.begin_capture(5)
    with a.graph_pool(pid):
        p = a.malloc(3 * MiB, 5)  # served by the reserved segment: no cudaMalloc during capture
        assert a.memory_stats()["num_device_mallocs"] == 2
        assert a.empty_cache() == 0
        with pytest.raises(OutOfMemoryError, match="during CUDA-graph capture"):
            a.malloc(30 * MiB, 5)
        assert be.num_frees == frees_before, "cudaFree during capture would invalidate it"
        a.free(p)
    be.end_capture(5)
    assert a.empty_cache() == 40 * MiB


@pytest.mark.parametrize("second_stream", [5, 6])
def test_graphs_sharing_a_pool_reuse_its_blocks_only_on_one_capture_stream(second_stream):
    """Two captures into one pool (a micro-step graph and the last-step graph) never have their activations alive
    at once: captured on one stream the second reuses the first's blocks; on another stream it cannot (free lists
    are per stream), and the pool reserves a second copy. Hence one default capture stream in blutensor."""
    be = FakeDeviceBackend()
    a = CachingAllocator(be)
    sizes = (3 * MiB, 12 * MiB, 700_000, 40 * MiB)
    with a.graph_pool() as pid:
        for p in [a.malloc(n, 5) for n in sizes]:
            a.free(p)
    one = a.memory_stats()["reserved_bytes"]
    with a.graph_pool(pid):
        for p in [a.malloc(n, second_stream) for n in sizes]:
            a.free(p)
    both = a.memory_stats()["reserved_bytes"]
    assert both == (one if second_stream == 5 else 2 * one)
