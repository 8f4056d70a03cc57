"""rms_norm, rope, silu, swiglu and grouped-query attention vs PyTorch CPU (float64) and finite differences."""

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
import pytest
import torch
from blutensor.errors import ShapeError

rng = np.random.default_rng(0)


def _pair(*shape):
    a = rng.standard_normal(shape)
    return bt.tensor(a, dtype=bt.float64, requires_grad=True), torch.tensor(a, requires_grad=True)


def _close(a, b, tol=1e-10):
    np.testing.assert_allclose(a.detach().numpy() if isinstance(a, bt.Tensor) else a,
                               b.detach().numpy(), rtol=tol, atol=tol)


def _angles(T, D, theta=10000.0):
    inv = 1.0 / theta ** (np.arange(0, D, 2) / D)
    f = np.outer(np.arange(T), inv)
    return np.cos(f), np.sin(f)


def test_rms_norm_matches_torch():
    x, xt = _pair(3, 5, 16)
    w, wt = _pair(16)
    y = F.rms_norm(x, (16,), w, eps=1e-6)
    yt = torch.nn.functional.rms_norm(xt, (16,), wt, eps=1e-6)
    _close(y, yt)
    g = rng.standard_normal(y.shape)
    y.backward(bt.tensor(g, dtype=bt.float64))
    yt.backward(torch.tensor(g))
    _close(x.grad, xt.grad)
    _close(w.grad, wt.grad)


def test_rms_norm_module_default_eps_and_errors():
    m = bt.nn.RMSNorm(8)
    x = bt.tensor(rng.standard_normal((2, 8)).astype(np.float32))
    ref = torch.nn.RMSNorm(8)(torch.tensor(x.numpy()))
    _close(m(x), ref, 1e-6)
    with pytest.raises(ShapeError, match="normalized_shape"):
        F.rms_norm(x, (4,))


def _rope_torch(x, cos, sin):  # Hugging Face's apply_rotary_pos_emb on (B, T, H, D)
    c = torch.cat([cos, cos], -1)[:, None, :]
    s = torch.cat([sin, sin], -1)[:, None, :]
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], -1)
    return x * c + rot * s


def test_rope_matches_hf_formula_and_grad():
    x, xt = _pair(2, 7, 3, 8)
    c, s = _angles(7, 8)
    y = F.rope(x, bt.tensor(c, dtype=bt.float64), bt.tensor(s, dtype=bt.float64))
    yt = _rope_torch(xt, torch.tensor(c), torch.tensor(s))
    _close(y, yt)
    g = rng.standard_normal(y.shape)
    y.backward(bt.tensor(g, dtype=bt.float64))
    yt.backward(torch.tensor(g))
    _close(x.grad, xt.grad)
    with pytest.raises(ShapeError, match="rope: cos must be"):
        F.rope(x, bt.tensor(c[:3], dtype=bt.float64), bt.tensor(s[:3], dtype=bt.float64))


def test_rope_bf16_keeps_float32_tables():
    x = bt.tensor(rng.standard_normal((1, 4, 2, 8)).astype(np.float32))
    c, s = (bt.tensor(a.astype(np.float32)) for a in _angles(4, 8))
    y16 = F.rope(x.to(bt.bfloat16), c, s)
    assert y16.dtype == bt.bfloat16
    y = F.rope(x, c, s)
    np.testing.assert_allclose(y16.to(bt.float32).numpy(), y.numpy(), rtol=2e-2, atol=2e-2)


def test_silu_swiglu_match_torch():
    a, at = _pair(4, 6)
    b, bt_ = _pair(4, 6)
    _close(F.silu(a), torch.nn.functional.silu(at))
    y = F.swiglu(a, b)
    yt = torch.nn.functional.silu(at) * bt_
    _close(y, yt)
    g = rng.standard_normal(y.shape)
    y.backward(bt.tensor(g, dtype=bt.float64))
    yt.backward(torch.tensor(g))
    _close(a.grad, at.grad)
    _close(b.grad, bt_.grad)
    with pytest.raises(ShapeError, match="swiglu"):
        F.swiglu(a, b[:2])


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_gqa_matches_torch(causal):
    q, qt = _pair(2, 4, 5, 8)
    k, kt = _pair(2, 2, 5, 8)
    v, vt = _pair(2, 2, 5, 8)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    yt = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True)
    _close(y, yt)
    g = rng.standard_normal(y.shape)
    y.backward(bt.tensor(g, dtype=bt.float64))
    yt.backward(torch.tensor(g))
    for a, b in ((q, qt), (k, kt), (v, vt)):
        _close(a.grad, b.grad)


def test_sdpa_gqa_bad_heads():
    q, k = bt.zeros(1, 4, 3, 8), bt.zeros(1, 3, 3, 8)
    with pytest.raises(ShapeError, match="dividing q's"):
        F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
    with pytest.raises(ShapeError):  # without the flag unequal heads do not broadcast
        F.scaled_dot_product_attention(q, k, k)
