"""The MLP with its GELU in the GEMM epilogues (blutensor.ops.gelu_mlp, blutensor.gemm.provider_linear_gelu /
provider_matmul_dgelu), on the CPU: the fused calls go to an installed host-array GEMM provider declaring the epilogues
(its NumPy reference), found by capability, standing in for the CUDA provider. Values and gradients must equal the
unfused ops (linear, gelu, linear) within float32 rounding, gradients must land in offered ``.grad`` buffers, and every
piece the provider cannot fuse must fall back to the separate kernels with the same result."""

from __future__ import annotations

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
import pytest
from blutensor import ext
from blutensor.autograd.node import ACCUMULATED, Ctx
from blutensor.ops import gelu_mlp
from conftest import rng


def _base_provider(bf16: bool = False):
    """An installed GEMM provider that takes host arrays, declares 'gelu' and ACCUMULATE (and bf16 if asked)."""
    for p in ext.gemm_providers():
        if (getattr(p, "HOST_ARRAYS", False) and "gelu" in getattr(p, "EPILOGUES", ())
                and getattr(p, "ACCUMULATE", False) and (not bf16 or "bf16" in getattr(p, "PRECISIONS", ()))):
            return p
    pytest.skip("no installed GEMM provider takes host arrays with the 'gelu' epilogue")


def _fusing(refuse: str = "", bf16: bool = False):
    """The base provider declaring 'dgelu' too (its host path computes it), recording each fused call; ``refuse``:
    'bgrad' answers None to DGELU with a bias gradient, 'dgelu' to every DGELU (no fused form for the problem)."""
    base = _base_provider(bf16)

    class Fusing(base):
        EPILOGUES = ("none", "gelu", "dgelu")
        calls: list = []

        @classmethod
        def matmul(cls, a, b, **kw):
            epi = kw.get("epilogue", "none")
            if epi != "none":
                cls.calls.append((epi, kw.get("bias_grad") is not None, kw.get("precision")))
                if epi == "dgelu" and (refuse == "dgelu" or (refuse == "bgrad" and kw.get("bias_grad") is not None)):
                    return None
            return base.matmul(a, b, **kw)

    return Fusing


def _inputs(seed=0, bias=True, m=37, d=40, ff=72):
    r = rng(seed)
    x = r.standard_normal((m, d)).astype(np.float32)
    w1 = (r.standard_normal((ff, d)) * 0.3).astype(np.float32)
    w2 = (r.standard_normal((d, ff)) * 0.3).astype(np.float32)
    b1 = r.standard_normal(ff).astype(np.float32) if bias else None
    b2 = r.standard_normal(d).astype(np.float32) if bias else None
    g = r.standard_normal((m, d)).astype(np.float32)
    return x, w1, b1, w2, b2, g


def _unfused(x, w1, b1, w2, b2, g):
    """y and the five gradients through blutensor's own ops (linear, tanh gelu, linear) and autograd."""
    ts = [None if a is None else bt.tensor(a, requires_grad=True) for a in (x, w1, b1, w2, b2)]
    y = F.linear(F.gelu(F.linear(ts[0], ts[1], ts[2]), approximate="tanh"), ts[3], ts[4])
    (y * bt.tensor(g)).sum().backward()
    return y.numpy(), [None if t is None else t.grad.numpy() for t in ts]


def _fused(x, w1, b1, w2, b2, g, into=None):
    ctx = Ctx()
    ctx.needs = (True, True, b1 is not None, True, b2 is not None)
    y = gelu_mlp.gelu_mlp_forward(ctx, x, w1, b1, w2, b2)
    ctx.grad_into = into
    return y, gelu_mlp.gelu_mlp_backward(ctx, g), ctx


def _close(got, want, tol=2e-5):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, float(np.abs(want).max())))


def test_provider_linear_gelu_is_one_gemm_writing_the_preactivation():
    from blutensor.gemm import provider_linear_gelu

    prov = _fusing()
    x, w1, b1, *_ = _inputs()
    h, u = provider_linear_gelu(prov, x, w1, b1, np)
    ref_u = x.astype(np.float64) @ w1.T.astype(np.float64) + b1
    _close(u, ref_u)
    _close(h, 0.5 * ref_u * (1 + np.tanh(0.7978845608028654 * (ref_u + 0.044715 * ref_u**3))))
    assert prov.calls == [("gelu", False, "fp32")]


