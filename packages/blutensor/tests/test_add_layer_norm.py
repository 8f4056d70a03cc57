"""F.add_layer_norm (the residual add fused with LayerNorm, two results) against a float64 NumPy reference and
PyTorch, and bitwise against add + layer_norm.

CPU: the compiled float32 kernels and the NumPy path (float32, float64), forward and every gradient (x, residual,
weight, bias) with gradients reaching y, h or both; bitwise equality with ``residual + x`` then ``F.layer_norm``
(values and gradients); CPU autocast; errors. Fake CuPy: the CUDA wrappers' launches checked against the C
signatures of kernels/add_rms_norm.cu's blu_add_layer_norm_* entries for every storage mix, the kernels emulated
in NumPy. GPU (cuda-marked): the fused kernels in fp32, bf16 and autocast's mix against the reference, and bitwise
against add + layer_norm (+ autocast's cast).
"""

from __future__ import annotations

import re
from pathlib import Path

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
import pytest

KDIR = Path(bt.__file__).resolve().parent / "backends" / "cupy" / "kernels"
rng = np.random.default_rng(11)


def _cuda_ok() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _reference(x, r, w, b, gy, gh, eps):
    """float64 (h, y, d = dx = dr, dw, db); gy / gh None: no gradient there."""
    h = x + r
    mu = h.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(((h - mu) ** 2).mean(-1, keepdims=True) + eps)
    hh = (h - mu) * rstd
    wv = 1.0 if w is None else w
    y = hh * wv + (0.0 if b is None else b)
    C = h.shape[-1]
    d = np.zeros_like(h) if gh is None else gh.copy()
    dw, db = np.zeros(C), np.zeros(C)
    if gy is not None:
        gw = gy * wv
        d += rstd * (gw - gw.mean(-1, keepdims=True) - hh * (gw * hh).mean(-1, keepdims=True))
        dw = (gy * hh).reshape(-1, C).sum(0)
        db = gy.reshape(-1, C).sum(0)
    return h, y, d, dw, db


def _backward(h, y, gh, gy):
    """Backpropagate gh into h and gy into y (either None: that result gets no gradient)."""
    loss = None
    for t, g in ((h, gh), (y, gy)):
        if g is None:
            continue
        part = (t * bt.tensor(g.astype(t.dtype.name), device=t.device)).sum().to(bt.float32)
        loss = part if loss is None else loss + part
    loss.backward()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("grads", ["both", "y", "h"])
@pytest.mark.parametrize("affine", ["wb", "w", "none"])
def test_matches_float64_reference_cpu(dtype, grads, affine):
    shape, C = (2, 7, 48), 48
    x, r, gy, gh = (rng.standard_normal(shape) for _ in range(4))
    w = 1 + 0.1 * rng.standard_normal(C) if affine != "none" else None
    b = 0.1 * rng.standard_normal(C) if affine == "wb" else None
    gy = gy if grads in ("both", "y") else None
    gh = gh if grads in ("both", "h") else None
    xt, rt = (bt.tensor(a.astype(dtype), requires_grad=True) for a in (x, r))
    wt = None if w is None else bt.tensor(w.astype(dtype), requires_grad=True)
    bt_ = None if b is None else bt.tensor(b.astype(dtype), requires_grad=True)
    h, y = F.add_layer_norm(xt, rt, C, wt, bt_, 1e-5)
    assert (h.grad_fn.op, y.grad_fn.op) == ("add_layer_norm_sum", "add_layer_norm")  # the fused path ran
    from blutensor.backends.numpy import available

    assert y.grad_fn.ctx.saved[4] == ("c" if dtype == "float32" and available() else "numpy")
    assert h.dtype.name == y.dtype.name == dtype
    f64 = lambda a: None if a is None else a.astype(dtype).astype(np.float64)  # noqa: E731
    H, Y, D, DW, DB = _reference(f64(x), f64(r), f64(w), f64(b), gy, gh, 1e-5)
    tol = 2e-5 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(h.detach().numpy(), H, rtol=tol, atol=tol)
    np.testing.assert_allclose(y.detach().numpy(), Y, rtol=tol, atol=tol)
    _backward(h, y, gh, gy)
    for t in (xt, rt):
        np.testing.assert_allclose(t.grad.numpy(), D, rtol=tol, atol=tol * 10)
    if wt is not None:
        np.testing.assert_allclose(wt.grad.numpy(), DW, rtol=tol, atol=tol * 10)
    if bt_ is not None:
        np.testing.assert_allclose(bt_.grad.numpy(), DB, rtol=tol, atol=tol * 10)


