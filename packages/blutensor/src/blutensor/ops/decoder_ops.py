"""Ops of Llama-style decoder blocks: RMSNorm, rotary position embedding (RoPE), SiLU and SwiGLU.

These are the array-level references (NumPy on CPU, CuPy on CUDA when no fused kernel serves the call); the
fused CUDA kernels in ``blutensor.backends.cupy`` are checked against them. Math is done in the input's dtype
(float32/float64; bfloat16 inputs are widened to float32 by dispatch around these functions).
"""

from __future__ import annotations

from blutensor.errors import ShapeError
from blutensor.ops._util import into_grad, xp_of


def rms_norm_forward(ctx, x, w=None, normalized_shape=(), eps=1e-6):
    """y = x / sqrt(mean(x^2 over normalized_shape) + eps) * w; saves x, the row rstd and w."""
    n = len(normalized_shape)
    if n == 0 or tuple(x.shape[x.ndim - n:]) != tuple(normalized_shape):
        raise ShapeError(f"rms_norm: input shape {tuple(x.shape)} does not end with normalized_shape "
                         f"{tuple(normalized_shape)}")
    if w is not None and tuple(w.shape) != tuple(normalized_shape):
        raise ShapeError(f"rms_norm: weight shape {tuple(w.shape)} != normalized_shape {tuple(normalized_shape)}")
    xp = xp_of(x)
    axes = tuple(range(x.ndim - n, x.ndim))
    rstd = 1.0 / xp.sqrt((x * x).mean(axis=axes, keepdims=True) + eps)
    xhat = x * rstd
    ctx.saved = (xhat, rstd, w, axes)
    out = xhat * w if w is not None else xhat
    return out.astype(x.dtype, copy=False)


def rms_norm_backward(ctx, g):
    """dx = rstd * (g*w - xhat * mean(g*w*xhat)); dw = sum over rows of g * xhat, added into the leaf's float32
    ``.grad`` buffer where the engine offers one (``ctx.grad_into``: the same one add the engine would make)."""
    xhat, rstd, w, axes = ctx.saved
    batch_axes = tuple(range(g.ndim - len(axes)))
    gw = (g * xhat).sum(axis=batch_axes).astype(g.dtype, copy=False) if len(ctx.needs) > 1 and ctx.needs[1] \
        else None
    gx = None
    if ctx.needs[0]:
        gxh = g * w if w is not None else g
        gx = (rstd * (gxh - xhat * (gxh * xhat).mean(axis=axes, keepdims=True))).astype(g.dtype, copy=False)
    return gx, into_grad(ctx, 1, gw)


