"""Run under mpiexec -n N: every collective of the mpi backend checked against NumPy references.

Writes one JSON line per rank to argv[1]/rank<k>.json with the names of the checks that passed.
"""

import json
import os
import sys

import dtms
import ml_dtypes
import numpy as np
from dtms import CollectiveError


def data(rank: int, n: int, dtype=np.float64) -> np.ndarray:
    rng = np.random.default_rng(1000 + rank)
    return rng.standard_normal(n).astype(dtype)


def main() -> None:
    out_dir = sys.argv[1]
    pg = dtms.init_process_group()
    r, w = dtms.get_rank(), dtms.get_world_size()
    assert pg.backend == "mpi", pg.backend
    passed = []
    every = [data(k, 12) for k in range(w)]

    # all_reduce: sum / avg / max / min on float64, float32, int64
    for op, ref in [("sum", np.sum), ("avg", np.mean), ("max", np.max), ("min", np.min)]:
        x = every[r].copy()
        dtms.all_reduce(x, op=op)
        np.testing.assert_allclose(x, ref(np.stack(every), axis=0), rtol=1e-12, atol=1e-12)
        passed.append(f"all_reduce_{op}")
    xf = every[r].astype(np.float32)
    dtms.all_reduce(xf, op="avg")
    np.testing.assert_allclose(xf, np.mean(np.stack(every), 0), rtol=1e-5, atol=1e-6)
    xi = np.arange(6, dtype=np.int64) * (r + 1)
    dtms.all_reduce(xi)
    assert (xi == np.arange(6) * sum(range(1, w + 1))).all()
    passed.append("all_reduce_dtypes")
    # bfloat16 (no MPI type): staged through float32
    xb = np.full(5, r + 1, dtype=ml_dtypes.bfloat16)
    dtms.all_reduce(xb, op="sum")
    assert xb.dtype == ml_dtypes.bfloat16 and (xb.astype(np.float32) == w * (w + 1) / 2).all()
    passed.append("all_reduce_bf16")

    # 2-D array, in place, reduced as a whole
    m = every[r].reshape(3, 4).copy()
    dtms.all_reduce(m)
    np.testing.assert_allclose(m, np.sum(np.stack(every), 0).reshape(3, 4), rtol=1e-12)
    passed.append("all_reduce_2d")

    # reduce_scatter: input = w chunks of 3
    big = [data(k, 3 * w) for k in range(w)]
    o = np.empty(3)
    dtms.reduce_scatter(o, big[r].copy(), op="sum")
    np.testing.assert_allclose(o, np.sum(np.stack(big), 0)[3 * r : 3 * r + 3], rtol=1e-12)
    o2 = np.empty(3)
    dtms.reduce_scatter(o2, big[r].copy(), op="avg")
    np.testing.assert_allclose(o2, np.mean(np.stack(big), 0)[3 * r : 3 * r + 3], rtol=1e-12)
    # output aliasing the input (FSDP-style shard of the flat buffer)
    flat = big[r].copy()
    dtms.reduce_scatter(flat[3 * r : 3 * r + 3], flat, op="sum")
    np.testing.assert_allclose(flat[3 * r : 3 * r + 3], np.sum(np.stack(big), 0)[3 * r : 3 * r + 3], rtol=1e-12)
    passed.append("reduce_scatter")

    # all_gather: concatenation in rank order; also in-place (input is our chunk of output)
    g = np.empty(4 * w, dtype=np.float32)
    dtms.all_gather(g, every[r][:4].astype(np.float32))
    np.testing.assert_array_equal(g, np.concatenate([e[:4] for e in every]).astype(np.float32))
    g2 = np.zeros(2 * w)
    g2[2 * r : 2 * r + 2] = every[r][:2]
    dtms.all_gather(g2, g2[2 * r : 2 * r + 2])
    np.testing.assert_array_equal(g2, np.concatenate([e[:2] for e in every]))
    gb = np.empty(w, dtype=ml_dtypes.bfloat16)
    dtms.all_gather(gb, np.array([r], dtype=ml_dtypes.bfloat16))
    assert (gb.astype(np.float32) == np.arange(w)).all()
    passed.append("all_gather")

    # broadcast from every source
    for src in range(w):
        b = every[r].copy()
        dtms.broadcast(b, src=src)
        np.testing.assert_array_equal(b, every[src])
    passed.append("broadcast")

    # all_to_all: rank r sends chunk j (value 100*r + j) to rank j
    inp = np.repeat(100.0 * r + np.arange(w), 2)
    outp = np.empty_like(inp)
    dtms.all_to_all(outp, inp)
    np.testing.assert_array_equal(outp, np.repeat(100.0 * np.arange(w) + r, 2))
    passed.append("all_to_all")

    # send/recv around a ring, blocking and nonblocking
    nxt, prv = (r + 1) % w, (r - 1) % w
    buf = np.empty(4)
    sw = dtms.isend(every[r][:4].copy(), nxt, tag=7)
    rw = dtms.irecv(buf, prv, tag=7)
    rw.wait()
    sw.wait()
    np.testing.assert_array_equal(buf, every[prv][:4])
    if r == 0:
        dtms.send(np.arange(3.0), 1)
    elif r == 1:
        got = np.empty(3)
        dtms.recv(got, 0)
        np.testing.assert_array_equal(got, np.arange(3.0))
    passed.append("send_recv")

    # async handles: several collectives in flight, completed out of order
    a1, a2 = every[r].copy(), (every[r] * 2).copy()
    w1 = dtms.all_reduce(a1, op="avg", async_op=True)
    w2 = dtms.all_reduce(a2, op="sum", async_op=True)
    assert isinstance(w1, dtms.Work)
    w2.wait()
    w1.wait()
    assert w1.is_completed() and w2.is_completed()
    np.testing.assert_allclose(a1, np.mean(np.stack(every), 0), rtol=1e-12)
    np.testing.assert_allclose(a2, 2 * np.sum(np.stack(every), 0), rtol=1e-12)
    wb = dtms.barrier(async_op=True)
    wb.synchronize()
    passed.append("async")

    # sub-groups: evens and odds; ranks inside are group ranks
    evens = list(range(0, w, 2))
    odds = list(range(1, w, 2))
    ge = dtms.new_group(evens)
    go = dtms.new_group(odds)
    mine, members = (ge, evens) if r % 2 == 0 else (go, odds)
    assert (ge is None) == (r % 2 == 1) and (go is None) == (r % 2 == 0)
    assert mine.size() == len(members) and mine.rank() == members.index(r)
    assert mine.global_ranks == tuple(members)
    s = every[r].copy()
    mine.all_reduce(s)
    np.testing.assert_allclose(s, np.sum(np.stack([every[k] for k in members]), 0), rtol=1e-12)
    bsub = every[r].copy()
    mine.broadcast(bsub, src=len(members) - 1)
    np.testing.assert_array_equal(bsub, every[members[-1]])
    # a nested group of the world's first two ranks, and a reversed order
    top = dtms.new_group([1, 0])
    if r in (0, 1):
        assert top.rank() == (1 - r)
        v = np.array([float(r)])
        top.all_reduce(v, op="max")
        assert v[0] == 1.0
    passed.append("subgroups")

    # mismatch across ranks: shape differs on the last rank -> every rank raises a clear error
    bad = np.zeros(5 if r == w - 1 else 4)
    try:
        dtms.all_reduce(bad)
    except CollectiveError as e:
        assert "shape/dtype mismatch" in str(e) and f"rank {w - 1}" in str(e), str(e)
        passed.append("mismatch_shape")
    dt = np.float32 if r == 0 else np.float64
    try:
        dtms.all_reduce(np.zeros(3, dtype=dt))
    except CollectiveError as e:
        assert "float32" in str(e) and "float64" in str(e), str(e)
        passed.append("mismatch_dtype")
    try:
        dtms.all_reduce(np.zeros(3), op="max" if r == 0 else "sum")
    except CollectiveError as e:
        assert "op mismatch" in str(e), str(e)
        passed.append("mismatch_op")

    # local errors, raised before any communication
    for fn, msg in [
        (lambda: dtms.all_reduce(np.zeros((4, 4))[:, 0]), "not C-contiguous"),
        (lambda: dtms.all_reduce(np.zeros(3, dtype=np.int32), op="avg"), "floating dtype"),
        (lambda: dtms.all_gather(np.zeros(3), np.zeros(2)), "expected group size"),
        (lambda: dtms.broadcast(np.zeros(2), src=w), "not a rank"),
        (lambda: dtms.new_group([0, 0]), "duplicate"),
    ]:
        try:
            fn()
            raise AssertionError(f"no error for {msg}")
        except (CollectiveError, ValueError) as e:
            assert msg in str(e), (msg, str(e))
    passed.append("local_errors")

    dtms.barrier()
    with open(os.path.join(out_dir, f"rank{r}.json"), "w") as f:
        json.dump({"rank": r, "world": w, "passed": passed}, f)
    dtms.destroy_process_group()


if __name__ == "__main__":
    main()
