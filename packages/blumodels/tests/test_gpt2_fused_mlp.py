"""GPT-2's MLP as one op with the GELU in the GEMM epilogues (``gpt2._GeluMLP``, on CUDA where the GEMM provider fuses
GELU): its gradients equal the modules' own path, gradients accumulate into kept ``.grad`` buffers, and it is taken
only for GPT-2's own Linear modules on CuPy arrays of one dtype with a fusing provider (a replaced module, a wrapped
forward, host arrays or no fusing provider keep the modules' calls). On the CPU the Function runs its separate-kernel
fallback; the ``cuda``-marked twins compare the fused CUDA path against the unfused one."""

from __future__ import annotations

import blutensor as bt
import numpy as np
import pytest
from blumodels import gpt2
from blumodels.config import ModelConfig
from blutensor import ext

CFG = dict(vocab_size=100, n_layer=2, n_head=2, d_model=32, block_size=16)


def _cuda_ok() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _mlp(device="cpu", bias=True):
    bt.manual_seed(3)
    return gpt2.MLP(ModelConfig(**dict(CFG, bias=bias)), device=device)


def _close(a, b, tol):
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, float(np.abs(b).max())))


@pytest.mark.parametrize("bias", [True, False])
def test_fused_function_equals_the_modules_and_accumulates_into_kept_grads(bias):
    """The Function's CPU path (linear, gelu, linear kernels) against MLP.forward's own path: outputs and input
    gradients of two backward passes, and the weight and bias gradients after both (the second pass adds into the
    .grad buffers the first created)."""
    r = np.random.default_rng(0)
    xs = [r.standard_normal((2, 16, 32)).astype(np.float32) for _ in range(2)]
    gs = [r.standard_normal((2, 16, 32)).astype(np.float32) for _ in range(2)]
    res = []
    for fused in (False, True):
        mlp = _mlp(bias=bias)
        steps = []
        for xa, ga in zip(xs, gs):
            x = bt.tensor(xa, requires_grad=True)
            if fused:
                y = gpt2._GeluMLP.apply(x, mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight, mlp.c_proj.bias)
                assert y.grad_fn.op == "_GeluMLP"
            else:
                y = mlp(x)
            (y * bt.tensor(ga)).sum().backward()
            steps.append((y.detach().numpy().copy(), x.grad.numpy().copy()))
        res.append((steps, [p.grad.numpy().copy() for p in mlp.parameters()]))
    (steps0, gp0), (steps1, gp1) = res
    for (y0, gx0), (y1, gx1) in zip(steps0, steps1):
        _close(y1, y0, 1e-5)
        _close(gx1, gx0, 1e-5)
    assert len(gp0) == len(gp1) == (4 if bias else 2)
    for a, b in zip(gp1, gp0):
        _close(a, b, 1e-5)


@pytest.fixture
def fusing(monkeypatch):
    """MLP.forward believes it sees CuPy arrays with a fusing GEMM provider (the Function then runs its CPU path)."""
    monkeypatch.setattr(ext, "is_cuda_array", lambda a: True)
    monkeypatch.setattr(ext, "gelu_gemm_provider", lambda a: object())
    monkeypatch.setattr(gpt2, "FUSED_MLP_DTYPES", (bt.float32, bt.bfloat16))  # float32 too, as a provider may fuse


def _op(mlp, x):
    return mlp(x).grad_fn.op


def test_mlp_takes_the_fused_function_only_where_it_applies(fusing, monkeypatch):
    x = bt.tensor(np.ones((2, 4, 32), np.float32), requires_grad=True)
    mlp = _mlp()
    assert _op(mlp, x) == "_GeluMLP"
    monkeypatch.setattr(ext, "gelu_gemm_provider", lambda a: None)  # the provider does not fuse GELU
    assert _op(mlp, x) == "_GeluLinear"
    monkeypatch.setattr(ext, "gelu_gemm_provider", lambda a: object())
    monkeypatch.setattr(ext, "is_cuda_array", lambda a: False)  # host arrays, or a tracer's under bt.compile
    assert _op(mlp, x) == "_GeluLinear"


def test_replaced_or_wrapped_modules_are_called_not_fused(fusing):
    x = bt.tensor(np.ones((2, 4, 32), np.float32), requires_grad=True)

    class Proj(bt.nn.Module):  # a tensor-parallel or plugin replacement of c_proj
        def __init__(self, inner):
            super().__init__()
            self.inner, self.weight, self.bias, self.calls = inner, inner.weight, inner.bias, 0

        def forward(self, h):
            self.calls += 1
            return self.inner(h)

    mlp = _mlp()
    mlp.c_proj = Proj(mlp.c_proj)
    assert _op(mlp, x) != "_GeluMLP" and mlp.c_proj.calls == 1
    mlp = _mlp()
    seen = []
    inner = mlp.c_fc.forward
    mlp.c_fc.forward = lambda h: seen.append(1) or inner(h)  # a logger wrapping c_fc's forward
    assert _op(mlp, x) != "_GeluMLP" and seen == [1]


