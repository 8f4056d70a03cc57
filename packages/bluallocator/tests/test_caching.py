"""CachingAllocator rules, each run on the fake backend and (marked cuda) on a real GPU."""

from __future__ import annotations

import pytest
from bluallocator import OutOfMemoryError
from conftest import MiB


def test_small_requests_round_to_512_and_share_a_2mib_segment(env):
    a = env.allocator()
    p = a.malloc(1000, 0)
    q = a.malloc(3000, 0)
    assert a.allocation_size(p) == 1024 and a.allocation_size(q) == 3072
    assert q == p + 1024  # carved from the same segment, back to back
    st = a.memory_stats()
    assert st["reserved_bytes"] == 2 * MiB and st["segments"] == 1 and st["num_device_mallocs"] == 1
    assert st["allocated_bytes"] == 4096 and st["requested_bytes"] == 4000


def test_split_and_coalesce_with_both_neighbours(env):
    a = env.allocator()
    p1, p2, p3 = (a.malloc(4096, 0) for _ in range(3))
    guard = a.malloc(4096, 0)
    a.free(p1)
    a.free(p3)
    a.free(p2)  # cached as is: merging waits until a request needs it (deferred coalescing)
    assert a.memory_stats()["num_merges"] == 0
    assert a.memory_stats()["largest_cached_free_block"] == 2 * MiB - 4 * 4096  # the stats see through it
    a.coalesce()  # merges with p1 on the left and p3 on the right
    assert a.memory_stats()["num_merges"] == 2
    big = a.malloc(3 * 4096, 0)
    assert big == p1, "the three neighbours must have merged into one block"
    a.free(big)
    a.free(guard)
    st = a.memory_stats()
    assert st["cached_free_bytes"] == 2 * MiB and st["largest_cached_free_block"] == 2 * MiB
    assert st["fragmentation"] == 0.0 and st["allocated_bytes"] == 0


def test_best_fit_takes_the_smallest_block_that_fits(env):
    a = env.allocator()
    big = a.malloc(8192, 0)
    g1 = a.malloc(512, 0)
    small = a.malloc(4096, 0)
    g2 = a.malloc(512, 0)
    a.free(big)
    a.free(small)
    assert a.malloc(3000, 0) == small
    assert a.malloc(6000, 0) == big
    for p in (g1, g2):
        a.free(p)


def test_large_pool_segments_and_split_threshold(env):
    a = env.allocator()
    p = a.malloc(3 * MiB, 0)
    q = a.malloc(3 * MiB, 0)
    assert q == p + 3 * MiB  # both from one 20 MiB segment
    assert a.memory_stats()["reserved_bytes"] == 20 * MiB
    r = a.malloc(15 * MiB, 0)  # does not fit the 14 MiB left: own segment rounded to 2 MiB = 16 MiB
    assert a.memory_stats()["reserved_bytes"] == 36 * MiB
    assert a.allocation_size(r) == 16 * MiB, "a remainder of <= 1 MiB in the large pool is not split off"
    s = a.malloc(12 * MiB, 0)  # fits the 14 MiB left in the first segment: split, no new segment
    assert s == q + 3 * MiB and a.memory_stats()["segments"] == 2 and a.allocation_size(s) == 12 * MiB
    small = a.malloc(4096, 0)
    assert a.memory_stats()["reserved_bytes"] == 38 * MiB, "small requests never come from large segments"
    for x in (p, q, r, s, small):
        a.free(x)


def test_streams_have_separate_pools(env):
    a = env.allocator()
    s1, s2 = env.new_stream(), env.new_stream()
    p = a.malloc(4096, s1)
    a.free(p)
    q = a.malloc(4096, s2)
    assert q != p and a.memory_stats()["segments"] == 2
    assert a.malloc(4096, s1) == p


def test_record_stream_defers_reuse_until_the_other_stream_finishes(env):
    a = env.allocator()
    s1, s2 = env.new_stream(), env.new_stream()
    p = a.malloc(4096, s1)
    a.record_stream(p, s2)
    release = env.block(s2)  # s2 still has work queued that (may) read p
    a.free(p)
    st = a.memory_stats()
    assert st["pending_free_bytes"] == 4096 and st["allocated_bytes"] == 0
    q = a.malloc(4096, s1)
    assert q != p, "a block still used by another stream must not be handed out"
    release()
    r = a.malloc(4096, s1)
    assert r == p and a.memory_stats()["pending_free_bytes"] == 0
    a.free(q)
    a.free(r)


