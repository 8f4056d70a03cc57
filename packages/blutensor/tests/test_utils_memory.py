"""Activation checkpointing and the optimizer step fused into backward equal plain training exactly."""

import blutensor as bt
import numpy as np
from blutensor import nn
from blutensor.nn import functional as F
from blutensor.utils import OptimizerInBackward, checkpoint


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d, dtype="float64")
        self.fc = nn.Linear(d, 4 * d, dtype="float64")
        self.proj = nn.Linear(4 * d, d, dtype="float64")

    def forward(self, x):
        return x + F.dropout(self.proj(F.gelu(self.fc(self.ln(x)), "tanh")), 0.2, self.training)


class Net(nn.Module):
    def __init__(self, ckpt):
        super().__init__()
        self.ckpt = ckpt
        self.blocks = nn.ModuleList([Block(8) for _ in range(3)])
        self.head = nn.Linear(8, 5, dtype="float64")

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x) if self.ckpt else b(x)
        return self.head(x)


def train(ckpt, oib, steps=4):
    bt.manual_seed(0)
    net = Net(ckpt)
    opt = bt.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    if oib:
        opt = OptimizerInBackward(opt)
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(steps):
        x = bt.tensor(rng.standard_normal((6, 8)))
        t = bt.tensor(rng.integers(0, 5, 6))
        loss = F.cross_entropy(net(x), t)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.numpy().copy() for p in net.parameters()], opt


def test_checkpoint_is_bit_exact_with_dropout():
    a, b = train(False, False), train(True, False)
    assert a[0] == b[0]
    assert all((p == q).all() for p, q in zip(a[1], b[1]))


def test_optimizer_in_backward_is_bit_exact_and_frees_grads():
    a, c = train(False, False), train(False, True)
    assert a[0] == c[0]
    assert all((p == q).all() for p, q in zip(a[1], c[1]))
    opt = c[2]
    assert opt.updates == 4 * len(opt._groups)
    assert all(p.grad is None for g in opt.param_groups for p in g["params"])


def test_both_together():
    a, d = train(False, False), train(True, True)
    assert a[0] == d[0]


def test_checkpoint_keeps_no_activations():
    bt.manual_seed(0)
    blk = Block(8)
    x = bt.randn(4, 8, dtype="float64", requires_grad=True)
    y = checkpoint(blk, x)
    # the recorded graph holds one node for the whole block, whose inputs are the params and x
    assert y.grad_fn.op == "_Checkpoint"
    assert len([n for n in y.grad_fn.next if n is not None]) == len(list(blk.parameters())) + 1
    y.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in blk.parameters())
