"""Run by tests/test_parallel_overlap.py under mpiexec: one strategy with dtms' comm TIMELINE recording; writes
the events (and the strategy's own checks) of rank 0 to a JSON file.

argv: mode out.json; mode: cp | cp_memory | fsdp | tp | ddp
"""

import json
import sys
import tracemalloc

import blutensor as bt
import dtms
import numpy as np
from dtms.parallel.comm_ops import TIMELINE


def events_json(ev):
    t0 = ev[0][0] if ev else 0.0
    return [[t - t0, name, info] for t, name, info in ev]


def reference_attention(q, k, v, do):
    s = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = p @ v
    dp = do @ v.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.sqrt(q.shape[-1])
    return o, ds @ k, ds.swapaxes(-1, -2) @ q, p.swapaxes(-1, -2) @ do


def ring(T, E=16, H=2, check=True):
    from dtms.parallel.context_parallel import ContextParallel, RingAttention, local_positions

    g = dtms.get_default_group()
    cp = ContextParallel(g, "p2p")
    rng = np.random.default_rng(3)
    full = [rng.standard_normal((1, H, T, E)) for _ in range(4)]  # q, k, v, do: the same on every rank
    pos = local_positions(T, g.rank(), g.size())
    q, k, v, do = (np.ascontiguousarray(a[:, :, pos]) for a in full)
    ts = [bt.tensor(a, requires_grad=True) for a in (q, k, v)]
    out = RingAttention.apply(*ts, cp)
    out.backward(bt.tensor(do))
    err = 0.0
    if check:
        ref = reference_attention(*full)
        got = [out.numpy()] + [t.grad.numpy() for t in ts]
        err = max(float(np.abs(a - r[:, :, pos]).max()) for a, r in zip(got, ref))
    return err


def main():
    mode, out = sys.argv[1], sys.argv[2]
    dtms.init_process_group("mpi")
    res = {}
    if mode == "cp":
        with TIMELINE.recording() as ev:
            res["err"] = ring(256)
        res["events"] = events_json(ev)
    elif mode == "cp_memory":
        ring(64, check=False)  # warm-up: imports and first-call caches outside the measurement
        peaks = {}
        for T_local in (2048, 4096):
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            ring(T_local * dtms.get_world_size(), E=32, H=1, check=False)
            peaks[T_local] = tracemalloc.get_traced_memory()[1] - base
            tracemalloc.stop()
        res["peaks"] = peaks
    if dtms.get_rank() == 0:
        json.dump(res, open(out, "w"))
    dtms.destroy_process_group()


if __name__ == "__main__":
    main()