def test_provider_matmul_dgelu_writes_the_bias_gradient_and_skips_3xtf32():
    from blutensor.gemm import provider_matmul_dgelu

    prov = _fusing()
    r = rng(2)
    g2, w, u = (r.standard_normal(s).astype(np.float32) for s in ((37, 40), (40, 72), (37, 72)))
    sums = np.full(72, np.nan, np.float32)
    du = provider_matmul_dgelu(prov, g2, w, u, np, bias_grad=sums)
    t = np.tanh(0.7978845608028654 * (u + 0.044715 * u.astype(np.float64) ** 3))
    d = 0.5 * (1 + t) + 0.5 * u * (1 - t * t) * 0.7978845608028654 * (1 + 3 * 0.044715 * u.astype(np.float64) ** 2)
    ref = (g2.astype(np.float64) @ w) * d
    _close(du, ref)
    _close(sums, ref.sum(axis=0))
    assert prov.calls == [("dgelu", True, "fp32")]
    with bt.policy.scope(fp32_gemm="3xtf32"):  # two accumulating GEMMs: no fused form, nothing asked
        assert provider_matmul_dgelu(prov, g2, w, u, np) is None
    assert len(prov.calls) == 1


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("refuse", ["", "bgrad", "dgelu", "undeclared"])
def test_fused_mlp_equals_the_unfused_ops(monkeypatch, bias, refuse):
    """Forward through the 'gelu' GEMM, backward through the 'dgelu' GEMM (or, where the provider answers None or
    does not declare it, the product + gelu backward + bias GEMV): the same values and gradients as linear, gelu,
    linear."""
    prov = _fusing("" if refuse == "undeclared" else refuse)
    if refuse == "undeclared":
        prov.EPILOGUES = ("none", "gelu")
    monkeypatch.setattr(gelu_mlp, "fusing_provider", lambda x: prov)
    args = _inputs(bias=bias)
    y, grads, _ = _fused(*args)
    ref_y, ref_grads = _unfused(*args)
    _close(y, ref_y)
    for i, (got, want) in enumerate(zip(grads, ref_grads)):
        assert (got is None) == (want is None), i
        if want is not None:
            _close(got, want, 5e-5)
    want_calls = {"": [("dgelu", bias)], "bgrad": [("dgelu", True), ("dgelu", False)] if bias else [("dgelu", False)],
                  "dgelu": [("dgelu", bias)] + ([("dgelu", False)] if bias else []), "undeclared": []}[refuse]
    assert [c[:2] for c in prov.calls] == [("gelu", False)] + want_calls


@pytest.mark.parametrize("refuse", ["", "bgrad"])
def test_fused_mlp_adds_into_offered_buffers(monkeypatch, refuse):
    """With the leaves' float32 .grad buffers offered, every weight and bias gradient is added into them (the dgelu
    GEMM's bias sums by one add; without them the bias GEMV with beta = 1): old + new."""
    monkeypatch.setattr(gelu_mlp, "fusing_provider", lambda x: _fusing(refuse))
    args = _inputs(3)
    _, ref = _unfused(*args)
    r = rng(4)
    old = [r.standard_normal(a.shape).astype(np.float32) for a in args[1:5]]
    bufs = [o.copy() for o in old]
    _, grads, _ = _fused(*args, into=(None, *bufs))
    assert grads[1:] == (ACCUMULATED,) * 4
    _close(grads[0], ref[0], 5e-5)
    for b, o, want in zip(bufs, old, ref[1:]):
        _close(b, o + want, 5e-5)