def _check_rope(x, cos, sin):
    if x.ndim < 3:
        raise ShapeError(f"rope: x must be (..., T, H, D) (sequence, heads, head_dim), got shape {tuple(x.shape)}")
    T, D = x.shape[-3], x.shape[-1]
    if D % 2:
        raise ShapeError(f"rope: head_dim {D} must be even (pairs (i, i + D/2) are rotated)")
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (T, D // 2):
            raise ShapeError(f"rope: {name} must be (T, D/2) = {(T, D // 2)} for x {tuple(x.shape)}, got "
                             f"{tuple(t.shape)}")


def rotate(x, cos, sin):
    """The rotate-half RoPE of ``x`` (..., T, H, D) by angles with cos/sin (T, D/2) (Hugging Face's layout):
    out[:D/2] = x1 cos - x2 sin, out[D/2:] = x2 cos + x1 sin, where x1, x2 are the two halves of the head."""
    xp = xp_of(x)
    h = x.shape[-1] // 2
    c = cos[:, None, :].astype(x.dtype, copy=False)
    s = sin[:, None, :].astype(x.dtype, copy=False)
    x1, x2 = x[..., :h], x[..., h:]
    return xp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def rope_forward(ctx, x, cos, sin, transpose=False):
    """The rotation of x (..., T, H, D); ``transpose``: returned as a contiguous (..., H, T, D) (attention's layout)."""
    _check_rope(x, cos, sin)
    ctx.saved = (cos, sin, bool(transpose))
    y = rotate(x, cos, sin)
    return xp_of(y).ascontiguousarray(y.swapaxes(-3, -2)) if transpose else y


def rope_backward(ctx, g):
    """The rotation is orthogonal: the gradient is ``g`` rotated back (by -angle), in x's (..., T, H, D) layout."""
    cos, sin, transpose = ctx.saved
    if transpose:
        g = g.swapaxes(-3, -2)
    return rotate(g, cos, -sin), None, None


def swiglu_forward(ctx, gate, up):
    """silu(gate) * up, the gated MLP activation of Llama (saves gate and up, not the product)."""
    if tuple(gate.shape) != tuple(up.shape):
        raise ShapeError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    xp = xp_of(gate)
    s = 0.5 * (xp.tanh(0.5 * gate) + 1)
    ctx.saved = (gate, up)
    return (gate * s * up).astype(gate.dtype, copy=False)


def swiglu_backward(ctx, g):
    gate, up = ctx.saved
    xp = xp_of(gate)
    s = 0.5 * (xp.tanh(0.5 * gate) + 1)
    silu = gate * s
    gg = (g * up * s * (1 + gate * (1 - s))).astype(g.dtype, copy=False) if ctx.needs[0] else None
    gu = (g * silu).astype(g.dtype, copy=False) if ctx.needs[1] else None
    return gg, gu


def add_rms_norm_rows(x, r, w, eps, y_dtype):
    """(h, y, rstd) of the residual add fused with RMSNorm over rows (N, C): h = x + r in r's dtype, rstd (N, 1),
    y = h * rstd * w in ``y_dtype``; the reference of the fused kernels (float32/float64 math)."""
    xp = xp_of(r)
    h = (x.astype(r.dtype, copy=False) + r).astype(r.dtype, copy=False)
    rstd = 1.0 / xp.sqrt((h * h).mean(axis=-1, keepdims=True) + eps)
    y = h * rstd
    if w is not None:
        y = y * w
    return h, y.astype(y_dtype, copy=False), rstd


def add_rms_norm_rows_backward(gy, gh, h, w, rstd, need_dw: bool):
    """(dsum, dw): dsum = rstd * (gy*w - hhat * mean(gy*w*hhat)) + gh (the gradient of both addends), dw = sum over
    rows of gy * hhat; gy or gh may be None (no gradient reached y or h)."""
    xp = xp_of(h)
    hhat = h * rstd
    dsum = xp.zeros_like(h) if gh is None else gh.astype(h.dtype, copy=True)
    dw = None
    if gy is not None:
        g = gy.astype(h.dtype, copy=False)
        gw = g * w if w is not None else g
        dsum += rstd * (gw - hhat * (gw * hhat).mean(axis=-1, keepdims=True))
        if need_dw and w is not None:
            dw = (g * hhat).sum(axis=0).astype(w.dtype, copy=False)
    elif need_dw and w is not None:
        dw = xp.zeros_like(w)
    return dsum, dw


def add_layer_norm_rows(x, r, w, b, eps, y_dtype, n: int = 1):
    """(h, y, (xhat, rstd)) of the residual add fused with LayerNorm over the last ``n`` dims: h = x + r in r's
    dtype, y = (h - mean) * rstd * w + b in ``y_dtype``; the reference of the fused kernels, computed as
    ``nn_ops.layer_norm_forward`` computes LayerNorm (so that the op-by-op and fused NumPy paths agree bitwise)."""
    xp = xp_of(r)
    h = (x.astype(r.dtype, copy=False) + r).astype(r.dtype, copy=False)
    axes = tuple(range(h.ndim - n, h.ndim))
    mu = h.mean(axis=axes, keepdims=True)
    xc = h - mu
    var = (xc * xc).mean(axis=axes, keepdims=True)
    rstd = 1.0 / xp.sqrt(var + eps)
    xhat = xc * rstd
    y = xhat * w if w is not None else xhat
    if b is not None:
        y = y + b
    return h, y.astype(y_dtype, copy=False), (xhat, rstd)


def add_layer_norm_rows_backward(gy, gh, h, w, stats, need_dw: bool, need_db: bool, n: int = 1):
    """(dsum, dw, db): dsum = rstd * (gy*w - mean(gy*w) - xhat * mean(gy*w*xhat)) + gh (the gradient of both
    addends), dw = sum over rows of gy * xhat, db = sum over rows of gy; gy or gh may be None (no gradient reached
    y or h). The arithmetic of ``nn_ops.layer_norm_backward`` followed by the engine's add of ``gh``."""
    xp = xp_of(h)
    xhat, rstd = stats
    axes = tuple(range(h.ndim - n, h.ndim))
    batch = tuple(range(h.ndim - n))
    dw = db = None
    if gy is None:
        dsum = xp.zeros_like(h) if gh is None else gh.astype(h.dtype, copy=True)
        if need_dw and w is not None:
            dw = xp.zeros_like(w)
        if need_db:
            db = xp.zeros(h.shape[h.ndim - n:], h.dtype)
        return dsum, dw, db
    g = gy.astype(h.dtype, copy=False)
    if need_dw and w is not None:
        dw = (g * xhat).sum(axis=batch)
    if need_db:
        db = g.sum(axis=batch)
    gxh = g * w if w is not None else g
    dsum = rstd * (gxh - gxh.mean(axis=axes, keepdims=True) - xhat * (gxh * xhat).mean(axis=axes, keepdims=True))
    dsum = dsum.astype(h.dtype, copy=False)
    if gh is not None:
        dsum += gh.astype(h.dtype, copy=False)
    return dsum, dw, db
