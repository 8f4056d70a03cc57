"""Sorting and scans along one dim: argsort (sort/topk take their values with ``take_along_dim``), cumsum,
cumprod, the indices of cummax/cummin, logcumsumexp.

Order as in PyTorch: NaN sorts as the largest value (last ascending, first descending); ``stable=True`` keeps
equal elements in input order (descending too).
"""

from __future__ import annotations

import numpy as np
from blutensor.ops._util import norm_dim, xp_of


def _dim(a, dim, op):
    return 0 if a.ndim == 0 else norm_dim(dim, a.ndim, op)


def argsort_forward(ctx, a, dim=-1, descending=False, stable=False):
    xp = xp_of(a)
    if a.ndim == 0:
        return xp.zeros((), dtype=np.int64)
    d = norm_dim(dim, a.ndim, "argsort")
    key = a
    if a.dtype.kind == "b":
        key = a.astype(np.int8)
    if descending:
        if key.dtype.kind == "f":
            key = xp.where(xp.isnan(key), -xp.inf, -key)  # NaN first, then +inf, ...
        elif key.dtype.kind == "u":
            key = key.max() - key if key.size else key
        else:
            key = -key.astype(np.int64)  # int64's minimum has no negation: widen small ints, keep int64's range
    return xp.argsort(key, axis=d, kind="stable").astype(np.int64)


def topk_indices_forward(ctx, a, k=1, dim=-1, largest=True):
    xp = xp_of(a)
    d = _dim(a, dim, "topk")
    n = a.shape[d] if a.ndim else 1
    if not 0 <= k <= n:
        from blutensor.errors import ArgumentError

        raise ArgumentError(f"topk: k ({k}) must be in [0, {n}] for dim {d} of shape {tuple(a.shape)}")
    if a.ndim == 0:
        return xp.zeros((), dtype=np.int64)
    idx = argsort_forward(ctx, a, dim=d, descending=largest, stable=True)
    return xp.take(idx, xp.arange(k), axis=d)


def cumsum_forward(ctx, a, dim=0):
    d = _dim(a, dim, "cumsum")
    ctx.saved = d
    if a.ndim == 0:
        return a.copy()
    return xp_of(a).cumsum(a, axis=d)


def cumsum_backward(ctx, g):
    d = ctx.saved
    if g.ndim == 0:
        return (g,)
    xp = xp_of(g)
    return (xp.flip(xp.cumsum(xp.flip(g, d), axis=d), d),)


def cumprod_forward(ctx, a, dim=0):
    xp = xp_of(a)
    d = _dim(a, dim, "cumprod")
    out = a.copy() if a.ndim == 0 else xp.cumprod(a, axis=d)
    ctx.saved = (a, d)
    return out


def cumprod_backward(ctx, g):
    """Exact at zeros: grad_i = sum_{j >= i} g_j prod_{k <= j, k != i} a_k, one masked cumprod per position
    (O(n^2) along the dim, like PyTorch's own zero-safe path)."""
    a, d = ctx.saved
    if g.ndim == 0:
        return (g,)
    xp = xp_of(g)
    am = xp.moveaxis(a, d, -1)
    gm = xp.moveaxis(g, d, -1)
    n = am.shape[-1]
    out = xp.empty_like(gm)
    for i in range(n):
        ai = am.copy()
        ai[..., i] = 1
        c = xp.cumprod(ai, axis=-1)
        out[..., i] = (gm[..., i:] * c[..., i:]).sum(axis=-1)
    return (xp.moveaxis(out, -1, d),)


def cumext_indices_forward(ctx, a, dim=0, greater=True):
    """Indices of the running max (greater) or min along ``dim``: the last position of the extreme so far, and
    a NaN once seen stays the extreme (PyTorch's cummax/cummin)."""
    xp = xp_of(a)
    if a.ndim == 0:
        return xp.zeros((), dtype=np.int64)
    d = norm_dim(dim, a.ndim, "cummax" if greater else "cummin")
    am = xp.moveaxis(a, d, -1)
    n = am.shape[-1]
    idx = xp.zeros(am.shape, dtype=np.int64)
    if n == 0:
        return xp.moveaxis(idx, -1, d)
    best = am[..., 0].copy()
    bi = xp.zeros(am.shape[:-1], dtype=np.int64)
    isf = am.dtype.kind == "f"
    for i in range(n):
        v = am[..., i]
        take = (v >= best) if greater else (v <= best)
        if isf:
            take = (take | xp.isnan(v)) & ~(xp.isnan(best) & ~xp.isnan(v))
        best = xp.where(take, v, best)
        bi = xp.where(take, i, bi)
        idx[..., i] = bi
    return xp.moveaxis(idx, -1, d)


def logcumsumexp_forward(ctx, a, dim=0):
    xp = xp_of(a)
    d = _dim(a, dim, "logcumsumexp")
    if a.ndim == 0:
        ctx.saved = None
        return a.copy()
    m = a.max(axis=d, keepdims=True) if a.size else xp.zeros((1,) * a.ndim, dtype=a.dtype)
    m = xp.where(xp.isfinite(m), m, 0)
    with np.errstate(divide="ignore"):
        out = (xp.log(xp.cumsum(xp.exp(a - m), axis=d)) + m).astype(a.dtype, copy=False)
    ctx.saved = (a, out, d)
    return out


def logcumsumexp_backward(ctx, g):
    """grad_i = sum_{j >= i} g_j exp(a_i - out_j)."""
    if ctx.saved is None:
        return (g,)
    a, out, d = ctx.saved
    xp = xp_of(g)
    with np.errstate(over="ignore", invalid="ignore"):
        w = g * xp.exp(-out)
        rev = xp.flip(xp.cumsum(xp.flip(w, d), axis=d), d)
        return ((rev * xp.exp(a)).astype(g.dtype, copy=False),)