def test_without_a_fusing_provider_the_separate_kernels_run_and_only_u_is_kept():
    """On host arrays (no provider fuses there): linear, gelu, linear, equal to the ops; float32 keeps the
    pre-activation u for backward but not the GELU output (recomputed there)."""
    args = _inputs(5)
    y, grads, ctx = _fused(*args)
    ref_y, ref_grads = _unfused(*args)
    _close(y, ref_y)
    for got, want in zip(grads, ref_grads):
        _close(got, want, 5e-5)
    arrays = {}

    def walk(v):
        if isinstance(v, np.ndarray):
            base = v.base if isinstance(v.base, np.ndarray) else v
            arrays[id(base)] = base
        elif isinstance(v, tuple | list):
            for e in v:
                walk(e)
        elif isinstance(v, Ctx):
            walk(v.saved)

    walk(ctx.saved)
    hidden = [a for a in arrays.values() if a.shape == (37, 72)]
    assert len(hidden) == 1  # u only


def test_bf16_fused_mlp_matches_float64_and_feeds_float32_masters(monkeypatch):
    """bf16 bits (the CUDA formulas on NumPy): the fused GEMMs, c_proj's bf16 linear, c_fc's bf16 linear backward;
    the offered float32 buffers receive the weight gradients and the dgelu GEMM's bias sums; without buffers the
    bias gradient comes back as bf16 bits."""
    from blutensor.backends import bf16_bits_to_f32, f32_to_bf16_bits
    from blutensor.backends.cupy import cast, linalg

    prov = _fusing(bf16=True)
    monkeypatch.setattr(linalg, "cupy", lambda: np)
    monkeypatch.setattr(linalg, "bf16_provider", lambda: prov)
    monkeypatch.setattr(cast, "to_bf16", lambda a: f32_to_bf16_bits(a, np))
    monkeypatch.setattr(linalg, "_ones_bf16", lambda n: np.full((1, n), 0x3F80, dtype=np.uint16))
    monkeypatch.setattr(gelu_mlp, "fusing_provider", lambda x: prov)
    args = _inputs(6)
    bits = [f32_to_bf16_bits(a, np) for a in args]
    vals = [bf16_bits_to_f32(b, np).astype(np.float64) for b in bits]
    x, w1, b1, w2, b2, g = vals
    u = x @ w1.T + b1
    t = np.tanh(0.7978845608028654 * (u + 0.044715 * u**3))
    h = 0.5 * u * (1 + t)
    du = (g @ w2) * (0.5 * (1 + t) + 0.5 * u * (1 - t * t) * 0.7978845608028654 * (1 + 3 * 0.044715 * u * u))
    want = {"y": h @ w2.T + b2, "x": du @ w1, "w1": du.T @ x, "b1": du.sum(0), "w2": g.T @ h, "b2": g.sum(0)}
    bufs = [np.zeros(a.shape, np.float32) for a in args[1:5]]
    y, grads, _ = _fused(*bits[:5], bits[5], into=(None, *bufs))
    assert y.dtype == np.uint16 and grads[0].dtype == np.uint16 and grads[1:] == (ACCUMULATED,) * 4
    for name, got in (("y", y), ("x", grads[0])):
        _close(bf16_bits_to_f32(got, np), want[name], 2e-2)
    for name, got in zip(("w1", "b1", "w2", "b2"), bufs):
        _close(got, want[name], 2e-2)
    _, grads, _ = _fused(*bits[:5], bits[5])
    assert grads[2].dtype == np.uint16  # the bias gradient of a bf16 input, as the bf16 linear gives it
    _close(bf16_bits_to_f32(grads[2], np), want["b1"], 2e-2)
    assert ("dgelu", True, "bf16") in prov.calls


def test_autocast_lower_gives_the_regions_cached_differentiable_casts():
    w = bt.nn.Parameter(bt.tensor(rng(7).standard_normal((3, 4)).astype(np.float32)))
    assert ext.autocast_lower(w, None) == (w, None)  # outside a region: unchanged
    with bt.autocast("cpu"):
        lw, none = ext.autocast_lower(w, None)
        assert lw.dtype is bt.bfloat16 and none is None
        assert ext.autocast_lower(w)[0] is lw  # the weight-cast cache: cast once per region
        lw.float().sum().backward()
    np.testing.assert_array_equal(w.grad.numpy(), np.ones((3, 4), np.float32))
