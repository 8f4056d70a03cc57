"""The llama family's fused residual add + RMSNorm (F.add_rms_norm at post_attention_layernorm, between blocks and
before the final norm) against the model written op by op (``x + self_attn(input_layernorm(x))``,
``x + mlp(post_attention_layernorm(x))``, ``norm``, below with the same modules): float32 losses and every gradient
bitwise equal over a few AdamW steps on the CPU (the compiled kernels and the NumPy references), with and without
activation checkpointing; on the GPU (cuda-marked) fp32 and bf16 autocast within the kernels' rounding."""

from __future__ import annotations

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
import pytest
from blumodels.config import ModelConfig
from blumodels.llama import model as llama

CFG = dict(family="llama", vocab_size=100, n_layer=3, n_head=4, n_kv_heads=2, d_model=32, block_size=16, bias=False,
           ffn_hidden=48)


def _cuda_ok() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _unfused_loss(model, idx, targets):
    """The Llama forward without the fused op: every residual add, then every RMSNorm, as separate ops; under
    autocast the output of each norm that follows an add cast to the autocast dtype (the GEMM input the fused op
    writes; the first block's input_layernorm is a plain rms_norm in both)."""
    from blutensor.amp import get_autocast_dtype, is_autocast_enabled

    dev = idx.device.type
    low = (lambda t: t.to(get_autocast_dtype(dev))) if is_autocast_enabled(dev) else (lambda t: t)
    B, T = idx.shape
    cos, sin = model.rope(0, T, idx.device)
    x = model.embed_tokens(idx)
    if model.config.dropout > 0:
        x = F.dropout(x, model.config.dropout, model.training)
    for i, blk in enumerate(model.layers):
        y = blk.input_layernorm(x)
        x = x + blk.self_attn(low(y) if i else y, cos, sin, None, i)
        x = x + blk.mlp(low(blk.post_attention_layernorm(x)))
    logits = F.linear(low(model.norm(x)), model.output_weight)
    return F.cross_entropy(logits.view(B * T, -1), targets.view(B * T))


def _train(fused: bool, device: str = "cpu", steps: int = 3, checkpointing: bool = False, autocast: bool = False,
           cfg: dict = CFG, B: int = 2):
    """Per step: the loss and every parameter gradient (host copies), AdamW stepping in between."""
    model = llama.build_model(ModelConfig(**cfg), device=device, seed=1)
    if checkpointing:
        from blutensor.utils import checkpoint_modules

        assert checkpoint_modules(model, model.block_pattern)
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
        opt.zero_grad(set_to_none=step % 2 == 0)  # kept buffers: the kernels add dweight into .grad
    return out


def _assert_bitwise(got, want):
    for s, ((l1, g1), (l2, g2)) in enumerate(zip(got, want)):
        assert l1 == l2, (s, l1, l2)
        for i, (a, b) in enumerate(zip(g1, g2)):
            assert np.array_equal(a, b), (s, i, float(np.abs(a - b).max()))


def _assert_close(got, want, tol):
    for s, ((l1, g1), (l2, g2)) in enumerate(zip(got, want)):
        assert abs(l1 - l2) <= tol * abs(l2), (s, l1, l2)
        for i, (a, b) in enumerate(zip(g1, g2)):
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(float(np.abs(b).max()), 1e-30) * 4,
                                       err_msg=f"step {s} parameter {i}")


def _ops(loss):
    ops, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        ops.append(getattr(n, "op", None))
        stack.extend(getattr(n, "next", ()))
    return ops


def test_fused_op_runs_between_blocks_and_before_the_final_norm():
    model = llama.build_model(ModelConfig(**CFG), seed=1)
    idx = bt.tensor(np.zeros((1, 8), dtype=np.int64))
    ops = _ops(model(idx, idx)[1])
    # post_attention_layernorm of every block, input_layernorm of blocks 1..L-1 and the final norm: 2L fused ops;
    # block 0's input_layernorm stays an rms_norm
    assert ops.count("add_rms_norm") == 2 * CFG["n_layer"]
    assert ops.count("rms_norm") == 1
    # a wrapped block (activation checkpointing) takes the residual stream whole and hands on its output: the adds
    # on both sides of layers.1 run alone, layers.2's input_layernorm is an rms_norm (its ops: inside the checkpoint)
    from blutensor.utils import checkpoint_modules

    assert checkpoint_modules(model, "layers.1") == ["layers.1"]
    ops = _ops(model(idx, idx)[1])
    assert ops.count("add_rms_norm") == 3 and ops.count("rms_norm") == 2


def test_generation_logits_equal_the_unfused_model():
    """Without targets (the last position only) and with the KV cache's incremental forward: the same logits as
    the op-by-op model."""
    from blumodels.generate import generate_batch

    model = llama.build_model(ModelConfig(**CFG), seed=2)
    idx = bt.tensor(np.random.default_rng(1).integers(0, 100, (2, 9)))
    with bt.no_grad():
        got = model(idx)[0].numpy()
        B, T = idx.shape
        cos, sin = model.rope(0, T, idx.device)
        x = model.embed_tokens(idx)
        for i, blk in enumerate(model.layers):
            x = x + blk.self_attn(blk.input_layernorm(x), cos, sin, None, i)
            x = x + blk.mlp(blk.post_attention_layernorm(x))
        want = F.linear(model.norm(x)[:, -1:, :], model.output_weight).numpy()
    np.testing.assert_array_equal(got, want)
    prompts = idx.numpy().tolist()
    cached = generate_batch(model, prompts, 5, top_k=1, use_cache=True)
    assert cached == generate_batch(model, prompts, 5, top_k=1, use_cache=False)
    assert [r[9] for r in cached] == list(np.argmax(got[:, -1, :100], axis=-1))  # the first token: greedy


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("extra", [{}, {"tie_embeddings": False, "dropout": 0.1}])
def test_fp32_losses_and_gradients_bitwise_equal_to_the_unfused_model_cpu(checkpointing, extra):
    cfg = dict(CFG, **extra)
    _assert_bitwise(_train(True, checkpointing=checkpointing, cfg=cfg), _train(False, cfg=cfg))


def test_reference_kernels_bitwise_equal_too():
    with bt.ext.reference_kernels():  # the NumPy reference kernels (as without a C compiler)
        _assert_bitwise(_train(True, steps=2), _train(False, steps=2))


def test_cpu_autocast_step_bitwise_equal_to_the_unfused_model():
    """bf16 autocast on the CPU: the attention's and MLP's bf16 outputs with the float32 residual stream take the
    fused op's op-by-op path (add, rms_norm, cast to the bf16 GEMM input): the unfused model's ops."""
    _assert_bitwise(_train(True, steps=2, autocast=True), _train(False, steps=2, autocast=True))


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_ok(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
def test_gpu_step_equal_to_the_unfused_model(autocast, checkpointing):
    """fp32 and bf16 autocast on the GPU (d_model 768: the register-resident rows of the fused kernels): the fused
    CUDA kernels against add + rms_norm.cu (+ cast), within the kernels' rounding (the two reduce a row's sum of
    squares in different orders)."""
    cfg = dict(CFG, d_model=768, n_head=12, n_kv_heads=4, n_layer=2, block_size=64, ffn_hidden=2048)
    tol = 2e-2 if autocast else 1e-4
    _assert_close(_train(True, "cuda", 2, checkpointing=checkpointing, autocast=autocast, cfg=cfg),
                  _train(False, "cuda", 2, autocast=autocast, cfg=cfg), tol)
