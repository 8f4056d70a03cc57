"""F.add_rms_norm (the residual add fused with RMSNorm, two results) against a float64 NumPy reference.

CPU: the op's NumPy path (float32, float64) forward and backward with gradients reaching y, h or both, no weight,
the op-by-op path (CPU autocast), errors. Fake CuPy: the CUDA wrappers' launches checked against the C signatures
of kernels/add_rms_norm.cu for every storage mix, the kernels emulated in NumPy. GPU (cuda-marked): the fused kernels
in fp32, bf16 and autocast's mix (bf16 x, fp32 residual, bf16 y) against the same reference.
"""

from __future__ import annotations

import re
from pathlib import Path

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
import pytest

KDIR = Path(bt.__file__).resolve().parent / "backends" / "cupy" / "kernels"
rng = np.random.default_rng(3)


def _cuda_ok() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _reference(x, r, w, gy, gh, eps):
    """float64 (h, y, dx = dr, dw); gy / gh None: no gradient there."""
    h = x + r
    rstd = 1 / np.sqrt((h * h).mean(-1, keepdims=True) + eps)
    hh = h * rstd
    wv = 1.0 if w is None else w
    y = hh * wv
    d = np.zeros_like(h) if gh is None else gh.copy()
    dw = np.zeros(h.shape[-1])
    if gy is not None:
        gw = gy * wv
        d += rstd * (gw - hh * (gw * hh).mean(-1, keepdims=True))
        dw = (gy * hh).reshape(-1, h.shape[-1]).sum(0)
    return h, y, d, dw


def _backward(h, y, gh, gy):
    """Backpropagate gh into h and gy into y (either None: that result gets no gradient)."""
    pairs = [(t, bt.tensor(g.astype(t.dtype.name), device=t.device)) for t, g in ((h, gh), (y, gy)) if g is not None]
    loss = None
    for t, g in pairs:  # d/dt sum(t * g) = g exactly
        part = (t * g).sum().to(bt.float32)
        loss = part if loss is None else loss + part
    loss.backward()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("grads", ["both", "y", "h"])