def _run(fused, x, r, w, b, gy, gh, grad_buffers=False):
    """Values and gradients of the fused op or of ``r + x`` then layer_norm, float32 on CPU."""
    ts = [bt.tensor(a, requires_grad=True) for a in (x, r, w, b)]
    if grad_buffers:  # the engine then offers the .grad buffers to the kernels (GRAD_INTO)
        for t in ts[2:]:
            t.grad = bt.tensor(np.full(t.shape, 0.25, np.float32))
    if fused:
        h, y = F.add_layer_norm(ts[0], ts[1], x.shape[-1], ts[2], ts[3], 1e-5)
    else:
        h = ts[1] + ts[0]
        y = F.layer_norm(h, (x.shape[-1],), ts[2], ts[3], 1e-5)
    # the gradient of h reaches it through a later add, as a block's residual stream does
    out = (h * bt.tensor(gh)).sum() + (y * bt.tensor(gy)).sum()
    out.backward()
    return [h.detach().numpy(), y.detach().numpy()] + [t.grad.numpy() for t in ts]


@pytest.mark.parametrize("kernels", ["compiled", "numpy"])
@pytest.mark.parametrize("grad_buffers", [False, True])
def test_bitwise_equal_to_add_then_layer_norm_cpu(monkeypatch, kernels, grad_buffers):
    from blutensor.backends.numpy import _build

    if kernels == "numpy":
        monkeypatch.setattr(_build, "lib", lambda: None)
    elif _build.lib() is None:
        pytest.skip("no C compiler: the compiled CPU kernels are not built")
    N, C = 70, 40  # 3 row blocks of the dweight partials; C not a multiple of the 16 lanes
    x, r, gy, gh = (rng.standard_normal((N, C)).astype(np.float32) for _ in range(4))
    w = (1 + 0.1 * rng.standard_normal(C)).astype(np.float32)
    b = (0.1 * rng.standard_normal(C)).astype(np.float32)
    got = _run(True, x, r, w, b, gy, gh, grad_buffers)
    want = _run(False, x, r, w, b, gy, gh, grad_buffers)
    for name, a, e in zip(("h", "y", "dx", "dresidual", "dweight", "dbias"), got, want):
        assert np.array_equal(a, e), name


def test_matches_pytorch_cpu():
    torch = pytest.importorskip("torch")
    shape, C = (3, 5, 64), 64
    x, r, gy, gh = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
    w = (1 + 0.1 * rng.standard_normal(C)).astype(np.float32)
    b = (0.1 * rng.standard_normal(C)).astype(np.float32)
    ts = [bt.tensor(a, requires_grad=True) for a in (x, r, w, b)]
    h, y = F.add_layer_norm(ts[0], ts[1], (C,), ts[2], ts[3], 1e-5)
    _backward(h, y, gh, gy)
    qs = [torch.tensor(a, requires_grad=True) for a in (x, r, w, b)]
    th = qs[0] + qs[1]
    ty = torch.nn.functional.layer_norm(th, (C,), qs[2], qs[3], 1e-5)
    ((th * torch.tensor(gh)).sum() + (ty * torch.tensor(gy)).sum()).backward()
    for a, e in zip([h, y] + [t.grad for t in ts], [th, ty] + [q.grad for q in qs]):
        np.testing.assert_allclose(a.detach().numpy(), e.detach().numpy(), rtol=2e-5, atol=2e-5)