def test_float32_keeps_the_modules_by_default(monkeypatch):
    """By default only bf16 takes the fused MLP (float32's GELU epilogues were measured slower than the kernels)."""
    monkeypatch.setattr(ext, "is_cuda_array", lambda a: True)
    monkeypatch.setattr(ext, "gelu_gemm_provider", lambda a: object())
    x = bt.tensor(np.ones((2, 4, 32), np.float32), requires_grad=True)
    assert gpt2.FUSED_MLP_DTYPES == (bt.bfloat16,) and _op(_mlp(), x) == "_GeluLinear"


def test_mixed_dtypes_keep_the_modules(fusing):
    mlp = _mlp()
    mlp.c_fc.bias = bt.nn.Parameter(bt.zeros(128, dtype=bt.float64))
    assert gpt2._fused_mlp_inputs(mlp, bt.tensor(np.ones((1, 2, 32), np.float32))) is None


def test_under_autocast_the_function_gets_the_regions_weight_casts(fusing):
    """Inside an autocast region the fused op's inputs are the bf16 casts c_fc's linear would get (the weight-cast
    cache: one cast per weight and region, gradients flowing to the float32 masters)."""
    mlp = _mlp()
    x = bt.tensor(np.ones((1, 2, 32), np.float32))
    with bt.autocast("cpu"):
        args = gpt2._fused_mlp_inputs(mlp, x)
        assert args is not None and {a.dtype for a in args} == {bt.bfloat16}
        assert args[1] is ext.autocast_lower(mlp.c_fc.weight)[0] and args[1].grad_fn is not None
    assert gpt2._fused_mlp_inputs(mlp, x)[1] is mlp.c_fc.weight  # outside the region: the masters themselves


# ---------------------------------------------------------------- the fused CUDA path (cuda-marked)
def _train(device, fused, autocast, steps=3, cfg=None, monkeypatch=None):
    """Per micro-step: the loss and every gradient (the .grad buffers kept, so later steps accumulate into them)."""
    cfg = dict(CFG, d_model=64, n_head=4, block_size=32, **(cfg or {}))
    model = gpt2.build_model(ModelConfig(**cfg), device=device, seed=1)
    calls = []
    with monkeypatch.context() as mp:
        if not fused:
            mp.setattr(gpt2, "_fused_mlp_inputs", lambda mlp, x: None)
        else:
            mp.setattr(gpt2, "FUSED_MLP_DTYPES", (bt.float32, bt.bfloat16))
            real = gpt2._GeluMLP.apply
            mp.setattr(gpt2._GeluMLP, "apply", lambda *a: calls.append(1) or real(*a))
        r = np.random.default_rng(0)
        out = []
        params = list(model.parameters())
        for _ in range(steps):
            idx = bt.tensor(r.integers(0, cfg["vocab_size"], (2, cfg["block_size"])), device=device)
            with bt.autocast(device, enabled=autocast):
                if autocast:
                    bt.amp.precast(params)
                loss = model(idx, idx)[1]
            loss.backward()
            out.append((float(loss.item()), [p.grad.to("cpu").numpy().astype(np.float64) for p in params]))
    if fused:
        assert len(calls) == steps * cfg["n_layer"], "the fused MLP was not taken"
    return out


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_ok(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("extra", [{}, {"bias": False}, {"dropout": 0.1}])
def test_gpu_fused_mlp_training_matches_the_unfused_model(monkeypatch, mode, extra):
    """GPT-2 on CUDA with the fused MLP (GELU in the cuBLASLt epilogues) against the same model with the modules'
    own path: three accumulating micro-steps, losses and every gradient within the precision's rounding."""
    prev = bt.get_matmul_precision()
    bt.set_matmul_precision("tf32" if mode == "tf32" else "fp32")
    try:
        got = _train("cuda", True, mode == "bf16", cfg=extra, monkeypatch=monkeypatch)  # build_model seeds dropout
        want = _train("cuda", False, mode == "bf16", cfg=extra, monkeypatch=monkeypatch)
    finally:
        bt.set_matmul_precision(prev)
    tol = {"fp32": 1e-4, "tf32": 1e-2, "bf16": 3e-2}[mode]
    for s, ((l1, g1), (l2, g2)) in enumerate(zip(got, want)):
        assert abs(l1 - l2) <= tol * max(1.0, abs(l2)), (s, l1, l2)
        for i, (a, b) in enumerate(zip(g1, g2)):
            assert np.abs(a - b).max() <= tol * (np.abs(b).max() + 1e-12), (s, i, float(np.abs(a - b).max()))
