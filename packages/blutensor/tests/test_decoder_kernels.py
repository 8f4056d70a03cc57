"""rms_norm, rope, swiglu and GQA attention against float64 NumPy references, fp32 and bf16, forward and backward.

The ``cuda`` cases run the fused kernels of backends/cupy/decoder.py (kernels/rms_norm.cu, rope.cu, swiglu.cu) and
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
KDIR = Path(bt.__file__).resolve().parent / "backends" / "cupy" / "kernels"
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
@pytest.mark.parametrize("transpose", [False, True])
def test_rope(device, dtype, transpose):
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
    y = F.rope(xt, bt.tensor(c.astype(np.float32), device=device), bt.tensor(s.astype(np.float32), device=device),
               transpose=transpose)
    assert y.dtype == getattr(bt, dtype)
    want = rot(x, s32)
    if transpose:  # (B, H, T, D), contiguous: attention's layout
        want, g = want.swapaxes(1, 2), g.swapaxes(1, 2)
        assert y.shape == (B, H, T, D) and y.is_contiguous()
    _check(_np(y), want, dtype)
    y.backward(_t(g, device, dtype, grad=False))
    _check(_np(xt.grad), rot(g.swapaxes(1, 2) if transpose else g, -s32), dtype)


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
    from blutensor.backends.cupy import kernel_classes

    ops = {c.OP: c for c in kernel_classes()}
    for op, file, names in (("rms_norm", "rms_norm.cu", ("forward", "backward", "backward_dw", "backward_reduce")),
                            ("rope", "rope.cu", ("forward", "backward", "forward_t", "backward_t")),
                            ("swiglu", "swiglu.cu", ("forward", "backward"))):
        assert ops[op].BF16_NATIVE and set(ops[op].DTYPES) == {"float32", "bfloat16"}
        src = (KDIR / file).read_text()
        entries = set(re.findall(r'extern "C" __global__ void (blu_\w+)##SUF', src))
        assert entries == {f"blu_{op}_{n}_" for n in names}, entries
        assert "RMS_ENTRIES(bf16" in src or "_ENTRIES(bf16, bf16_t)" in src


# ------------------------------------------------ the CUDA wrappers on CPU: launch contract and data routing
_CTYPES = {"long long": np.int64, "int": np.int32, "float": np.float32}


def _signatures() -> dict[str, list[str]]:
    """kernel name -> C parameter types, from the ENTRIES macros of the three .cu files."""
    out = {}
    for f in ("rms_norm.cu", "rope.cu", "swiglu.cu"):
        src = (KDIR / f).read_text().replace("\\\n", " ")
        for m in re.finditer(r'extern "C" __global__ void (blu_\w+)##SUF\(([^)]*)\)', src):
            types = [" ".join(p.split()[:-1]).replace("const ", "") for p in m.group(2).split(",")]
            for sfx in ("f32", "bf16"):
                out[m.group(1) + sfx] = types
        for m in re.finditer(r'extern "C" __global__ void (blu_\w+)\(([^)]*)\)', src):  # entries outside macros
            out[m.group(1)] = [" ".join(p.split()[:-1]).replace("const ", "") for p in m.group(2).split(",")]
    return out


def _emulate(name, args):
    """What each kernel computes, in NumPy (fp32 math), writing into the output arrays the wrapper passed."""
    f = lambda a: a.astype(np.float32) if a.dtype != np.uint16 else (a.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
    bf = name.endswith("bf16")

    def put(dst, v):
        dst[...] = (np.asarray(v, np.float32).view(np.uint32) + 0x8000 >> 16).astype(np.uint16) if bf else v

    base = name.rsplit("_", 1)[0]
    nul = lambda a: a is None or (isinstance(a, np.uint64) and a == 0)  # noqa: E731
    if base == "blu_rms_norm_forward":
        x, w, y, rstd, N, C, eps = args
        rs = 1 / np.sqrt((f(x) ** 2).mean(-1) + eps)
        rstd[...] = rs
        put(y, f(x) * rs[:, None] * (1 if nul(w) else f(w)))
    elif base == "blu_rms_norm_backward":
        g, x, w, rstd, dx, N, C = args
        gw = f(g) * (1 if nul(w) else f(w))
        xh = f(x) * rstd[:, None]
        put(dx, rstd[:, None] * (gw - xh * (gw * xh).mean(-1, keepdims=True)))
    elif base == "blu_rms_norm_backward_dw":
        g, x, rstd, part, N, C = args
        S = part.shape[0]
        for s in range(S):
            part[s] = (f(g)[s::S] * f(x)[s::S] * rstd[s::S, None]).sum(0)
    elif name == "blu_rms_norm_backward_reduce_acc":  # dw (a float32 .grad buffer) += the sum
        part, dw, S, C = args
        dw += part[:S].sum(0)
    elif base == "blu_rms_norm_backward_reduce":
        part, dw, S, C = args
        put(dw, part[:S].sum(0))
    elif base in ("blu_rope_forward", "blu_rope_backward", "blu_rope_forward_t", "blu_rope_backward_t"):
        x, cs, sn, y, pairs, T, H, h2 = args
        sign = 1 if "forward" in base else -1
        if base == "blu_rope_backward_t":  # reads (B, H, T, D), writes (B, T, H, D)
            xx = f(x).reshape(-1, H, T, 2 * h2).swapaxes(1, 2)
        else:
            xx = f(x).reshape(-1, T, H, 2 * h2)
        c, s = cs[:, None, :], sign * sn[:, None, :]
        out = np.concatenate([xx[..., :h2] * c - xx[..., h2:] * s, xx[..., h2:] * c + xx[..., :h2] * s], -1)
        put(y, (out.swapaxes(1, 2) if base == "blu_rope_forward_t" else out).reshape(y.shape))
    elif base == "blu_swiglu_forward":
        gate, up, y, n, vec = args
        put(y, f(gate) / (1 + np.exp(-f(gate))) * f(up))
    elif base == "blu_swiglu_backward":
        dy, gate, up, dg, du, n, vec = args
        s = 1 / (1 + np.exp(-f(gate)))
        if not nul(dg):
            put(dg, f(dy) * f(up) * s * (1 + f(gate) * (1 - s)))
        if not nul(du):
            put(du, f(dy) * f(gate) * s)
    else:
        raise AssertionError(f"unknown kernel {name}")


@pytest.fixture
def fake_cuda(monkeypatch):
    """backends.cupy.decoder with NumPy as its array module and each launch checked against the kernel's C signature
    (argument count, scalar types, pointers), then emulated."""
    from blutensor.backends.cupy import decoder

    sigs = _signatures()
    launched = []

    def launch(file, name, grid, block, args, shared_mem=0):
        types = sigs[name]
        assert len(args) == len(types), (name, len(args), types)
        for a, t in zip(args, types):
            if t.endswith("*"):
                assert isinstance(a, np.ndarray) or (isinstance(a, np.uint64) and a == 0), (name, t, type(a))
                if isinstance(a, np.ndarray) and t.split()[0] in ("float", "bf16_t"):
                    assert a.dtype == (np.float32 if t.startswith("float") else np.uint16), (name, t, a.dtype)
                    assert a.flags.c_contiguous, name
            else:
                assert type(a) is _CTYPES[t], (name, t, type(a))
        launched.append(name)
        _emulate(name, args)

    monkeypatch.setattr(decoder, "cupy", lambda: np)
    monkeypatch.setattr(decoder, "num_sms", lambda: 4)
    monkeypatch.setattr(decoder, "launch", launch)
    return decoder, launched


def _bits(a):
    return bt.tensor(a.astype(np.float32)).to(bt.bfloat16).numpy().view(np.uint16)


def _unbits(b):
    return (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("storage", ["f32", "bf16"])
def test_cuda_wrappers_route_data_through_the_kernels(fake_cuda, storage):
    from blutensor.autograd.node import Ctx

    dec, launched = fake_cuda
    conv = (lambda a: a.astype(np.float32)) if storage == "f32" else _bits
    back = (lambda a: a.astype(np.float64)) if storage == "f32" else _unbits
    tol = TOL["float32" if storage == "f32" else "bfloat16"]
    x, w, g = rng.standard_normal((3, 5, 40)), 1 + rng.standard_normal(40) * 0.1, rng.standard_normal((3, 5, 40))
    xr, wr, gr = (back(conv(a)) for a in (x, w, g))
    ctx = Ctx()
    ctx.needs = (True, True)
    y = dec.RmsNormCuda.forward(ctx, conv(x), conv(w), normalized_shape=(40,), eps=1e-5)
    rs = 1 / np.sqrt((xr ** 2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(back(y), xr * rs * wr, atol=tol * 4, rtol=tol)
    dx, dw = dec.RmsNormCuda.backward(ctx, conv(g))
    xh = xr * rs
    np.testing.assert_allclose(back(dx), rs * (gr * wr - xh * (gr * wr * xh).mean(-1, keepdims=True)),
                               atol=tol * 8, rtol=tol)
    np.testing.assert_allclose(back(dw), (gr * xh).sum((0, 1)), atol=tol * 40, rtol=tol)
    buf = rng.standard_normal(40).astype(np.float32)  # the weight's float32 .grad buffer the engine offers
    before = buf.copy()
    ctx.grad_into, n0 = (None, buf), len(launched)
    dx2, acc = dec.RmsNormCuda.backward(ctx, conv(g))  # dw added into buf by the accumulating reduction
    ctx.grad_into = None
    from blutensor.autograd.node import ACCUMULATED

    assert acc is ACCUMULATED and launched[-1] == "blu_rms_norm_backward_reduce_acc"
    del launched[n0:]  # the launch count below is that of the calls without a buffer
    np.testing.assert_array_equal(dx2, dx)
    np.testing.assert_allclose(buf, before + (gr * xh).sum((0, 1)), atol=tol * 40, rtol=tol)
    q = rng.standard_normal((2, 6, 3, 8))
    ang = rng.standard_normal((6, 4)).astype(np.float32)
    ctx = Ctx()
    ctx.needs = (True, False, False)
    yq = dec.RopeCuda.forward(ctx, conv(q), np.cos(ang), np.sin(ang))
    assert back(yq).shape == q.shape
    gq, gc, gs = dec.RopeCuda.backward(ctx, yq)  # the inverse rotation brings x back
    assert gc is None and gs is None
    np.testing.assert_allclose(back(gq), back(conv(q)), atol=tol * 8, rtol=tol)
    ctx = Ctx()
    ctx.needs = (True, False, False)
    yt = dec.RopeCuda.forward(ctx, conv(q), np.cos(ang), np.sin(ang), transpose=True)
    np.testing.assert_array_equal(yt, yq.swapaxes(1, 2))  # the same rotation, laid out (B, H, T, D)
    gt, _, _ = dec.RopeCuda.backward(ctx, yt)
    np.testing.assert_array_equal(gt, gq)
    a, b = rng.standard_normal((4, 9)), rng.standard_normal((4, 9))
    ctx = Ctx()
    ctx.needs = (False, True)
    ys = dec.SwigluCuda.forward(ctx, conv(a), conv(b))
    ar, br = back(conv(a)), back(conv(b))
    np.testing.assert_allclose(back(ys), ar / (1 + np.exp(-ar)) * br, atol=tol * 4, rtol=tol)
    dga, dgb = dec.SwigluCuda.backward(ctx, conv(np.ones((4, 9))))
    assert dga is None  # not needed: not computed
    np.testing.assert_allclose(back(dgb), ar / (1 + np.exp(-ar)), atol=tol * 4, rtol=tol)
    assert {n.rsplit("_", 1)[1] for n in launched} == {storage} and len(launched) == 10
    assert {"blu_rope_forward_t_" + storage, "blu_rope_backward_t_" + storage} <= set(launched)