def test_cpu_autocast_gives_bf16_y_rounded_from_float32_layer_norm():
    x = bt.tensor(rng.standard_normal((4, 32)).astype(np.float32), requires_grad=True)
    r = bt.tensor(rng.standard_normal((4, 32)).astype(np.float32), requires_grad=True)
    w = bt.tensor((1 + 0.1 * rng.standard_normal(32)).astype(np.float32), requires_grad=True)
    with bt.autocast("cpu", dtype=bt.bfloat16):
        h, y = F.add_layer_norm(x.to(bt.bfloat16), r, 32, w, None, 1e-5)
        ref = F.layer_norm(r.detach() + x.detach().to(bt.bfloat16), (32,), w.detach(), None, 1e-5)
    assert h.dtype == bt.float32 and y.dtype == bt.bfloat16
    assert np.array_equal(y.detach().to(bt.float32).numpy(), ref.to(bt.bfloat16).to(bt.float32).numpy())
    (y.to(bt.float32).sum() + h.sum()).backward()
    assert x.grad.shape == (4, 32) and np.isfinite(r.grad.numpy()).all() and w.grad is not None


def test_inplace_change_of_h_is_refused():
    x, r = (bt.tensor(rng.standard_normal((3, 16)).astype(np.float32), requires_grad=True) for _ in range(2))
    h, y = F.add_layer_norm(x, r, 16)
    with bt.no_grad():
        h.mul_(2.0)
    with pytest.raises(bt.AutogradError, match="add_layer_norm"):
        y.sum().backward()


@pytest.mark.parametrize("args,msg", [
    (((2, 8), (2, 9), 8), r"x \(2, 8\) and residual \(2, 9\) must have one shape"),
    (((2, 8), (2, 8), 4), r"does not end with normalized_shape \(4,\)"),
    (((2, 8), (2, 8), 8, (9,)), r"weight must be a \(8,\) Tensor"),
    (((2, 8), (2, 8), 8, None, (3,)), r"bias must be a \(8,\) Tensor"),
])
def test_bad_input(args, msg):
    x, r = bt.zeros(*args[0]), bt.zeros(*args[1])
    w = bt.ones(*args[3]) if len(args) > 3 and args[3] else None
    b = bt.ones(*args[4]) if len(args) > 4 else None
    with pytest.raises(bt.ShapeError, match=msg):
        F.add_layer_norm(x, r, args[2], w, b)
    with pytest.raises(bt.ArgumentError, match="eps must be a non-negative number"):
        F.add_layer_norm(bt.zeros(2, 8), bt.zeros(2, 8), 8, None, None, -1.0)
    with pytest.raises(bt.ArgumentError, match="residual must be a Tensor"):
        F.add_layer_norm(bt.zeros(2, 8), np.zeros((2, 8)), 8)


# ------------------------------------------------ the CUDA wrappers on CPU: launch contract and data routing
_TYPES = {"float": np.float32, "bf16_t": np.uint16}
_CTYPES = {"long long": np.int64, "int": np.int32, "float": np.float32}


def _signatures() -> dict[str, list[str]]:
    """Register-resident kernel name (blu_add_layer_norm_* and blu_add_rms_norm_*) -> C parameter types, from
    add_rms_norm.cu's ADD_NORM_ENTRIES / ADD_LN_* macros."""
    src = (KDIR / "add_rms_norm.cu").read_text().replace("\\\n", " ")
    m = re.search(r"#define ADD_NORM_ENTRIES\(([^)]*)\)(.*?)(?=#define)", src, re.S)
    params = [p.strip() for p in m.group(1).split(",")]
    body = m.group(2)
    mixes = {}
    for mm in re.finditer(r"#define (ADD_LN_F32H|ADD_LN_BF16H)\(NV\)(.*?)(?=#define|\n\n)", src, re.S):
        mixes[mm.group(1)] = re.findall(r"ADD_LN_ENTRIES\(([^)]*)\)", mm.group(2))
    out = {}
    for mac, nvs in sorted(set(re.findall(r"\b(ADD_LN_F32H|ADD_LN_BF16H)\((\d)\)", src))):
        for call in mixes[mac]:
            a = [s.strip() for s in call.split(",")]
            for kind, ln in (("layer", "true"), ("rms", "false")):
                sub = dict(zip(params, [kind, ln, a[0], nvs] + a[2:]))
                for k in re.finditer(r'(blu_add_)##KIND##(_norm_\w+?)##NV##_##SUF\(([^)]*)\)', body):
                    types = []
                    for p in k.group(3).split(","):
                        t = " ".join(p.split()[:-1]).replace("const ", "")
                        base = t.rstrip("*").strip()
                        types.append(sub.get(base, base) + ("*" if t.endswith("*") else ""))
                    out[f"{k.group(1)}{kind}{k.group(2)}{nvs}_{sub['SUF']}"] = types
    return out


