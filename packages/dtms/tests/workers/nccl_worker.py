"""Run by test_nccl.py through blurun on >= 2 GPUs: NCCL collectives vs NumPy, store bootstrap, sub-groups.

argv: OUT_DIR. Writes OUT_DIR/nccl_rank<k>.json with the names of passed checks.
"""

import json
import os
import sys

import cupy as cp
import dtms
import numpy as np


def main() -> None:
    out = sys.argv[1]
    pg = dtms.init_process_group("nccl")
    r, w = dtms.get_rank(), dtms.get_world_size()
    assert pg.backend == "nccl" and os.environ.get("CUDA_VISIBLE_DEVICES") is not None
    every = [np.random.default_rng(k).standard_normal(1 << 16).astype(np.float32) for k in range(w)]
    passed = []
    for op, ref in [("sum", np.sum), ("avg", np.mean), ("max", np.max), ("min", np.min)]:
        x = cp.asarray(every[r])
        dtms.all_reduce(x, op=op)
        np.testing.assert_allclose(cp.asnumpy(x), ref(np.stack(every), 0), rtol=1e-5, atol=1e-5)
        passed.append(f"all_reduce_{op}")
    n = every[0].size // w
    o = cp.empty(n, cp.float32)
    dtms.reduce_scatter(o, cp.asarray(every[r]), op="sum")
    np.testing.assert_allclose(cp.asnumpy(o), np.sum(np.stack(every), 0)[r * n:(r + 1) * n], rtol=1e-5, atol=1e-5)
    passed.append("reduce_scatter")
    g = cp.empty(w * 8, cp.float32)
    dtms.all_gather(g, cp.asarray(every[r][:8]))
    np.testing.assert_array_equal(cp.asnumpy(g), np.concatenate([e[:8] for e in every]))
    passed.append("all_gather")
    b = cp.asarray(every[r])
    dtms.broadcast(b, src=w - 1)
    np.testing.assert_array_equal(cp.asnumpy(b), every[w - 1])
    passed.append("broadcast")
    inp = cp.asarray(np.repeat(100.0 * r + np.arange(w), 3).astype(np.float32))
    o2 = cp.empty_like(inp)
    dtms.all_to_all(o2, inp)
    np.testing.assert_array_equal(cp.asnumpy(o2), np.repeat(100.0 * np.arange(w) + r, 3).astype(np.float32))
    passed.append("all_to_all")
    buf = cp.empty(4, cp.float32)
    sw = dtms.isend(cp.asarray(every[r][:4]), (r + 1) % w)
    rw = dtms.irecv(buf, (r - 1) % w)
    sw.wait()
    rw.wait()
    np.testing.assert_array_equal(cp.asnumpy(buf), every[(r - 1) % w][:4])
    passed.append("send_recv")
    a = cp.asarray(every[r])
    work = dtms.all_reduce(a, op="avg", async_op=True)
    work.wait()
    c = a * 2  # ordered after the collective on the current stream
    np.testing.assert_allclose(cp.asnumpy(c), 2 * np.mean(np.stack(every), 0), rtol=1e-5, atol=1e-5)
    passed.append("async")
    sub = dtms.new_group([0, 1])
    if r in (0, 1):
        v = cp.asarray([float(r)], dtype=cp.float32)
        sub.all_reduce(v)
        assert float(v[0]) == 1.0
    passed.append("subgroup")
    dtms.barrier()
    with open(os.path.join(out, f"nccl_rank{r}.json"), "w") as f:
        json.dump({"rank": r, "world": w, "passed": passed}, f)
    dtms.destroy_process_group()


if __name__ == "__main__":
    main()
