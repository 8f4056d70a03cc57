"""rms_norm, rope, swiglu and GQA attention against float64 NumPy references, fp32 and bf16, forward and backward.

The ``cuda`` cases run the fused kernels of cuda_ops/decoder.py (kernels/rms_norm.cu, rope.cu, swiglu.cu) and
skip without CuPy or a GPU; the ``cpu`` cases are their twins (same assertions on blutensor's generic ops). The
kernel classes and their entry points are checked on CPU too.
"""

from __future__ import annotations

import re
from pathlib import Path

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
import pytest


def _cuda_ok() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda,
                                              pytest.mark.skipif(not _cuda_ok(), reason="needs CuPy and a GPU")])]
DTYPES = ["float32", "bfloat16"]
TOL = {"float32": 2e-5, "bfloat16": 3e-2}
KDIR = Path(bt.__file__).resolve().parent / "kernels"
rng = np.random.default_rng(0)


def _bf16_round(a: np.ndarray, dtype: str) -> np.ndarray:
    """``a`` as the kernel sees it: rounded to bf16 for bf16 inputs."""
    return bt.tensor(a.astype(np.float32)).to(bt.bfloat16).to(bt.float32).numpy().astype(np.float64) \
        if dtype == "bfloat16" else a


def _t(a, device, dtype, grad=True):
    t = bt.tensor(a.astype(np.float32), device=device).to(getattr(bt, dtype)).detach()
    t.requires_grad = grad
    return t


def _np(t):
    return t.detach().to("cpu").to(bt.float32).numpy().astype(np.float64)


def _check(got, want, dtype):
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, atol=TOL[dtype] * scale, rtol=TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C", [64, 200, 2048])
def test_rms_norm(device, dtype, C):
    x = _bf16_round(rng.standard_normal((37, C)) * 2 + 0.5, dtype)
    w = _bf16_round(1 + 0.1 * rng.standard_normal(C), dtype)
    g = _bf16_round(rng.standard_normal((37, C)), dtype)
    eps = 1e-5
    rstd = 1 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    xh = x * rstd
    gx_ref = rstd * (g * w - xh * (g * w * xh).mean(-1, keepdims=True))
    xt, wt = _t(x, device, dtype), _t(w, device, dtype)
    y = F.rms_norm(xt, (C,), wt, eps)
    _check(_np(y), xh * w, dtype)
    y.backward(_t(g, device, dtype, grad=False))
    _check(_np(xt.grad), gx_ref, dtype)
    _check(_np(wt.grad), (g * xh).sum(0), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope(device, dtype):
    B, T, H, D = 2, 9, 3, 16
    x = _bf16_round(rng.standard_normal((B, T, H, D)), dtype)
    g = _bf16_round(rng.standard_normal((B, T, H, D)), dtype)
    ang = np.outer(np.arange(T), 1.0 / 500.0 ** (np.arange(0, D, 2) / D))
    c, s = np.cos(ang), np.sin(ang)
    c32, s32 = c.astype(np.float32).astype(np.float64), s.astype(np.float32).astype(np.float64)

    def rot(a, sn):
        a1, a2 = a[..., :D // 2], a[..., D // 2:]
        return np.concatenate([a1 * c32[:, None] - a2 * sn[:, None], a2 * c32[:, None] + a1 * sn[:, None]], -1)

    xt = _t(x, device, dtype)
    y = F.rope(xt, bt.tensor(c.astype(np.float32), device=device), bt.tensor(s.astype(np.float32), device=device))
    assert y.dtype == getattr(bt, dtype)
    _check(_np(y), rot(x, s32), dtype)
    y.backward(_t(g, device, dtype, grad=False))
    _check(_np(xt.grad), rot(g, -s32), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(device, dtype):
    a = _bf16_round(rng.standard_normal((5, 333)) * 3, dtype)
    b = _bf16_round(rng.standard_normal((5, 333)), dtype)
    g = _bf16_round(rng.standard_normal((5, 333)), dtype)
    sg = 1 / (1 + np.exp(-a))
    at, bt_ = _t(a, device, dtype), _t(b, device, dtype)
    y = F.swiglu(at, bt_)
    _check(_np(y), a * sg * b, dtype)
    y.backward(_t(g, device, dtype, grad=False))
    _check(_np(at.grad), g * b * sg * (1 + a * (1 - sg)), dtype)
    _check(_np(bt_.grad), g * a * sg, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_attention(device, dtype):
    B, Hq, Hk, T, E = 2, 8, 2, 33, 64
    q, k, v = (_bf16_round(rng.standard_normal((B, h, T, E)), dtype) for h in (Hq, Hk, Hk))
    g = _bf16_round(rng.standard_normal((B, Hq, T, E)), dtype)
    kr, vr = np.repeat(k, Hq // Hk, axis=1), np.repeat(v, Hq // Hk, axis=1)
    s = q @ kr.swapaxes(-1, -2) / np.sqrt(E) + np.triu(np.full((T, T), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    gp = g @ vr.swapaxes(-1, -2)
    gs = p * (gp - (gp * p).sum(-1, keepdims=True)) / np.sqrt(E)
    gk = (gs.swapaxes(-1, -2) @ q).reshape(B, Hk, Hq // Hk, T, E).sum(2)
    gv = (p.swapaxes(-1, -2) @ g).reshape(B, Hk, Hq // Hk, T, E).sum(2)
    qt, kt, vt = (_t(a, device, dtype) for a in (q, k, v))
    y = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    _check(_np(y), p @ vr, dtype)
    y.backward(_t(g, device, dtype, grad=False))
    _check(_np(qt.grad), gs @ kr, dtype)
    _check(_np(kt.grad), gk, dtype)
    _check(_np(vt.grad), gv, dtype)


def test_kernel_classes_registered_and_entries_exist():
    from blutensor.cuda_ops import kernel_classes

    ops = {c.OP: c for c in kernel_classes()}
    for op, file, names in (("rms_norm", "rms_norm.cu", ("forward", "backward", "backward_dw", "backward_reduce")),
                            ("rope", "rope.cu", ("forward", "backward")),
                            ("swiglu", "swiglu.cu", ("forward", "backward"))):
        assert ops[op].BF16_NATIVE and set(ops[op].DTYPES) == {"float32", "bfloat16"}
        src = (KDIR / file).read_text()
        entries = set(re.findall(r'extern "C" __global__ void (blu_\w+)##SUF', src))
        assert entries == {f"blu_{op}_{n}_" for n in names}, entries
        assert "RMS_ENTRIES(bf16" in src or "_ENTRIES(bf16, bf16_t)" in src