def _f(a):
    return a.astype(np.float32) if a.dtype != np.uint16 else (a.astype(np.uint32) << 16).view(np.float32)


def _put(dst, v):
    v = np.asarray(v, np.float32)
    dst[...] = (v.view(np.uint32) + 0x7FFF + ((v.view(np.uint32) >> 16) & 1) >> 16).astype(np.uint16) \
        if dst.dtype == np.uint16 else v


def _emulate(name, args):
    nul = lambda a: a is None or (isinstance(a, np.uint64) and a == 0)  # noqa: E731
    if name.startswith("blu_add_layer_norm_forward_"):
        x, r, w, b, h, y, mean, rstd, N, C, eps = args
        _put(h, _f(x) + _f(r))
        hv = _f(h)
        mean[...] = hv.mean(-1)
        rstd[...] = 1 / np.sqrt(((hv - mean[:, None]) ** 2).mean(-1) + eps)
        _put(y, (hv - mean[:, None]) * rstd[:, None] * (1 if nul(w) else _f(w)) + (0 if nul(b) else _f(b)))
    elif name.startswith("blu_add_layer_norm_backward_"):
        gy, gh, h, w, mean, rstd, dres, dx, part, N, C, want = args
        hh = (_f(h) - mean[:, None]) * rstd[:, None]
        g = _f(gy)
        gw = g * (1 if nul(w) else _f(w))
        d = rstd[:, None] * (gw - gw.mean(-1, keepdims=True) - hh * (gw * hh).mean(-1, keepdims=True))
        if not nul(gh):
            d = d + _f(gh)
        _put(dres, d)
        if not nul(dx):
            _put(dx, d)
        if want:
            part[...] = 0
            part[0, :C] = (g * hh).sum(0)
            part[0, C:] = g.sum(0)
    elif name.startswith("blu_add_rms_norm_forward_r"):
        x, r, w, b, h, y, mean, rstd, N, C, eps = args
        assert nul(b) and nul(mean)
        _put(h, _f(x) + _f(r))
        rstd[...] = 1 / np.sqrt((_f(h) ** 2).mean(-1) + eps)
        _put(y, _f(h) * rstd[:, None] * (1 if nul(w) else _f(w)))
    elif name.startswith("blu_add_rms_norm_backward_s"):
        gy, gh, h, w, mean, rstd, dres, dx, part, N, C, want = args
        assert nul(mean)
        hh = _f(h) * rstd[:, None]
        g = _f(gy)
        gw = g * (1 if nul(w) else _f(w))
        d = rstd[:, None] * (gw - hh * (gw * hh).mean(-1, keepdims=True)) + (0 if nul(gh) else _f(gh))
        _put(dres, d)
        if not nul(dx):
            _put(dx, d)
        if want:
            part[...] = 0
            part[0, :C] = (g * hh).sum(0)
    elif name.startswith("blu_layer_norm_backward_reduce_"):
        part, nblocks, C, dw, db = args
        s = part[:nblocks].sum(0)
        acc = name.endswith("_acc")
        for out, v in ((dw, s[:C]), (db, s[C:])):
            if not nul(out):
                _put(out, (out + v) if acc else v)
    else:
        raise AssertionError(f"unknown kernel {name}")


@pytest.fixture
def fake_cuda(monkeypatch):
    from blutensor.backends.cupy import layer_norm as k

    sigs = _signatures()
    launched = []

    def launch(file, name, grid, block, args, shared_mem=0):
        if name.startswith("blu_layer_norm_backward_reduce_"):
            assert file == "layer_norm.cu" and len(args) == 5
        else:
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

    from blutensor.backends.cupy import decoder

    monkeypatch.setattr(k, "cupy", lambda: np)
    monkeypatch.setattr(k, "full_grid", lambda file, name, block, work, smem=0: 1)
    monkeypatch.setattr(k, "launch", launch)
    monkeypatch.setattr(k, "add_norm_aligned", lambda *a: True)  # NumPy arrays: no device pointers to check
    monkeypatch.setattr(decoder, "cupy", lambda: np)
    monkeypatch.setattr(decoder, "launch", launch)
    return k, launched, sigs


