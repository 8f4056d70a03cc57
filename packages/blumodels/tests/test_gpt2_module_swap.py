"""A module that replaces GPT-2's MLP projection (tensor parallelism, a plugin) is called, never bypassed by the
fused GELU + c_proj path (it once was: TP's row-parallel all-reduce was skipped in fp32)."""

from __future__ import annotations

import blutensor as bt
import numpy as np
from blumodels.config import ModelConfig
from blumodels.gpt2 import build_model
from blutensor import nn


class CountingProj(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.weight, self.bias = inner.weight, inner.bias
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x) * 2.0  # visibly different from the plain projection


def test_replaced_c_proj_is_called_in_fp32():
    cfg = ModelConfig(n_layer=1, n_head=2, d_model=32, block_size=8, vocab_size=64)
    m = build_model(cfg, seed=0)
    idx = bt.tensor(np.random.default_rng(0).integers(0, 64, (2, 8)))
    _, base = m(idx, idx)
    proj = CountingProj(m.blocks[0].mlp.c_proj)
    m.blocks[0].mlp.c_proj = proj
    _, swapped = m(idx, idx)
    assert proj.calls == 1
    assert abs(float(swapped.item()) - float(base.item())) > 1e-6
