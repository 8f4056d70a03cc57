"""One strategy on W MPI ranks vs single-process GPT-2: forward loss, gradients and 10-step losses.

argv: strategy dtype dp cp tp out.json [rotator] [async_chunks]
strategy: ddp | fsdp | hsdp (fsdp over dp/2 ranks, 2 replicas) | tp | cp
"""

import json
import sys

import blutensor as bt
import dtms
import numpy as np
from blumodels.config import ModelConfig
from blumodels.gpt2 import build_model
from blumodels.gpt2_parallelize import gpt2_plan
from dtms.parallel import ParallelDims, parallelize
from dtms.parallel.comm_ops import STATS
from dtms.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, _shard_rows

CFG = dict(n_layer=2, n_head=4, d_model=32, block_size=16, vocab_size=61, vocab_multiple=64, dropout=0.0)
T, STEPS = 16, 10
CLIP = 0.5  # small enough that clipping really scales the gradients


def batch(step, n):
    rng = np.random.default_rng(7 + step)
    x = rng.integers(0, 61, (n, T + 1))
    return x[:, :-1], x[:, 1:]


def to_dtype(model, dtype):
    if dtype == "float64":
        model.to(bt.float64)
    return model


def reference(dtype, B):
    model = to_dtype(build_model(ModelConfig(**CFG), seed=1), dtype)
    opt = bt.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    losses, grads0, norms = [], None, []
    for s in range(STEPS):
        x, y = batch(s, B)
        _, loss = model(bt.tensor(x), bt.tensor(y))
        loss.backward()
        if s == 0:
            grads0 = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
        losses.append(loss.item())
        norms.append(float(bt.optim.clip_grad_norm_(model.parameters(), CLIP).item()))
        opt.step()
        opt.zero_grad()
    return losses, grads0, norms


def main():
    strategy, dtype = sys.argv[1], sys.argv[2]
    replicas = 2 if strategy == "hsdp" else 1
    strategy = "fsdp" if strategy == "hsdp" else strategy
    dp, cp, tp = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    out = sys.argv[6]
    rotator = sys.argv[7] if len(sys.argv) > 7 else "p2p"
    chunks = int(sys.argv[8]) if len(sys.argv) > 8 else 1
    dtms.init_process_group("mpi")
    rank = dtms.get_rank()
    b = 2  # per-dp-rank batch
    # the reference runs first: context parallelism intercepts every causal attention in the process
    ref_losses, ref_grads, ref_norms = reference(dtype, dp * b)
    model = to_dtype(build_model(ModelConfig(**CFG), seed=1 + rank), dtype)  # parallelize must broadcast
    names = {id(p): n for n, p in model.named_parameters()}
    par = parallelize(model, ParallelDims(dp=dp, cp=cp, tp=tp), fsdp=(strategy == "fsdp"),
                      async_tp_chunks=chunks, cp_rotator=rotator, seq_len=T, plan=gpt2_plan(model),
                      dp_replicate=replicas)
    m = par.model
    opt = bt.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    losses, grad_err, norms = [], 0.0, []
    for s in range(STEPS):
        x, y = (par.local_batch(a) for a in batch(s, dp * b))
        _, loss = m(bt.tensor(x), bt.tensor(y))
        loss.backward()
        if s == 0:
            grad_err = compare_grads(strategy, par, model, names, ref_grads)
        losses.append(par.global_loss(loss.item()))
        norms.append(par.clip_grad_norm_(CLIP))  # the global norm of the unsharded model, then clipped
        opt.step()
        opt.zero_grad()
    res = {"losses": losses, "ref_losses": ref_losses, "norms": norms, "ref_norms": ref_norms, "grad_err": grad_err,
           "stats": STATS.counts,
           "state_bytes": m.state_bytes() if strategy == "fsdp" else None,
           "full_bytes": sum(int(np.prod(g.shape)) for g in ref_grads.values()) * (8 if dtype == "float64" else 4)}
    errs = dtms.get_default_group()
    all_res = [None] * errs.size()
    if rank == 0:
        all_res[0] = res
    # gather every rank's grad error to rank 0 through a small all-reduce (max)
    buf = np.array([grad_err], dtype=np.float64)
    errs.all_reduce(buf, op="max")
    res["grad_err_max"] = float(buf[0])
    if rank == 0:
        json.dump(res, open(out, "w"))
    par.close()
    dtms.destroy_process_group()


def compare_grads(strategy, par, model, names, ref):
    """Max |grad - reference| over this rank's view of every gradient."""
    err = 0.0
    if strategy == "fsdp":
        for flat in par.model.flats():
            full = np.zeros(flat.padded)
            off = 0
            for p, n in zip(flat.params, flat.numels):
                full[off:off + n] = ref[_name(model, p)].reshape(-1)
                off += n
            r = flat.group.rank()
            mine = full[r * flat.shard_size:(r + 1) * flat.shard_size]
            err = max(err, float(np.abs(flat.shard.grad.numpy() - mine).max()))
        return err
    tp_n, tp_r = par.mesh.dims.tp, par.mesh.tp_i
    for mname, mod in model.named_modules():
        for pn, p in mod._parameters.items():
            if p is None or p.grad is None:
                continue
            full_name = f"{mname}.{pn}" if mname else pn
            r = ref[full_name]
            if isinstance(mod, ColumnParallelLinear):
                chunks = 3 if mname.endswith("c_attn") else 1
                r = _shard_rows(r, tp_r, tp_n, chunks)
            elif isinstance(mod, RowParallelLinear) and pn == "weight":
                r = np.split(r, tp_n, axis=1)[tp_r]
            elif full_name == "wte.weight" and tp_n > 1:
                r = np.split(r, tp_n, axis=0)[tp_r]
            err = max(err, float(np.abs(p.grad.numpy() - r).max()))
    return err


def _name(model, p):
    for n, q in _all_named(model):
        if q is p:
            return n
    raise KeyError("parameter not found")


def _all_named(model):
    from dtms.parallel.fsdp import _named_leaf_params

    return list(_named_leaf_params(model))


if __name__ == "__main__":
    main()