def test_record_stream_on_own_stream_is_free_of_events(env):
    a = env.allocator()
    s1 = env.new_stream()
    p = a.malloc(4096, s1)
    a.record_stream(p, s1)
    a.free(p)
    assert a.memory_stats()["pending_free_bytes"] == 0
    assert a.malloc(4096, s1) == p


def test_private_pool_blocks_are_reused_only_by_that_pool(env):
    a = env.allocator()
    with a.private_pool() as pid:
        p = a.malloc(4096, 0)
        inside = a.malloc(8192, 0)
    a.free(p)  # freed outside the context: still returns to the private pool
    q = a.malloc(4096, 0)
    assert q != p, "the default pool must not reuse a private pool's block"
    st = a.memory_stats()
    assert st["segments"] == 2 and st["private_pools"] == 1
    with a.private_pool(pid):
        assert a.malloc(4096, 0) == p
    a.free(q)
    a.free(inside)


def test_empty_cache_keeps_live_private_pools_and_release_pool_returns_them(env):
    a = env.allocator()
    pid = a.create_pool()
    with a.private_pool(pid):
        p = a.malloc(4096, 0)
        big = a.malloc(3 * MiB, 0)
    a.free(big)
    x = a.malloc(4096, 0)
    a.free(x)
    assert a.memory_stats()["reserved_bytes"] == 2 * MiB + 2 * MiB + 20 * MiB
    released = a.empty_cache()
    assert released == 2 * MiB, "only the default pool's free segment may go back"
    assert a.release_pool(pid) == 20 * MiB  # the free large segment goes at once
    assert a.memory_stats()["reserved_bytes"] == 2 * MiB  # p still alive
    a.free(p)  # last block of a released pool: its segment goes back to the driver
    st = a.memory_stats()
    assert st["reserved_bytes"] == 0 and st["private_pools"] == 0
    with pytest.raises(ValueError, match="no live private pool"):
        a.release_pool(pid)


def test_release_pool_refused_while_in_use(env):
    a = env.allocator()
    with a.private_pool() as pid, pytest.raises(RuntimeError, match="in use"):
        a.release_pool(pid)


def test_flush_after_step0_returns_startup_memory(env):
    a = env.allocator()
    free0, _ = env.backend.mem_get_info()
    a.begin_profile()
    ptrs = [a.malloc(n, 0) for n in (1000, 5000, 3 * MiB, 18 * MiB, 700_000)]
    keep = a.malloc(4096, 0)
    for p in ptrs:
        a.free(p)
    info = a.flush_after_step0()
    st = a.memory_stats()
    assert info["released_bytes"] == 20 * MiB + 18 * MiB
    assert st["reserved_bytes"] == 2 * MiB and st["segments"] == 1  # only the segment holding `keep`
    assert info["profiled_requests"] == 6 and not a.profiling
    a.free(keep)
    a.empty_cache()
    assert a.memory_stats()["reserved_bytes"] == 0
    if env.name == "fake":
        assert env.backend.mem_get_info()[0] == free0


def test_stats_peaks_fragmentation_and_histogram(env):
    a = env.allocator()
    p = a.malloc(MiB, 0)
    q = a.malloc(4096, 0)
    r = a.malloc(512 * 1024, 0)
    g = a.malloc(512, 0)
    a.free(p)
    a.free(r)
    st = a.memory_stats()
    # free: [p: 1 MiB] q [r: 512 KiB] g [rest: 2 MiB - 1 MiB - 4 KiB - 512 KiB - 512]
    rest = 2 * MiB - MiB - 4096 - 512 * 1024 - 512
    assert st["cached_free_bytes"] == MiB + 512 * 1024 + rest
    assert st["largest_cached_free_block"] == MiB
    assert st["fragmentation"] == pytest.approx(1 - MiB / (MiB + 512 * 1024 + rest))
    assert st["peak_allocated_bytes"] == MiB + 4096 + 512 * 1024 + 512
    assert st["histogram"] == {512: 1, 4096: 1, 512 * 1024: 1, MiB: 1}
    assert st["active_histogram"] == {512: 1, 4096: 1}
    assert st["num_allocs"] == 4 and st["num_frees"] == 2 and st["num_active_blocks"] == 2
    a.reset_peak_stats()
    assert a.memory_stats()["peak_allocated_bytes"] == 4096 + 512
    a.free(q)
    a.free(g)


