"""Shared test helpers: a tiny GPT-2 training step, eager and compiled."""

from __future__ import annotations

import blutensor as bt
import numpy as np


def tiny_cfg(**kw):
    from blumodels.config import ModelConfig

    base = dict(n_layer=2, n_head=2, d_model=32, block_size=16, vocab_size=100)
    base.update(kw)
    return ModelConfig(**base)


def make_model(cfg, seed=0, device=None, lr=1e-3):
    from blumodels.gpt2 import GPT2

    bt.manual_seed(seed)
    m = GPT2(cfg, device=device)
    opt = bt.optim.AdamW(m.param_groups(0.1), lr=lr, weight_decay=0.1)
    return m, opt


def train_step(model, opt):
    def step(x, y):
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        return loss

    return step


def batch(rng, B=2, T=16, V=100, device=None):
    x = bt.tensor(rng.integers(0, V, (B, T)), dtype=bt.int64, device=device)
    y = bt.tensor(rng.integers(0, V, (B, T)), dtype=bt.int64, device=device)
    return x, y


def maxdiff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))