def _store(a, s):
    if s == "f32":
        return a.astype(np.float32)
    out = np.empty(a.shape, np.uint16)
    _put(out, a.astype(np.float32))
    return out


@pytest.mark.parametrize("mix", ["f32_f32_f32_f32", "bf16_f32_bf16_f32", "f32_f32_bf16_f32", "bf16_bf16_bf16_bf16"])
@pytest.mark.parametrize("into", [False, True])
def test_cuda_wrappers_route_data_through_the_kernels(fake_cuda, mix, into):
    k, launched, sigs = fake_cuda
    assert len([n for n in sigs if n.startswith("blu_add_layer_norm_forward_")]) == 6 * 3 + 4
    assert len([n for n in sigs if n.startswith("blu_add_rms_norm_forward_r")]) == 6 * 3 + 4
    sx, sh, sy, sw = mix.split("_")
    N, C = 10, 64
    x, r, gy, gh = (rng.standard_normal((N, C)) for _ in range(4))
    w, b = 1 + 0.1 * rng.standard_normal(C), 0.1 * rng.standard_normal(C)
    xs, rs_, ws, bs, gys, ghs = _store(x, sx), _store(r, sh), _store(w, sw), _store(b, sw), _store(gy, sy), \
        _store(gh, sh)
    y_dt = np.uint16 if sy == "bf16" else np.float32
    assert k.add_norm_nv(C, xs.dtype, rs_.dtype, y_dt, ws.dtype) == 1
    assert k.add_norm_nv(C + 2, xs.dtype, rs_.dtype, y_dt, ws.dtype) is None  # not whole vectors of h
    h, y, mean, rstd = k.add_layer_norm_forward(xs, rs_, ws, bs, 1e-5, y_dt)
    assert h.dtype == rs_.dtype and y.dtype == y_dt
    f64 = lambda a: _f(a).astype(np.float64)  # noqa: E731
    H, Y, D, DW, DB = _reference(f64(xs), f64(rs_), f64(ws), f64(bs), f64(gys), f64(ghs), 1e-5)
    tol = 2e-5 if mix == "f32_f32_f32_f32" else 3e-2
    np.testing.assert_allclose(_f(h), H, rtol=tol, atol=tol)
    np.testing.assert_allclose(_f(y), Y, rtol=tol, atol=tol)
    bufs = (np.full(C, 0.5, np.float32), np.full(C, -0.5, np.float32)) if into else (None, None)
    dres, dx, dw, db = k.add_layer_norm_backward(gys, ghs, h, ws, mean, rstd, xs.dtype, True, True, *bufs)
    assert (dx is None) == (sx == sh)
    for got in (dres,) if dx is None else (dres, dx):
        np.testing.assert_allclose(_f(got), D, rtol=tol, atol=tol * 4)
    if into:
        assert np.shares_memory(dw, bufs[0]) and np.shares_memory(db, bufs[1])  # added into the buffers
        DW, DB = DW + 0.5, DB - 0.5
    else:
        assert dw.dtype == db.dtype == ws.dtype
    np.testing.assert_allclose(_f(dw), DW, rtol=tol, atol=tol * 10)
    np.testing.assert_allclose(_f(db), DB, rtol=tol, atol=tol * 10)
    tag = mix
    assert launched[:3] == [f"blu_add_layer_norm_forward_r1_{tag}", f"blu_add_layer_norm_backward_s1_{tag}",
                            "blu_layer_norm_backward_reduce_" + ("acc" if into else sw)]