def test_oom_error_says_what_was_asked_and_what_is_free(env):
    a = env.allocator()
    keep = a.malloc(4096, 0)
    free, total = env.backend.mem_get_info()
    ask = total * 2
    with pytest.raises(OutOfMemoryError) as ei:
        a.malloc(ask, 0)
    e = ei.value
    assert isinstance(e, MemoryError)
    msg = str(e)
    assert "tried to allocate" in msg and f"({a.round_size(ask)} bytes)" in msg
    assert "free on device" in msg and "of total" in msg and f"({total} bytes)" in msg
    assert "reserved by allocator 2.00 MiB (2097152 bytes)" in msg
    assert "largest cached free block" in msg
    assert e.requested == a.round_size(ask) and e.device_total == total and e.reserved == 2 * MiB
    assert e.largest_free_block == 2 * MiB - 4096
    assert a.memory_stats()["num_ooms"] == 1
    a.free(keep)


def test_free_of_unknown_pointer_is_refused(env):
    a = env.allocator()
    p = a.malloc(4096, 0)
    a.free(p)
    with pytest.raises(ValueError, match="freed twice"):
        a.free(p)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(12345)
    with pytest.raises(ValueError, match="nbytes"):
        a.malloc(-1, 0)


def test_exact_size_reuse_needs_no_split_and_merge(env):
    a = env.allocator()
    p = a.malloc(3072, 0)
    a.free(p)
    splits = a.memory_stats()["num_splits"]
    for _ in range(5):
        q = a.malloc(3000, 0)
        assert q == p, "an exact-size free block is handed back as it is"
        a.free(q)
    st = a.memory_stats()
    assert st["num_splits"] == splits and st["num_merges"] == 0 and st["num_device_mallocs"] == 1


def test_deferred_merge_happens_before_a_new_segment(env):
    a = env.allocator()
    ps = [a.malloc(512 * 1024, 0) for _ in range(4)]  # fills one 2 MiB small segment
    for p in ps:
        a.free(p)  # four adjacent free blocks, not merged yet
    q = a.malloc(MiB, 0)  # no single free block is big enough: merge first, no cudaMalloc
    st = a.memory_stats()
    assert q == ps[0] and st["num_device_mallocs"] == 1 and st["num_merges"] >= 1
    a.free(q)


def test_listeners_see_every_alloc_and_free(env):
    import bluallocator

    a = env.allocator()
    seen = []

    def fn(event, ptr, size, stream, ts_ns):
        seen.append((event, ptr, size, stream, ts_ns))

    bluallocator.add_listener(fn)
    try:
        p = a.malloc(1000, 0)
        a.free(p)
    finally:
        bluallocator.remove_listener(fn)
    a.free(a.malloc(1000, 0))  # not seen any more
    assert [(e, q, n, s) for e, q, n, s, _ in seen] == [("alloc", p, 1024, 0), ("free", p, 1024, 0)]
    assert seen[0][4] <= seen[1][4]
    bluallocator.remove_listener(fn)  # removing twice is fine


def test_peak_allocated_stays_below_peak_reserved_while_the_cache_holds_freed_blocks(env):
    a = env.allocator()
    p = a.malloc(4 * MiB, 0)  # a 20 MiB large segment
    q = a.malloc(6 * MiB, 0)  # split from it
    a.free(p)
    a.free(q)
    st = a.memory_stats()
    assert (st["allocated_bytes"], st["peak_allocated_bytes"]) == (0, 10 * MiB)
    assert (st["reserved_bytes"], st["peak_reserved_bytes"]) == (20 * MiB, 20 * MiB)  # cached, not given back
    assert st["peak_allocated_bytes"] < st["peak_reserved_bytes"]
    a.reset_peak_stats()
    st = a.memory_stats()
    assert (st["peak_allocated_bytes"], st["peak_reserved_bytes"]) == (0, 20 * MiB)
    r = a.malloc(2 * MiB, 0)  # from the cache: reserved does not move
    st = a.memory_stats()
    assert (st["peak_allocated_bytes"], st["peak_reserved_bytes"]) == (2 * MiB, 20 * MiB)
    a.free(r)
    a.empty_cache()
    st = a.memory_stats()
    assert st["reserved_bytes"] == 0 and st["peak_reserved_bytes"] == 20 * MiB  # a peak outlives empty_cache
