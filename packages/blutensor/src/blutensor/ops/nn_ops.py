"""Neural-network ops: softmax, log_softmax, layer_norm, gelu, cross_entropy, embedding, dropout."""

from __future__ import annotations

import math

import numpy as np
from blutensor.errors import ShapeError
from blutensor.ops._util import into_grad, norm_dim, scatter_add, sum_pending, xp_of


def softmax_forward(ctx, a, dim=-1):
    xp = xp_of(a)
    if a.ndim == 0:  # a 0-d tensor is its own (one-element) dim: softmax 1, log_softmax 0
        norm_dim(dim, 0, "softmax")
        out = xp.ones((), dtype=a.dtype)
        ctx.saved = (out, None)
        return out
    d = dim if -a.ndim <= dim < max(a.ndim, 1) else norm_dim(dim, a.ndim, "softmax")
    e = a - a.max(axis=d, keepdims=True)
    xp.exp(e, out=e)
    e /= e.sum(axis=d, keepdims=True)
    ctx.saved = (e, d)
    return e


def softmax_backward(ctx, g):
    out, d = ctx.saved
    if d is None:
        return (g * 0,)
    return (out * (g - (g * out).sum(axis=d, keepdims=True)),)


def log_softmax_forward(ctx, a, dim=-1):
    xp = xp_of(a)
    if a.ndim == 0:
        norm_dim(dim, 0, "log_softmax")
        out = xp.zeros((), dtype=a.dtype)
        ctx.saved = (out, None)
        return out
    d = norm_dim(dim, a.ndim, "log_softmax")
    s = a - a.max(axis=d, keepdims=True)
    out = s - xp.log(xp.exp(s).sum(axis=d, keepdims=True))
    ctx.saved = (out, d)
    return out


def log_softmax_backward(ctx, g):
    out, d = ctx.saved
    if d is None:
        return (g * 0,)
    xp = xp_of(g)
    return (g - xp.exp(out) * g.sum(axis=d, keepdims=True),)


def layer_norm_forward(ctx, x, w=None, b=None, normalized_shape=(), eps=1e-5):
    n = len(normalized_shape)
    if tuple(x.shape[x.ndim - n:]) != tuple(normalized_shape):
        raise ShapeError(f"layer_norm: input shape {tuple(x.shape)} does not end with normalized_shape "
                         f"{tuple(normalized_shape)}")
    for name, p in (("weight", w), ("bias", b)):
        if p is not None and tuple(p.shape) != tuple(normalized_shape):
            raise ShapeError(f"layer_norm: {name} shape {tuple(p.shape)} != normalized_shape "
                             f"{tuple(normalized_shape)}")
    xp = xp_of(x)
    axes = tuple(range(x.ndim - n, x.ndim))
    mu = x.mean(axis=axes, keepdims=True)
    xc = x - mu
    var = (xc * xc).mean(axis=axes, keepdims=True)
    rstd = 1.0 / xp.sqrt(var + eps)
    xhat = xc * rstd
    out = xhat * w if w is not None else xhat
    if b is not None:
        out = out + b
    ctx.saved = (xhat, rstd, w, axes)
    return out.astype(x.dtype, copy=False)


def layer_norm_backward(ctx, g):
    xhat, rstd, w, axes = ctx.saved
    batch_axes = tuple(range(g.ndim - len(axes)))
    gw = (g * xhat).sum(axis=batch_axes) if ctx.needs[1] else None
    gb = g.sum(axis=batch_axes) if len(ctx.needs) > 2 and ctx.needs[2] else None
    gx = None
    if ctx.needs[0]:
        gxh = g * w if w is not None else g
        gx = rstd * (gxh - gxh.mean(axis=axes, keepdims=True)
                     - xhat * (gxh * xhat).mean(axis=axes, keepdims=True))
        gx = gx.astype(g.dtype, copy=False)
    return sum_pending(ctx, 0, gx), into_grad(ctx, 1, gw), into_grad(ctx, 2, gb)


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def gelu_forward(ctx, x, approximate="none"):
    xp = xp_of(x)
    ctx.saved = (x, approximate)
    if approximate == "tanh":
        t = xp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x))
        return (0.5 * x * (1 + t)).astype(x.dtype, copy=False)
    if approximate != "none":
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    from blutensor.ops.elementwise import erf

    return (0.5 * x * (1 + erf(x * _INV_SQRT_2, xp))).astype(x.dtype, copy=False)


def gelu_backward(ctx, g):
    x, approximate = ctx.saved
    xp = xp_of(x)
    if approximate == "tanh":
        # recompute from x: no activation-sized buffer kept besides the input
        t = xp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x))
        d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * x * x)
    else:
        from blutensor.ops.elementwise import erf

        d = 0.5 * (1 + erf(x * _INV_SQRT_2, xp)) + x * xp.exp(-0.5 * x * x) * _INV_SQRT_2PI
    return ((g * d).astype(g.dtype, copy=False),)