# ------------------------------------------------ the fused kernels on the GPU
def _bf(a):
    return bt.tensor(a.astype(np.float32)).to(bt.bfloat16).to(bt.float32).numpy().astype(np.float64)


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_ok(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("mode", ["fp32", "bf16", "autocast"])
@pytest.mark.parametrize("C", [64, 200, 768, 1024])
def test_cuda_kernels_match_float64_and_equal_add_then_layer_norm(mode, C):
    """Values and gradients against the float64 reference, and bitwise against ``r + x`` then F.layer_norm (then
    autocast's cast of y) on the same device (bf16 storage throughout: x's and the residual's gradients within a
    bf16 step, see below)."""
    shape = (3, 13, C)
    x, r, gy, gh = (rng.standard_normal(shape) for _ in range(4))
    w, b = 1 + 0.1 * rng.standard_normal(C), 0.1 * rng.standard_normal(C)
    low = mode != "fp32"
    full = mode == "bf16"

    def dev(a, lowp):
        t = bt.tensor(a.astype(np.float32), device="cuda")
        t = (t.to(bt.bfloat16) if lowp else t).detach()
        t.requires_grad = True
        return t

    def run(fused):
        ts = [dev(x, low), dev(r, full), dev(w, full), dev(b, full)]
        for t in ts[2:]:  # the float32 .grad buffers a training step offers (bf16 parameters get none)
            if t.dtype == bt.float32:
                t.grad = bt.zeros(C, device="cuda")
        with bt.autocast("cuda", dtype=bt.bfloat16, enabled=mode == "autocast"):
            if fused:
                h, y = F.add_layer_norm(ts[0], ts[1], C, ts[2], ts[3], 1e-5)
                assert y.grad_fn.op == "add_layer_norm" and y.grad_fn.ctx.saved[4] == "cuda"
            else:
                h = ts[1] + ts[0]
                y = F.layer_norm(h, (C,), ts[2], ts[3], 1e-5)
                y = y.to(bt.bfloat16) if mode == "autocast" else y
        gyt = bt.tensor(gy.astype(np.float32), device="cuda").to(y.dtype)
        ght = bt.tensor(gh.astype(np.float32), device="cuda").to(h.dtype)
        ((y * gyt).sum().to(bt.float32) + (h * ght).sum().to(bt.float32)).backward()
        np_ = lambda t: t.detach().to(bt.float32).to("cpu").numpy().astype(np.float64)  # noqa: E731
        return [np_(h), np_(y)] + [np_(t.grad) for t in ts], np_(gyt), np_(ght), [t.dtype for t in ts], y.dtype

    got, gyr, ghr, dtypes, y_dtype = run(True)
    want = run(False)[0]
    assert y_dtype == (bt.bfloat16 if low else bt.float32)
    for name, a, e in zip(("h", "y", "dx", "dresidual", "dweight", "dbias"), got, want):
        if mode == "bf16" and name in ("dx", "dresidual"):
            # bf16 storage throughout: the engine adds a bf16 pending gradient after layer_norm's backward (two
            # roundings to bf16), the fused kernel adds it in float32 and rounds once: within a bf16 step
            np.testing.assert_allclose(a, e, rtol=2 ** -7, atol=2 ** -7 * max(1.0, float(np.abs(e).max())))
            continue
        assert np.array_equal(a, e), name  # bitwise add + layer_norm (+ cast)
    f = _bf if low else (lambda a: a.astype(np.float32).astype(np.float64))
    ref = _reference(f(x), _bf(r) if full else f(r) if not low else r.astype(np.float32).astype(np.float64),
                     _bf(w) if full else w.astype(np.float32).astype(np.float64),
                     _bf(b) if full else b.astype(np.float32).astype(np.float64), gyr, ghr, 1e-5)
    tol = 2e-5 if mode == "fp32" else 3e-2
    scale = lambda a: max(1.0, float(np.abs(a).max()))  # noqa: E731
    H, Y, D, DW, DB = ref
    for a, e, extra in ((got[0], H, 1), (got[1], Y, 1), (got[2], D, 4), (got[3], D, 4), (got[4], DW, 8),
                        (got[5], DB, 8)):
        np.testing.assert_allclose(a, e, rtol=tol, atol=tol * scale(e) * extra)


def test_cuda_wrappers_bias_without_weight_take_the_bias_storage(fake_cuda):
    k, launched, _ = fake_cuda
    N, C = 6, 64
    x, r, gy = (_store(rng.standard_normal((N, C)), "bf16") for _ in range(3))
    b = _store(0.1 * rng.standard_normal(C), "bf16")
    h, y, mean, rstd = k.add_layer_norm_forward(x, r, None, b, 1e-5, np.uint16)
    dres, dx, dw, db = k.add_layer_norm_backward(gy, None, h, None, mean, rstd, x.dtype, False, True,
                                                 param_dtype=b.dtype)
    assert dw is None and dx is None and db.dtype == np.uint16
    np.testing.assert_allclose(_f(db), _f(gy).sum(0), rtol=1e-2, atol=1e-2)
    assert launched == ["blu_add_layer_norm_forward_r1_bf16_bf16_bf16_bf16",
                        "blu_add_layer_norm_backward_s1_bf16_bf16_bf16_bf16", "blu_layer_norm_backward_reduce_bf16"]


def test_bf16_storage_rounds_h_and_y_as_add_then_layer_norm_cpu():
    """bfloat16 x and residual: h is the bf16-rounded sum and y LayerNorm of that h rounded to bf16."""
    C = 32
    x, r = (rng.standard_normal((5, C)).astype(np.float32) for _ in range(2))
    w = (1 + 0.1 * rng.standard_normal(C)).astype(np.float32)
    xt, rt, wt = (bt.tensor(a).to(bt.bfloat16) for a in (x, r, w))
    h, y = F.add_layer_norm(xt, rt, C, wt, None, 1e-5)
    assert h.dtype == y.dtype == bt.bfloat16
    hb = _bf(_bf(x) + _bf(r))  # the sum of the two bf16 values, rounded to bf16
    np.testing.assert_array_equal(h.to(bt.float32).numpy().astype(np.float64), hb)
    _, Y, _, _, _ = _reference(hb, np.zeros_like(hb), _bf(w), None, None, None, 1e-5)
    np.testing.assert_allclose(y.to(bt.float32).numpy(), Y, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("mix", ["f32_f32_f32_f32", "bf16_f32_bf16_f32", "bf16_bf16_bf16_bf16"])
def test_add_rms_norm_takes_the_shared_register_resident_entries(fake_cuda, mix):
    """add_rms_norm's rows that fit run the template add_layer_norm shares (without the mean and the bias)."""
    k, launched, _ = fake_cuda
    from blutensor.backends.cupy import decoder

    sx, sh, sy, sw = mix.split("_")
    N, C = 9, 64
    x, r, gy, gh = (rng.standard_normal((N, C)) for _ in range(4))
    w = 1 + 0.1 * rng.standard_normal(C)
    xs, rs_, ws, gys, ghs = _store(x, sx), _store(r, sh), _store(w, sw), _store(gy, sy), _store(gh, sh)
    y_dt = np.uint16 if sy == "bf16" else np.float32
    h, y, rstd = decoder.add_rms_norm_forward(xs, rs_, ws, 1e-5, y_dt)
    dres, dx, dw = decoder.add_rms_norm_backward(gys, ghs, h, ws, rstd, xs.dtype, True)
    f64 = lambda a: _f(a).astype(np.float64)  # noqa: E731
    H = f64(xs) + f64(rs_)
    rs = 1 / np.sqrt((H * H).mean(-1, keepdims=True) + 1e-5)
    hh = H * rs
    gw = f64(gys) * f64(ws)
    D = rs * (gw - hh * (gw * hh).mean(-1, keepdims=True)) + f64(ghs)
    tol = 2e-5 if sx == sy == "f32" else 3e-2
    np.testing.assert_allclose(_f(y), hh * f64(ws), rtol=tol, atol=tol)
    for got in (dres,) if dx is None else (dres, dx):
        np.testing.assert_allclose(_f(got), D, rtol=tol, atol=tol * 4)
    np.testing.assert_allclose(_f(dw), (f64(gys) * hh).sum(0), rtol=tol, atol=tol * 10)
    assert launched == [f"blu_add_rms_norm_forward_r1_{mix}", f"blu_add_rms_norm_backward_s1_{mix}",
                        "blu_layer_norm_backward_reduce_" + sw]
