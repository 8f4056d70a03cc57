"""Run by test_comm.py under mpiexec: DDP (or FSDP) steps of a small model profiled on every rank.

argv: mode (ddp|fsdp) out_dir. Each rank writes out_dir/rank<r>/{trace.json,summary.json,events.jsonl}.
"""

import sys
from pathlib import Path

import bluprofiler as bp
import blutensor as bt
import dtms
import numpy as np
from blutensor import nn
from blutensor.nn import functional as F
from dtms.parallel import DDP, FSDP

V, D, T = 64, 48, 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([nn.Linear(D, D) for _ in range(4)])
        self.head = nn.Linear(D, V)

    def forward(self, idx, tgt):
        h = self.emb(idx)
        for b in self.blocks:
            h = h + F.gelu(b(h), approximate="tanh")
        return F.cross_entropy(self.head(h).reshape(-1, V), tgt.reshape(-1))


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    dtms.init_process_group("mpi")
    rank = dtms.get_rank()
    bt.manual_seed(0)
    model = Net()
    # small buckets: the first buckets' all-reduces go out while the backward of earlier layers still runs
    wrapped = DDP(model, bucket_cap_mb=0.005) if mode == "ddp" else FSDP(model)
    opt = bt.optim.SGD(wrapped.parameters() if mode == "fsdp" else model.parameters(), lr=0.1)
    rng = np.random.default_rng(rank)

    def step() -> float:
        x = rng.integers(0, V, (4, T))
        loss = wrapped(bt.tensor(x), bt.tensor(np.roll(x, -1, axis=1)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss.item())

    bp.profile_steps(step, 2, out / f"rank{rank}", warmup=1, plot=False)
    dtms.destroy_process_group()


if __name__ == "__main__":
    main()