def cross_entropy_forward(ctx, logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    xp = xp_of(logits)
    if logits.ndim < 1 or target.shape != logits.shape[:-1]:
        hint = ""
        if logits.ndim > 2 and target.shape == logits.shape[:1] + logits.shape[2:]:
            hint = (": this is PyTorch's (N, C, d...) layout; blutensor reads the class dim last: permute it there "
                    "(logits.transpose(1, 2) for 3-D)")
        raise ShapeError(f"cross_entropy: logits {tuple(logits.shape)} (..., C) and target "
                         f"{tuple(target.shape)} (...) do not match{hint}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    C = logits.shape[-1]
    z = logits.reshape(-1, C)
    t = target.reshape(-1).astype(xp.int64)
    valid = t != ignore_index
    tt = xp.where(valid, t, 0)
    if bool(((tt < 0) | (tt >= C)).any()):
        bad = int(tt[(tt < 0) | (tt >= C)][0])
        raise ShapeError(f"cross_entropy: target index {bad} out of range for {C} classes")
    m = z.max(axis=1, keepdims=True)
    lse = m[:, 0] + xp.log(xp.exp(z - m).sum(axis=1))
    picked = xp.take_along_axis(z, tt[:, None], axis=1)[:, 0]
    loss = lse - picked
    if label_smoothing:
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - z.mean(axis=1))
    loss = xp.where(valid, loss, 0).astype(logits.dtype)
    count = int(valid.sum())
    ctx.saved = (z, lse, tt, valid, count, reduction, logits.shape, label_smoothing)
    if reduction == "none":
        return loss.reshape(target.shape)
    total = loss.sum()
    if reduction == "sum":
        return total
    return (total / max(count, 1)).astype(logits.dtype) if count else xp.asarray(np.nan, dtype=logits.dtype)


def cross_entropy_backward(ctx, g):
    z, lse, tt, valid, count, reduction, shape, ls = ctx.saved
    xp = xp_of(z)
    p = xp.exp(z - lse[:, None])
    C = z.shape[1]
    if ls:
        p = p - ls / C
    p = p - (1 - ls) * (xp.arange(C)[None, :] == tt[:, None])
    if reduction == "none":
        scale = g.reshape(-1)[:, None]
    elif reduction == "sum":
        scale = g
    elif isinstance(count, int):
        scale = g / max(count, 1)
    else:  # the count of valid targets kept on the device (a tracer's forward): same quotient, no host read
        scale = g / xp.maximum(count, 1).astype(z.dtype)
    p = p * valid[:, None] * scale
    return p.astype(z.dtype, copy=False).reshape(shape), None


def embedding_forward(ctx, idx, weight):
    n = weight.shape[0]
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise ShapeError(f"embedding: index out of range [0, {n}): min {int(idx.min())}, max {int(idx.max())}")
    ctx.saved = (idx, weight.shape)
    return weight[idx]


def embedding_backward(ctx, g):
    idx, wshape = ctx.saved
    xp = xp_of(g)
    gw = xp.zeros(wshape, dtype=g.dtype)
    scatter_add(gw, idx.reshape(-1), g.reshape(-1, wshape[1]))  # repeated tokens accumulate
    return None, into_grad(ctx, 1, gw)


def dropout_forward(ctx, x, p=0.5, seed=0, offset=0):
    """Inverted dropout with a Philox mask drawn at (seed, offset): same mask on CPU and CUDA."""
    from blutensor.random import Generator

    xp = xp_of(x)
    gen = Generator(seed)
    gen.offset = offset
    keep = gen.uniform(x.shape, xp) >= p
    scale = 1.0 / (1.0 - p)
    ctx.saved = (keep, scale)
    return (x * keep * scale).astype(x.dtype, copy=False)


def dropout_backward(ctx, g):
    keep, scale = ctx.saved
    return ((g * keep * scale).astype(g.dtype, copy=False),)


def sdpa_forward(ctx, q, k, v, mask=None, scale=None, is_causal=False, dropout_p=0.0, seed=0, offset=0):
    """Attention softmax(q k^T * scale + mask) v over (..., L, E) inputs; saves the probabilities."""
    from blutensor.ops.linalg import gemm

    xp = xp_of(q)
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ShapeError(f"scaled_dot_product_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} do not fit (..., L, E), (..., S, E), (..., S, Ev)")
    sc = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = gemm(q, k.swapaxes(-1, -2)) * sc
    L, S = s.shape[-2], s.shape[-1]
    if is_causal:
        causal = xp.tril(xp.ones((L, S), dtype=bool))
        s = xp.where(causal, s, -xp.inf)
    if mask is not None:
        s = xp.where(mask, s, -xp.inf) if mask.dtype == bool else s + mask
    s = s - s.max(axis=-1, keepdims=True)
    e = xp.exp(s)
    p = (e / e.sum(axis=-1, keepdims=True)).astype(q.dtype, copy=False)
    keep = None
    pd = p
    if dropout_p > 0:
        from blutensor.random import Generator

        gen = Generator(seed)
        gen.offset = offset
        keep = gen.uniform(p.shape, xp) >= dropout_p
        pd = p * keep * (1.0 / (1.0 - dropout_p))
    ctx.saved = (q, k, v, p, keep, sc, dropout_p)
    return gemm(pd, v)


def sdpa_backward(ctx, g):
    from blutensor.ops._util import unbroadcast
    from blutensor.ops.linalg import gemm

    q, k, v, p, keep, sc, dp = ctx.saved
    pd = p if keep is None else p * keep * (1.0 / (1.0 - dp))
    gv = unbroadcast(gemm(pd.swapaxes(-1, -2), g), v.shape) if ctx.needs[2] else None
    gpd = gemm(g, v.swapaxes(-1, -2))
    gp = gpd if keep is None else gpd * keep * (1.0 / (1.0 - dp))
    gs = p * (gp - (gp * p).sum(axis=-1, keepdims=True)) * sc
    gq = unbroadcast(gemm(gs, k), q.shape) if ctx.needs[0] else None
    gk = unbroadcast(gemm(gs.swapaxes(-1, -2), q), k.shape) if ctx.needs[1] else None
    return gq, gk, gv, None
