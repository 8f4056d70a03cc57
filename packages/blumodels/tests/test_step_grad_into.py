"""The training step's gradients accumulate in the kernels (blutensor.autograd.engine's offered buffers): with the
step's static gradient buffers, no parameter's gradient passes through the engine's separate add, and the
weights after a few accumulating steps equal, bit for bit, those of the same step with the offers switched off
(CPU; GPT-2 and the llama family, whose RMSNorm weights the norm kernels accumulate). The GPU run of the same step
is test_graph_step_cuda.py's."""

from __future__ import annotations

import blutensor as bt
import numpy as np
import pytest
from blumodels.config import ModelConfig
from blumodels.gpt2 import build_model
from blumodels.llama.model import build_model as build_llama
from blumodels.step import TrainStep
from blutensor.ext import recording_kernel_launches, recording_leaf_adds

B, T, STEPS, ACCUM = 2, 16, 3, 2


#: model family -> (its ModelConfig keys beyond the shared ones, builder)
FAMILIES = {
    "gpt2": ({}, build_model),
    "llama": ({"family": "llama", "n_kv_heads": 1, "ffn_hidden": 48, "bias": False}, build_llama),
    "llama_untied": ({"family": "llama", "n_kv_heads": 1, "ffn_hidden": 48, "bias": False, "tie_embeddings": False},
                     build_llama),
}


def _model(family: str, n_layer: int, d_model: int, device: str):
    extra, build = FAMILIES[family]
    cfg = ModelConfig(n_layer=n_layer, n_head=2, d_model=d_model, block_size=T, vocab_size=97, dropout=0.0, **extra)
    return build(cfg, device=device, seed=3)


def _train(monkeypatch, offer: bool, family: str = "gpt2"):
    model = _model(family, 2, 32, "cpu")
    opt = bt.optim.AdamW(model.param_groups(0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    st = TrainStep(model, opt, list(model.parameters()), device="cpu", lr_schedule=[1e-3] * STEPS, accum=ACCUM,
                   grad_clip=1.0)
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 97, size=(B, T + 1)) for _ in range(STEPS * ACCUM)]
    it = iter(data)
    with recording_leaf_adds(offers=offer) as adds:
        for _ in range(STEPS):
            def batch():
                toks = next(it)
                return bt.tensor(toks[:, :-1]), bt.tensor(toks[:, 1:])

            st.run(batch, 1e-3)
    return [p.numpy().copy() for p in model.parameters()], adds, len(list(model.parameters()))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_step_gradients_accumulate_in_kernels_bit_exact(monkeypatch, family):
    ref, ref_adds, n = _train(monkeypatch, offer=False, family=family)
    got, adds = _train(monkeypatch, offer=True, family=family)[:2]
    assert len(ref_adds) == STEPS * ACCUM * n  # without offers every gradient goes through the engine's add
    if family == "llama_untied":  # every gradient, the RMSNorm weights' included, accumulates in a kernel
        assert adds == []
    else:  # only the tied token embedding's does (the host sums its two gradients first, for exactness)
        assert set(adds) == {(128, 32)} and len(adds) == STEPS * ACCUM  # the padded vocabulary
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a, b)


def _cuda_step_launches(monkeypatch, n_layer: int, precision: str, family: str = "gpt2"):
    """Kernel launches (blutensor's own kernels, by name) and engine leaf adds of one eager CUDA TrainStep after a
    warm-up step: fused AdamW, clipping, bf16 autocast with the multi-tensor weight cast."""
    bt.set_matmul_precision("tf32" if precision == "tf32" else "fp32")
    model = _model(family, n_layer, 64, "cuda")
    opt = bt.optim.AdamW(model.param_groups(0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    amp = (lambda: bt.autocast("cuda", dtype=bt.bfloat16)) if precision == "bf16" else None
    st = TrainStep(model, opt, list(model.parameters()), device="cuda", lr_schedule=[1e-3] * 4, grad_clip=1.0,
                   autocast=amp, fused=True)
    st.precast_accumulate = True
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 97, size=(B, T + 1))
    x, y = bt.tensor(toks[:, :-1], device="cuda"), bt.tensor(toks[:, 1:], device="cuda")
    st.run(lambda: (x, y), 1e-3)
    with recording_kernel_launches() as names, recording_leaf_adds() as adds:
        st.run(lambda: (x, y), 1e-3)
    st.read()
    bt.set_matmul_precision("fp32")
    return names, len(adds), len(list(model.parameters()))


@pytest.mark.cuda
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_cuda_step_has_no_per_parameter_launches(monkeypatch, precision, family):
    """GPU twin of test_step_gradients_accumulate_in_kernels_bit_exact: no parameter gradient passes through the
    engine's add, no per-parameter cast-accumulate kernel runs, and the launches of the optimizer, the norm, the
    clipping and the weight casts do not grow with the number of parameters (1 vs 3 layers)."""
    if not bt.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    one, adds1, n1 = _cuda_step_launches(monkeypatch, 1, precision, family)
    three, adds3, n3 = _cuda_step_launches(monkeypatch, 3, precision, family)
    assert n3 > n1 and adds1 == 0 and adds3 == 0, (adds1, adds3)
    assert not any("cast_accumulate" in k for k in three), three
    fixed = [k for k in three if k.startswith(("blu_adamw", "blu_grad_norm", "blu_cast_multi"))]
    assert fixed, three
    for k in fixed:
        assert three[k] == one[k], (k, one[k], three[k])
    print(precision, "launches per step (3 layers):", dict(sorted(three.items())))


@pytest.mark.cuda
def test_cuda_bf16_step_with_adamw_written_weight_copies_is_bit_exact(monkeypatch):
    """bf16 TrainStep with the fused AdamW writing the bf16 weight copies: losses and weights equal, bit for bit,
    the step that casts every weight each step, with one weight-cast launch in all instead of one per step."""
    if not bt.cuda.is_available():
        pytest.skip("needs a CUDA GPU")

    def run(copies: bool):
        cfg = ModelConfig(n_layer=2, n_head=2, d_model=64, block_size=T, vocab_size=97, dropout=0.0)
        model = build_model(cfg, device="cuda", seed=3)
        opt = bt.optim.AdamW(model.param_groups(0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
        st = TrainStep(model, opt, list(model.parameters()), device="cuda", lr_schedule=[1e-3] * 4, grad_clip=1.0,
                       autocast=lambda: bt.autocast("cuda", dtype=bt.bfloat16), fused=True)
        st.precast_accumulate = True
        with monkeypatch.context() as mp, recording_kernel_launches() as launches:
            if not copies:
                mp.setattr(TrainStep, "_copies", lambda self: None)
            rng = np.random.default_rng(0)
            losses = []
            for _ in range(4):
                toks = rng.integers(0, 97, size=(B, T + 1))
                x, y = bt.tensor(toks[:, :-1], device="cuda"), bt.tensor(toks[:, 1:], device="cuda")
                st.run(lambda b=(x, y): b, 1e-3)
                losses.append(st.read().loss)
        return losses, [p.numpy() for p in model.parameters()], launches["blu_cast_multi_f32_to_bf16"]

    l0, w0, c0 = run(False)
    l1, w1, c1 = run(True)
    assert (c0, c1) == (4, 1), (c0, c1)
    assert l0 == l1
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)
