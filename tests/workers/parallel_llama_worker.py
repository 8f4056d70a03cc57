"""One strategy on W MPI ranks vs the single-process Llama: per-step losses and global gradient norms.

argv: strategy dtype dp tp tie out.json    strategy: ddp | fsdp | tp
"""

import json
import sys

import blutensor as bt
import dtms
import numpy as np
from blumodels.config import ModelConfig
from blumodels.llama.model import build_model
from blumodels.llama.parallelize import parallelize_llama
from dtms.parallel import ParallelDims

T, STEPS, CLIP = 16, 6, 0.5


def cfg(tie):
    return ModelConfig(family="llama", n_layer=2, n_head=4, n_kv_heads=2, d_model=32, block_size=16, vocab_size=61,
                       bias=False, ffn_hidden=48, tie_embeddings=tie)


def batch(step, n):
    x = np.random.default_rng(7 + step).integers(0, 61, (n, T + 1))
    return x[:, :-1], x[:, 1:]


def reference(dtype, B, tie):
    model = build_model(cfg(tie), seed=1).to(getattr(bt, dtype))
    opt = bt.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses, norms = [], []
    for s in range(STEPS):
        x, y = batch(s, B)
        _, loss = model(bt.tensor(x), bt.tensor(y))
        loss.backward()
        losses.append(loss.item())
        norms.append(float(bt.optim.clip_grad_norm_(model.parameters(), CLIP).item()))
        opt.step()
        opt.zero_grad()
    return losses, norms


def main():
    strategy, dtype, dp, tp, tie, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
        sys.argv[5] == "1", sys.argv[6]
    dtms.init_process_group("mpi")
    rank = dtms.get_rank()
    b = 2
    ref_losses, ref_norms = reference(dtype, dp * b, tie)
    model = build_model(cfg(tie), seed=1 + rank).to(getattr(bt, dtype))  # parallelize broadcasts rank 0's weights
    par = parallelize_llama(model, ParallelDims(dp=dp, cp=1, tp=tp), fsdp=(strategy == "fsdp"), seq_len=T)
    m = par.model
    opt = bt.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)
    losses, norms = [], []
    for s in range(STEPS):
        x, y = (par.local_batch(a) for a in batch(s, dp * b))
        _, loss = m(bt.tensor(x), bt.tensor(y))
        loss.backward()
        losses.append(par.global_loss(loss.item()))
        norms.append(par.clip_grad_norm_(CLIP))
        opt.step()
        opt.zero_grad()
    heads = [(a.n_head, a.n_kv_heads) for a in (getattr(blk, "module", blk).self_attn for blk in model.layers)]
    if rank == 0:
        json.dump({"losses": losses, "ref_losses": ref_losses, "norms": norms, "ref_norms": ref_norms,
                   "heads": heads}, open(out, "w"))
    par.close()
    dtms.destroy_process_group()


if __name__ == "__main__":
    main()
