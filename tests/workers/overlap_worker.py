"""Run by tests/test_parallel_overlap.py under mpiexec: one strategy with dtms' comm TIMELINE recording; writes
the events (and the strategy's own checks) of rank 0 to a JSON file.

argv: mode out.json; mode: cp | cp_memory | fsdp | fsdp_memory | tp | ddp
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


def gpt2(vocab=61, n_layer=4, T=16, d=32):
    from blumodels.config import ModelConfig
    from blumodels.gpt2 import build_model

    m = build_model(ModelConfig(n_layer=n_layer, n_head=4, d_model=d, block_size=T, vocab_size=vocab,
                                vocab_multiple=64), seed=1)
    return m.to(bt.float64)


def batch(step, B, T, vocab):
    rng = np.random.default_rng(step)
    x = rng.integers(0, vocab, (B, T + 1))
    return bt.tensor(x[:, :-1]), bt.tensor(x[:, 1:])


def fsdp_steps(steps, vocab=61, keep_root=False, probe=None, d=32):
    """FSDP on the world (GPT-2 plan), ``steps`` AdamW steps; ``probe(phase)`` runs inside every attention."""
    from blumodels.gpt2_parallelize import gpt2_plan
    from blutensor import ext
    from dtms.parallel import ParallelDims, parallelize

    model = gpt2(vocab, d=d)
    par = parallelize(model, ParallelDims(dp=dtms.get_world_size()), fsdp=True, plan=gpt2_plan(model))
    opt = bt.optim.AdamW(par.model.parameters(), lr=1e-3)
    phase = {"now": "fwd"}
    held = []

    def observer(op, inputs, attrs, run):
        if op == "sdpa" and probe is not None:
            probe(phase["now"])
        return run()

    ext.add_op_observer(observer)
    between = []
    try:
        for s in range(steps):
            if keep_root:  # negative control: root parameters gathered for the whole step (as a full copy kept)
                held[:] = [np.array(a) for n, a in par.model.full_parameters().items() if not n.startswith("blocks")]
            phase["now"] = "fwd"
            TIMELINE.mark("step_begin", step=s)
            x, y = batch(s, 2, 16, vocab)
            _, loss = par.model(x, y)
            phase["now"] = "bwd"
            loss.backward()
            held.clear()
            opt.step()
            opt.zero_grad()
            between.append(tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else 0)
    finally:
        ext.remove_op_observer(observer)
        par.close()
    root_bytes = sum(p.numel() * 8 for n, p in model.named_parameters() if not n.startswith("blocks"))
    return between, root_bytes


def fsdp_memory(keep_root):
    mid = {"fwd": [], "bwd": []}
    tracemalloc.start()
    between, root = fsdp_steps(3, vocab=4096, keep_root=keep_root, d=64,
                               probe=lambda ph: mid[ph].append(tracemalloc.get_traced_memory()[0]))
    tracemalloc.stop()
    n = len(mid["fwd"]) // 3  # attention calls per step and phase
    return {"between": between[1], "fwd": max(mid["fwd"][2 * n:]), "bwd": max(mid["bwd"][2 * n:]), "root": root}


def ddp_steps(steps):
    from dtms.parallel import DDP

    model = gpt2(n_layer=4)
    m = DDP(model, bucket_cap_mb=0.02)  # several buckets
    ev_steps = []
    for s in range(steps):
        x, y = batch(s + 10 * dtms.get_rank(), 2, 16, 61)
        _, loss = m(x, y)
        with TIMELINE.recording() as ev:
            TIMELINE.mark("backward_begin")
            loss.backward()
            TIMELINE.mark("backward_end")
        ev_steps.append(events_json(ev))
    return ev_steps, len(m.buckets)


def tp_step(chunks=4):
    from blumodels.gpt2_parallelize import gpt2_plan
    from dtms.parallel import ParallelDims, parallelize

    model = gpt2(n_layer=2)
    par = parallelize(model, ParallelDims(tp=dtms.get_world_size()), plan=gpt2_plan(model), async_tp_chunks=chunks)
    x, y = batch(0, 2, 16, 61)
    with TIMELINE.recording() as ev:
        _, loss = par.model(x, y)
        loss.backward()
    par.close()
    return events_json(ev)


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
    elif mode == "fsdp":
        with TIMELINE.recording() as ev:
            fsdp_steps(2)
        res["events"] = events_json(ev)
    elif mode == "fsdp_memory":
        res["sharded"] = fsdp_memory(False)
        res["kept"] = fsdp_memory(True)
    elif mode == "tp":
        res["events"] = tp_step()
    elif mode == "ddp":
        res["steps"], res["buckets"] = ddp_steps(3)
    if dtms.get_rank() == 0:
        json.dump(res, open(out, "w"))
    dtms.destroy_process_group()


if __name__ == "__main__":
    main()
