"""The training step's gradients accumulate in the kernels (blutensor.autograd.engine's offered buffers): with the
step's static gradient buffers, no parameter's gradient passes through the engine's separate add, and the
weights after a few accumulating steps equal, bit for bit, those of the same step with the offers switched off
(CPU). The GPU run of the same step is test_graph_step_cuda.py's."""

from __future__ import annotations

import blutensor as bt
import numpy as np
from blumodels.config import ModelConfig
from blumodels.gpt2 import build_model
from blumodels.step import TrainStep
from blutensor.autograd import engine

B, T, STEPS, ACCUM = 2, 16, 3, 2


def _train(monkeypatch, offer: bool):
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=32, block_size=T, vocab_size=97, dropout=0.0)
    model = build_model(cfg, device="cpu", seed=3)
    opt = bt.optim.AdamW(model.param_groups(0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    st = TrainStep(model, opt, list(model.parameters()), device="cpu", lr_schedule=[1e-3] * STEPS, accum=ACCUM,
                   grad_clip=1.0)
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 97, size=(B, T + 1)) for _ in range(STEPS * ACCUM)]
    it = iter(data)
    adds = []
    real = engine._accumulate

    def spy(t, g, T_):
        if g is not None:
            adds.append(tuple(t.shape))
        return real(t, g, T_)

    with monkeypatch.context() as mp:
        mp.setattr(engine, "_accumulate", spy)
        if not offer:
            mp.setattr(engine, "_targets", lambda node, fan_in: None)
        for _ in range(STEPS):
            def batch():
                toks = next(it)
                return bt.tensor(toks[:, :-1]), bt.tensor(toks[:, 1:])

            st.run(batch, 1e-3)
    return [p.numpy().copy() for p in model.parameters()], adds, len(list(model.parameters()))


def test_step_gradients_accumulate_in_kernels_bit_exact(monkeypatch):
    ref, ref_adds, n = _train(monkeypatch, offer=False)
    got, adds = _train(monkeypatch, offer=True)[:2]
    assert len(ref_adds) == STEPS * ACCUM * n  # without offers every gradient goes through the engine's add
    # with offers only the tied token embedding does (the host sums its two gradients first, for exactness)
    assert set(adds) == {(128, 32)} and len(adds) == STEPS * ACCUM  # the padded vocabulary
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a, b)
