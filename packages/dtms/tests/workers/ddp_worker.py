"""DDP worker: W ranks with per-rank batch b must equal one process with batch W*b.

argv: dtype steps accum bucket_mb out.json
"""

import json
import sys

import blutensor as bt
import dtms
import numpy as np
from blutensor import nn
from blutensor.nn import functional as F
from dtms.parallel import DDP

V, D, T = 37, 16, 6


class Tiny(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.emb = nn.Embedding(V, D, dtype=dtype)
        self.ln = nn.LayerNorm(D, dtype=dtype)
        self.fc = nn.Linear(D, 4 * D, dtype=dtype)
        self.proj = nn.Linear(4 * D, D, dtype=dtype)

    def forward(self, idx, tgt):
        h = self.emb(idx)
        h = h + self.proj(F.gelu(self.fc(self.ln(h)), approximate="tanh"))
        logits = F.linear(h, self.emb.weight)  # tied: one parameter used twice
        return F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1))  # PyTorch layout: classes in dim 1


def batch(step, n):
    rng = np.random.default_rng(1000 + step)
    x = rng.integers(0, V, (n, T))
    return x, np.roll(x, -1, axis=1)


def main():
    dtype, steps, accum, bucket_mb, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), \
        sys.argv[5]
    dtms.init_process_group("mpi")
    rank, W = dtms.get_rank(), dtms.get_world_size()
    b = 4 * accum
    bt.manual_seed(100 + rank)  # different init per rank: DDP's broadcast must fix it
    model = Tiny(dtype)
    ddp = DDP(model, bucket_cap_mb=bucket_mb)
    opt = bt.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, comm_during_accum, launch_orders = [], [], []
    for s in range(steps):
        x, y = batch(s, W * b)
        x, y = x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
        mb = b // accum
        total = 0.0
        for m in range(accum):
            xi, yi = bt.tensor(x[m * mb:(m + 1) * mb]), bt.tensor(y[m * mb:(m + 1) * mb])
            before = ddp.stats.allreduces
            if m < accum - 1:
                with ddp.no_sync():
                    loss = ddp(xi, yi) / accum
                    loss.backward()
                comm_during_accum.append(ddp.stats.allreduces - before)
            else:
                n0 = len(ddp.stats.launch_order)
                loss = ddp(xi, yi) / accum
                loss.backward()
                launch_orders.append(ddp.stats.launch_order[n0:])
            total += loss.item()
        g = np.array([total], dtype=np.float64)
        dtms.all_reduce(g, op="avg")
        losses.append(float(g[0]))
        bt.optim.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    if rank == 0:
        bt.manual_seed(100)
        ref = Tiny(dtype)
        ropt = bt.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        ref_losses = []
        for s in range(steps):
            x, y = batch(s, W * b)
            loss = ref(bt.tensor(x), bt.tensor(y))
            loss.backward()
            ref_losses.append(loss.item())
            bt.optim.clip_grad_norm_(ref.parameters(), 1.0)
            ropt.step()
            ropt.zero_grad()
        wdiff = max(float(np.abs(p.numpy().astype(np.float64) - q.numpy()).max())
                    for p, q in zip(model.parameters(), ref.parameters()))
        json.dump({"losses": losses, "ref_losses": ref_losses, "wdiff": wdiff, "world": W,
                   "comm_during_accum": comm_during_accum, "launch_orders": launch_orders,
                   "n_buckets": len(ddp.buckets), "broadcasts": ddp.stats.broadcasts}, open(out, "w"))
    dtms.destroy_process_group()


if __name__ == "__main__":
    main()
