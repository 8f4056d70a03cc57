"""The NCCL backend's code on CPU, against the fake CUDA device's CuPy/NCCL (testing/fake_cuda/) with thread
ranks: pointers, counts, dtypes, all-to-all offsets, p2p groups, sub-groups and the store bootstrap."""

import threading

import fake_cuda
import numpy as np
import pytest
from dtms.process_group import CollectiveError
from dtms.store import TCPStore


@pytest.fixture
def fake_cupy(monkeypatch):
    return fake_cuda.install(monkeypatch)


def run_ranks(world, fn):
    """Run fn(rank, pg) on ``world`` thread ranks sharing a store; re-raise the first failure."""
    from dtms.backends.nccl import NCCLProcessGroup, StoreBootstrap

    store = TCPStore("127.0.0.1", 0, is_server=True, secret="t", timeout=20)
    errors, results = [], {}

    def body(r):
        try:
            client = TCPStore("127.0.0.1", store.port, secret="t", timeout=20)
            pg = NCCLProcessGroup(r, world, StoreBootstrap(client, "dtms/test/world", 20.0), device=0)
            results[r] = fn(r, pg)
        except BaseException as e:  # noqa: BLE001
            errors.append((r, e))

    ts = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    store.close()
    if errors:
        raise errors[0][1]
    return results


@pytest.mark.parametrize("world", [1, 2, 4])
def test_nccl_backend_collectives_on_fake_nccl(fake_cupy, world):
    cp = fake_cupy
    every = [np.random.default_rng(k).standard_normal(8 * world).astype(np.float32) for k in range(world)]
    stack = np.stack(every)

    def fn(r, pg):
        for op, ref in [("sum", stack.sum(0)), ("avg", stack.mean(0)), ("max", stack.max(0)),
                        ("min", stack.min(0))]:
            x = cp.asarray(every[r])
            pg.all_reduce(x, op=op)
            np.testing.assert_allclose(cp.asnumpy(x), ref, rtol=1e-6, atol=1e-6)
        pg._avg_native = False  # the pre-2.10 path: sum then scale on the stream
        x = cp.asarray(every[r])
        pg.all_reduce(x, op="avg")
        np.testing.assert_allclose(cp.asnumpy(x), stack.mean(0), rtol=1e-6, atol=1e-6)
        pg._avg_native = True
        o = cp.empty(8, np.float32)
        pg.reduce_scatter(o, cp.asarray(every[r]), op="sum")
        np.testing.assert_allclose(cp.asnumpy(o), stack.sum(0)[8 * r:8 * r + 8], rtol=1e-6)
        g = cp.empty(3 * world, np.float32)
        pg.all_gather(g, cp.asarray(every[r][:3]))
        np.testing.assert_array_equal(cp.asnumpy(g), np.concatenate([e[:3] for e in every]))
        g16 = cp.empty(2 * world, np.int16)  # no NCCL int16: moved as bytes
        pg.all_gather(g16, cp.asarray(np.array([r, -r], np.int16)))
        np.testing.assert_array_equal(cp.asnumpy(g16), np.array([[k, -k] for k in range(world)]).ravel())
        b = cp.asarray(every[r])
        pg.broadcast(b, src=world - 1)
        np.testing.assert_array_equal(cp.asnumpy(b), every[world - 1])
        inp = cp.asarray(np.repeat(100.0 * r + np.arange(world), 2).astype(np.float64))
        out = cp.empty(2 * world, np.float64)
        pg.all_to_all(out, inp)
        np.testing.assert_array_equal(cp.asnumpy(out), np.repeat(100.0 * np.arange(world) + r, 2))
        if world > 1:
            buf = cp.empty(4, np.float32)
            w1 = pg.isend(cp.asarray(every[r][:4]), (r + 1) % world)
            w2 = pg.irecv(buf, (r - 1) % world)
            assert len(pg._p2p_queue) == 2  # queued: launched together as one NCCL group
            w1.wait()
            assert not pg._p2p_queue and w1.work is w2.work
            w2.wait()
            np.testing.assert_array_equal(cp.asnumpy(buf), every[(r - 1) % world][:4])
            w3 = pg.isend(cp.asarray(every[r][:4]), (r + 1) % world)
            w4 = pg.irecv(buf, (r - 1) % world)
            pg.start_p2p()  # a ring launches its exchange before computing, without waiting
            assert not pg._p2p_queue and w3.work is w4.work and w3.work is not None
            w4.wait()
        x = cp.asarray(every[r])
        work = pg.all_reduce(x, op="sum", async_op=True)
        assert work.event.recorded_on is pg.stream  # completion recorded on the communication stream
        work.wait()
        assert work.event.waited and work.is_completed()
        sub = pg.new_group(list(range(world - 1, -1, -1)))  # reversed order: group rank = world-1-r
        assert sub.rank() == world - 1 - r and sub.global_ranks == tuple(range(world - 1, -1, -1))
        v = cp.asarray(np.array([float(r)], np.float32))
        sub.broadcast(v, src=0)  # group rank 0 is global rank world-1
        assert float(cp.asnumpy(v)[0]) == world - 1
        pg.barrier()
        return True

    assert all(run_ranks(world, fn).values())


def test_nccl_cross_rank_check_on_fake_nccl(fake_cupy):
    cp = fake_cupy

    def fn(r, pg):
        pg.check = True  # BLUTRAIN_DTMS_CHECK=1
        with pytest.raises(CollectiveError, match=r"rank 0 passed shape \(4,\) float32 but rank 1 passed "
                                                  r"shape \(5,\) float32"):
            pg.all_reduce(cp.asarray(np.zeros(4 if r == 0 else 5, np.float32)))
        with pytest.raises(CollectiveError, match="nccl backend works on CuPy"):
            pg.all_reduce(np.zeros(3, np.float32))
        return True

    run_ranks(2, fn)


def test_nccl_collective_observer_gets_timing_events_on_the_comm_stream(fake_cupy):
    import dtms

    cp = fake_cupy
    seen = []
    lock = threading.Lock()

    def obs(phase, rec):
        with lock:
            seen.append((phase, rec))

    def fn(r, pg):
        x = cp.asarray(np.full(6, r + 1.0, np.float32))
        w = pg.all_reduce(x, async_op=True)
        w.wait()
        np.testing.assert_allclose(cp.asnumpy(x), np.full(6, 3.0))
        return pg.stream

    dtms.add_collective_observer(obs)
    try:
        streams = run_ranks(2, fn)
    finally:
        dtms.remove_collective_observer(obs)
    ends = [rec for ph, rec in seen if ph == "end" and rec.op == "all_reduce"]
    assert len(ends) == 2 and {rec.rank for rec in ends} == {0, 1}
    for rec in ends:
        s = streams[rec.rank]
        assert rec.backend == "nccl" and rec.nbytes == 24 and rec.stream == s.ptr
        t0, t1 = rec.device_events
        assert t0.recorded_on is s and t1.recorded_on is s  # both on the communication stream
        assert rec.start_ns <= rec.issued_ns <= rec.wait_ns <= rec.end_ns
    assert not dtms.process_group._COLLECTIVE_OBSERVERS
