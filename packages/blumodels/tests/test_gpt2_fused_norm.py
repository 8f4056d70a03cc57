"""GPT-2's fused residual add + LayerNorm (F.add_layer_norm at ln_2, between blocks and before ln_f) against the
model as it ran before the fusion (``x + attn(ln_1(x))``, ``x + mlp(ln_2(x))``, ``ln_f``, written out below with
the same modules): float32 losses and every gradient bitwise equal over a few AdamW steps on the CPU, with and
without activation checkpointing; the bf16 autocast step bitwise equal on the GPU (cuda-marked)."""

from __future__ import annotations

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
import pytest
from blumodels import gpt2
from blumodels.config import ModelConfig

CFG = dict(vocab_size=100, n_layer=3, n_head=2, d_model=32, block_size=16)


def _cuda_ok() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _unfused_loss(model, idx, targets):
    """The GPT-2 forward without the fused op: every residual add, then every LayerNorm, as separate ops."""
    B, T = idx.shape
    x = model.wte(idx) + model.wpe(model._positions(T, idx.device))
    if model.config.dropout > 0:
        x = F.dropout(x, model.config.dropout, model.training)
    for blk in model.blocks:
        x = x + blk.attn(blk.ln_1(x))
        x = x + blk.mlp(blk.ln_2(x))
    logits = F.linear(model.ln_f(x), model.wte.weight)
    return F.cross_entropy(logits.view(B * T, -1), targets.view(B * T))


def _train(fused: bool, device: str = "cpu", steps: int = 3, checkpointing: bool = False, autocast: bool = False,
           cfg: dict = CFG, B: int = 2):
    """Per step: the loss and every parameter gradient (host copies), AdamW stepping in between."""
    model = gpt2.build_model(ModelConfig(**cfg), device=device, seed=1)
    if checkpointing:
        from blutensor.utils import checkpoint_modules

        assert checkpoint_modules(model, "blocks.*")
    opt = bt.optim.AdamW(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    out = []
    for step in range(steps):
        idx = bt.tensor(rng.integers(0, cfg["vocab_size"], (B, cfg["block_size"])), device=device)
        tg = bt.tensor(rng.integers(0, cfg["vocab_size"], (B, cfg["block_size"])), device=device)
        with bt.autocast(device, dtype=bt.bfloat16, enabled=autocast):
            loss = model(idx, tg)[1] if fused else _unfused_loss(model, idx, tg)
        loss.backward()
        out.append((float(loss.item()), [p.grad.to("cpu").numpy().copy() for p in model.parameters()]))
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)  # kept buffers: the kernels add dweight/dbias into .grad
    return out


def _assert_bitwise(got, want):
    for s, ((l1, g1), (l2, g2)) in enumerate(zip(got, want)):
        assert l1 == l2, (s, l1, l2)
        for i, (a, b) in enumerate(zip(g1, g2)):
            assert np.array_equal(a, b), (s, i, float(np.abs(a - b).max()))


def test_fused_op_runs_between_blocks_and_before_ln_f():
    model = gpt2.build_model(ModelConfig(**CFG), seed=1)
    idx = bt.tensor(np.zeros((1, 8), dtype=np.int64))
    loss = model(idx, idx)[1]
    ops, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        ops.append(getattr(n, "op", None))
        stack.extend(getattr(n, "next", ()))
    # ln_2 of every block, ln_1 of blocks 1..L-1 and ln_f: 2L fused ops; block 0's ln_1 stays a layer_norm
    assert ops.count("add_layer_norm") == 2 * CFG["n_layer"]
    assert ops.count("layer_norm") == 1


def test_profiler_attributes_the_fused_op():
    bluprofiler = pytest.importorskip("bluprofiler")
    model = gpt2.build_model(ModelConfig(**CFG), seed=1)
    idx = bt.tensor(np.zeros((2, 8), dtype=np.int64))
    with bluprofiler.profile() as prof:
        model(idx, idx)[1].backward()
    spans = [(e.name, e.phase, e.kernel) for e in prof.result.events if e.name.startswith("add_layer_norm")]
    L = CFG["n_layer"]
    assert spans.count(("add_layer_norm", "forward", "blutensor.add_layer_norm")) == 2 * L
    assert spans.count(("add_layer_norm", "backward", "blutensor.add_layer_norm")) == 2 * L


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("extra", [{}, {"bias": False, "dropout": 0.1}])
def test_fp32_losses_and_gradients_bitwise_equal_to_the_unfused_model_cpu(checkpointing, extra):
    cfg = dict(CFG, **extra)
    _assert_bitwise(_train(True, checkpointing=checkpointing, cfg=cfg), _train(False, cfg=cfg))


def test_reference_kernels_bitwise_equal_too():
    with bt.ext.reference_kernels():  # the NumPy reference kernels (as without a C compiler)
        _assert_bitwise(_train(True, steps=2), _train(False, steps=2))


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_ok(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("autocast", [False, True])
def test_gpu_step_bitwise_equal_to_the_unfused_model(autocast):
    """fp32 and bf16 autocast on the GPU: d_model 768 (the register-resident rows of GPT-2 124M), the fused CUDA
    kernels against AddWiden + layer_norm + cast."""
    cfg = dict(CFG, d_model=768, n_head=12, n_layer=2, block_size=64)
    _assert_bitwise(_train(True, "cuda", 2, autocast=autocast, cfg=cfg), _train(False, "cuda", 2, autocast=autocast,
                                                                                cfg=cfg))