@pytest.mark.parametrize("weight", [True, False])
def test_matches_float64_reference_cpu(dtype, grads, weight):
    shape, C = (2, 7, 48), 48
    x, r, gy, gh = (rng.standard_normal(shape) for _ in range(4))
    w = 1 + 0.1 * rng.standard_normal(C) if weight else None
    gy = gy if grads in ("both", "y") else None
    gh = gh if grads in ("both", "h") else None
    eps = 1e-5
    xt, rt = (bt.tensor(a.astype(dtype), requires_grad=True) for a in (x, r))
    wt = bt.tensor(w.astype(dtype), requires_grad=True) if weight else None
    h, y = F.add_rms_norm(xt, rt, C, wt, eps)
    assert (h.grad_fn.op, y.grad_fn.op) == ("add_rms_norm_sum", "add_rms_norm")  # the fused path ran
    assert h.dtype.name == y.dtype.name == dtype
    xr, rr = (a.astype(dtype).astype(np.float64) for a in (x, r))
    wr = None if w is None else w.astype(dtype).astype(np.float64)
    H, Y, D, DW = _reference(xr, rr, wr, gy, gh, eps)
    tol = 1e-5 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(h.detach().numpy(), H, rtol=tol, atol=tol)
    np.testing.assert_allclose(y.detach().numpy(), Y, rtol=tol, atol=tol)
    _backward(h, y, gh, gy)
    np.testing.assert_allclose(xt.grad.numpy(), D, rtol=tol, atol=tol * 10)
    np.testing.assert_allclose(rt.grad.numpy(), D, rtol=tol, atol=tol * 10)
    if weight:
        np.testing.assert_allclose(wt.grad.numpy(), DW, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("grads", ["both", "y", "h"])
def test_compiled_cpu_kernels_equal_the_numpy_reference(monkeypatch, grads):
    from blutensor.backends.numpy import available
    from blutensor.backends.numpy import residual_norm as ck

    if not available():
        pytest.skip("no C compiler: the compiled CPU kernels are not built")
    N, C = 70, 40  # 3 row blocks of the dweight partials
    x, r, gy, gh = (rng.standard_normal((N, C)).astype(np.float32) for _ in range(4))
    w = (1 + 0.1 * rng.standard_normal(C)).astype(np.float32)
    gy = gy if grads != "h" else None
    gh = gh if grads != "y" else None

    def run():
        ts = [bt.tensor(a, requires_grad=True) for a in (x, r, w)]
        h, y = F.add_rms_norm(*ts[:2], C, ts[2], 1e-5)
        kind = y.grad_fn.ctx.saved[3]
        _backward(h, y, gh, gy)
        return kind, [h.detach().numpy(), y.detach().numpy()] + [t.grad.numpy() for t in ts]

    kind_c, got = run()
    monkeypatch.setattr(ck, "usable", lambda *a: False)
    kind_np, want = run()
    assert (kind_c, kind_np) == ("c", "numpy")
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
    H, Y, D, DW = _reference(*(a.astype(np.float64) for a in (x, r, w)), gy, gh, 1e-5)
    for a, b in zip(got, (H, Y, D, D, DW)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=5e-5)


def test_equals_add_then_rms_norm_and_inplace_h_is_refused():
    x, r = (bt.tensor(rng.standard_normal((3, 16)).astype(np.float32), requires_grad=True) for _ in range(2))
    w = bt.tensor((1 + 0.1 * rng.standard_normal(16)).astype(np.float32), requires_grad=True)
    h, y = F.add_rms_norm(x, r, (16,), w)  # eps None: float32's machine epsilon, as F.rms_norm
    ref = F.rms_norm(x.detach() + r.detach(), (16,), w.detach())
    np.testing.assert_allclose(y.detach().numpy(), ref.numpy(), rtol=1e-6, atol=1e-6)
    h2, y2 = F.add_rms_norm(x, r, 16, w)
    with bt.no_grad():
        h2.mul_(2.0)
    with pytest.raises(bt.AutogradError, match="add_rms_norm"):
        y2.sum().backward()


def test_cpu_autocast_gives_bf16_y_and_fp32_h():
    x = bt.tensor(rng.standard_normal((4, 32)).astype(np.float32), requires_grad=True)
    r = bt.tensor(rng.standard_normal((4, 32)).astype(np.float32), requires_grad=True)
    with bt.autocast("cpu", dtype=bt.bfloat16):
        h, y = F.add_rms_norm(x.to(bt.bfloat16), r, 32, None, 1e-6)
    assert h.dtype == bt.float32 and y.dtype == bt.bfloat16
    H, Y, _, _ = _reference(x.detach().to(bt.bfloat16).to(bt.float32).numpy().astype(np.float64),
                            r.detach().numpy().astype(np.float64), None, None, None, 1e-6)
    np.testing.assert_allclose(h.detach().numpy(), H, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y.detach().to(bt.float32).numpy(), Y, rtol=1e-2, atol=1e-2)
    (y.to(bt.float32).sum() + h.sum()).backward()
    assert x.grad.shape == (4, 32) and np.isfinite(r.grad.numpy()).all()


@pytest.mark.parametrize("args,msg", [
    (((2, 8), (2, 9), 8), r"x \(2, 8\) and residual \(2, 9\) must have one shape"),
    (((2, 8), (2, 8), 4), r"does not end with normalized_shape \(4,\)"),
    (((2, 8), (2, 8), 8, (9,)), r"weight must be a \(8,\) Tensor"),
])
def test_bad_input(args, msg):
    x, r = bt.zeros(*args[0]), bt.zeros(*args[1])
    w = bt.ones(*args[3]) if len(args) > 3 else None
    with pytest.raises(bt.ShapeError, match=msg):
        F.add_rms_norm(x, r, args[2], w)
    with pytest.raises(bt.ArgumentError, match="eps must be a non-negative number"):
        F.add_rms_norm(bt.zeros(2, 8), bt.zeros(2, 8), 8, None, -1.0)


# ------------------------------------------------ the CUDA wrappers on CPU: launch contract and data routing
_CTYPES = {"long long": np.int64, "int": np.int32, "float": np.float32}
_TYPES = {"float": np.float32, "bf16_t": np.uint16, "TX": None}


def _signatures() -> dict[str, list[str]]:
    """kernel name -> C parameter types (template types resolved), from add_rms_norm.cu's macros."""
    src = (KDIR / "add_rms_norm.cu").read_text().replace("\\\n", " ")
    macros = {m.group(1): (m.group(2).split(","), m.group(3)) for m in re.finditer(
        r"#define (ADD_RMS_ENTRIES|ADD_RMS_DW|ADD_RMS_REDUCE)\(([^)]*)\)(.*?)(?=#define|\n\n)", src, re.S)}
    out = {}
    uses = re.findall(r"^(ADD_RMS_W|ADD_RMS_DW|ADD_RMS_REDUCE)\(([^)]*)\)", src, re.M)
    calls = []
    for mac, args in uses:
        a = [s.strip() for s in args.split(",")]
        if mac == "ADD_RMS_W":
            for sw, tw in (("f32", "float"), ("bf16", "bf16_t")):
                calls.append(("ADD_RMS_ENTRIES", [f"{a[0]}_{a[2]}_{a[4]}_{sw}", a[1], a[3], a[5], tw]))
        else:
            calls.append((mac, a))
    for mac, a in calls:
        params, body = macros[mac]
        sub = dict(zip((p.strip() for p in params), a))
        for m in re.finditer(r'extern "C" __global__ void (blu_\w+)##SUF\(([^)]*)\)', body):
            types = []
            for p in m.group(2).split(","):
                t = " ".join(p.split()[:-1]).replace("const ", "")
                star = t.endswith("*")
                base = t.rstrip("*").strip()
                types.append(sub.get(base, base) + ("*" if star else ""))
            out[m.group(1) + sub["SUF"]] = types
    for m in re.finditer(r'extern "C" __global__ void (blu_add_rms_norm_\w+)\(([^)]*)\)', src):  # no macro
        out[m.group(1)] = [" ".join(p.split()[:-1]).replace("const ", "") for p in m.group(2).split(",")]
    return out


def _f(a):
    return a.astype(np.float32) if a.dtype != np.uint16 else (a.astype(np.uint32) << 16).view(np.float32)


def _put(dst, v):
    v = np.asarray(v, np.float32)
    dst[...] = (v.view(np.uint32) + 0x7FFF + ((v.view(np.uint32) >> 16) & 1) >> 16).astype(np.uint16) \
        if dst.dtype == np.uint16 else v


def _emulate(name, args):
    nul = lambda a: a is None or (isinstance(a, np.uint64) and a == 0)  # noqa: E731
    if name.startswith("blu_add_rms_norm_forward_"):
        x, r, w, h, y, rstd, N, C, eps = args
        _put(h, _f(x) + _f(r))
        rs = 1 / np.sqrt((_f(h) ** 2).mean(-1) + eps)
        rstd[...] = rs
        _put(y, _f(h) * rs[:, None] * (1 if nul(w) else _f(w)))
    elif name.startswith("blu_add_rms_norm_backward_dw_"):
        gy, h, rstd, part, N, C = args
        S = part.shape[0]
        for s in range(S):
            part[s] = (_f(gy)[s::S] * _f(h)[s::S] * rstd[s::S, None]).sum(0)
    elif name == "blu_add_rms_norm_backward_reduce_acc":  # dw (a float32 .grad buffer) += the sum
        part, dw, S, C = args
        dw += part[:S].sum(0)
    elif name.startswith("blu_add_rms_norm_backward_reduce_"):
        part, dw, S, C = args
        _put(dw, part[:S].sum(0))
    elif name.startswith("blu_add_rms_norm_backward_"):
        gy, gh, h, w, rstd, dres, dx, N, C = args
        d = np.zeros(h.shape, np.float32) if nul(gh) else _f(gh).copy()
        if not nul(gy):
            gw = _f(gy) * (1 if nul(w) else _f(w))
            hh = _f(h) * rstd[:, None]
            d += rstd[:, None] * (gw - hh * (gw * hh).mean(-1, keepdims=True))
        _put(dres, d)
        if not nul(dx):
            _put(dx, d)
    else:
        raise AssertionError(f"unknown kernel {name}")


@pytest.fixture
def fake_cuda(monkeypatch):
    from blutensor.backends.cupy import decoder

    sigs = _signatures()
    launched = []

    def launch(file, name, grid, block, args, shared_mem=0):
        assert file == "add_rms_norm.cu"
        types = sigs[name]
        assert len(args) == len(types), (name, len(args), types)
        for a, t in zip(args, types):
            if t.endswith("*"):
                assert isinstance(a, np.ndarray) or (isinstance(a, np.uint64) and a == 0), (name, t, type(a))
                if isinstance(a, np.ndarray):
                    assert a.dtype == _TYPES[t[:-1].strip()], (name, t, a.dtype)
                    assert a.flags.c_contiguous, name
            else:
                assert type(a) is _CTYPES[t], (name, t, type(a))
        launched.append(name)
        _emulate(name, args)

    from blutensor.backends.cupy import layer_norm

    monkeypatch.setattr(layer_norm, "USE_REG_ROWS", False)  # the warp-per-row kernels (the register-resident
    # entries are checked with add_layer_norm's in test_add_layer_norm.py)
    monkeypatch.setattr(decoder, "cupy", lambda: np)
    monkeypatch.setattr(decoder, "num_sms", lambda: 4)
    monkeypatch.setattr(decoder, "launch", launch)
    return decoder, launched, sigs


def _store(a, s):
    if s == "f32":
        return a.astype(np.float32)
    out = np.empty(a.shape, np.uint16)
    _put(out, a.astype(np.float32))
    return out


@pytest.mark.parametrize("mix", ["f32_f32_f32_f32", "bf16_bf16_bf16_bf16", "bf16_f32_bf16_f32", "f32_f32_bf16_bf16"])
def test_cuda_wrappers_route_data_through_the_kernels(fake_cuda, mix):
    dec, launched, sigs = fake_cuda
    assert len([n for n in sigs if n.startswith("blu_add_rms_norm_forward_")]) == 16
    sx, sh, sy, sw = mix.split("_")
    N, C = 10, 40
    x, r, gy, gh = (rng.standard_normal((N, C)) for _ in range(4))
    w = 1 + 0.1 * rng.standard_normal(C)
    xs, rs_, ws, gys, ghs = _store(x, sx), _store(r, sh), _store(w, sw), _store(gy, sy), _store(gh, sh)
    y_dt = np.uint16 if sy == "bf16" else np.float32
    h, y, rstd = dec.add_rms_norm_forward(xs, rs_, ws, 1e-5, y_dt)
    assert h.dtype == rs_.dtype and y.dtype == y_dt
    H, Y, D, DW = _reference(_f(xs).astype(np.float64), _f(rs_).astype(np.float64), _f(ws).astype(np.float64),
                             _f(gys).astype(np.float64), _f(ghs).astype(np.float64), 1e-5)
    tol = 2e-5 if mix == "f32_f32_f32_f32" else 3e-2
    np.testing.assert_allclose(_f(h), H, rtol=tol, atol=tol)
    np.testing.assert_allclose(_f(y), Y, rtol=tol, atol=tol)
    dres, dx, dw = dec.add_rms_norm_backward(gys, ghs, h, ws, rstd, xs.dtype, True)
    assert (dx is None) == (sx == sh) and dw.dtype == ws.dtype
    for got in (dres,) if dx is None else (dres, dx):
        np.testing.assert_allclose(_f(got), D, rtol=tol, atol=tol * 4)
    np.testing.assert_allclose(_f(dw), DW, rtol=tol, atol=tol * 10)
    dres2, _, dw2 = dec.add_rms_norm_backward(None, ghs, h, ws, rstd, xs.dtype, True)  # only h got a gradient
    np.testing.assert_allclose(_f(dres2), _f(ghs), rtol=tol, atol=tol)
    assert not dw2.any()
    assert launched[:4] == [f"blu_add_rms_norm_forward_{mix}", f"blu_add_rms_norm_backward_{mix}",
                            f"blu_add_rms_norm_backward_dw_{sy}_{sh}", f"blu_add_rms_norm_backward_reduce_{sw}"]
    buf = rng.standard_normal(C).astype(np.float32)  # a float32 .grad buffer: dw is added into it
    before = buf.copy()
    _, _, dw3 = dec.add_rms_norm_backward(gys, ghs, h, ws, rstd, xs.dtype, True, buf)
    assert dw3 is buf and launched[-1] == "blu_add_rms_norm_backward_reduce_acc"
    np.testing.assert_allclose(buf, before + DW, rtol=tol, atol=tol * 10)
    _, _, dw4 = dec.add_rms_norm_backward(None, ghs, h, ws, rstd, xs.dtype, True, buf)  # no gradient of y: adds 0
    assert dw4 is buf
    np.testing.assert_allclose(buf, before + DW, rtol=tol, atol=tol * 10)


# ------------------------------------------------ the fused kernels on the GPU
@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_ok(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("mode", ["fp32", "bf16", "autocast"])
@pytest.mark.parametrize("C", [64, 200, 2048])
def test_cuda_kernels_match_float64(mode, C):
    shape = (3, 13, C)
    x, r, gy, gh = (rng.standard_normal(shape) for _ in range(4))
    w = 1 + 0.1 * rng.standard_normal(C)
    low = mode != "fp32"
    def bf(a):
        return bt.tensor(a.astype(np.float32)).to(bt.bfloat16).to(bt.float32).numpy().astype(np.float64)

    xr = bf(x) if low else x.astype(np.float32).astype(np.float64)
    rr = bf(r) if mode == "bf16" else r.astype(np.float32).astype(np.float64)
    wr = bf(w) if mode == "bf16" else w.astype(np.float32).astype(np.float64)

    def dev(a, lowp):
        t = bt.tensor(a.astype(np.float32), device="cuda")
        t = (t.to(bt.bfloat16) if lowp else t).detach()
        t.requires_grad = True
        return t

    xt, rt, wt = dev(x, low), dev(r, mode == "bf16"), dev(w, mode == "bf16")
    if mode == "autocast":
        with bt.autocast("cuda", dtype=bt.bfloat16):
            h, y = F.add_rms_norm(xt, rt, C, wt, 1e-5)
    else:
        h, y = F.add_rms_norm(xt, rt, C, wt, 1e-5)
    assert y.grad_fn.op == "add_rms_norm"
    assert y.dtype == (bt.bfloat16 if low else bt.float32) and h.dtype == rt.dtype
    H, Y, _, _ = _reference(xr, rr, wr, None, None, 1e-5)
    tol = 2e-5 if mode == "fp32" else 3e-2
    np_ = lambda t: t.detach().to(bt.float32).to("cpu").numpy().astype(np.float64)  # noqa: E731
    scale = lambda a: max(1.0, float(np.abs(a).max()))  # noqa: E731
    np.testing.assert_allclose(np_(h), H, rtol=tol, atol=tol * scale(H))
    np.testing.assert_allclose(np_(y), Y, rtol=tol, atol=tol * scale(Y))
    gyt = bt.tensor(gy.astype(np.float32), device="cuda").to(y.dtype)
    ght = bt.tensor(gh.astype(np.float32), device="cuda").to(h.dtype)
    ((y * gyt).sum().to(bt.float32) + (h * ght).sum().to(bt.float32)).backward()
    _, _, Dr, DW = _reference(xr, rr, wr, np_(gyt), np_(ght), 1e-5)
    for t in (xt, rt):
        assert t.grad.dtype == t.dtype
        np.testing.assert_allclose(np_(t.grad), Dr, rtol=tol, atol=tol * scale(Dr))
    np.testing.assert_allclose(np_(wt.grad), DW, rtol=tol, atol=tol * scale(DW) * 4)
