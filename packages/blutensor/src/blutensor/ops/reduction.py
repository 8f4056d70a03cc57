"""Reductions over dims with keepdim: sum, mean, max/min (values and indices), var, argmax."""

from __future__ import annotations

import numpy as np
from blutensor.ops._util import norm_dim, xp_of


def _axes(dim, ndim, op):
    d = norm_dim(dim, ndim, op)
    if d is None or ndim == 0:  # a 0-d tensor reduces over dim 0 / -1 to itself, as in PyTorch
        return None
    return d if isinstance(d, tuple) else (d,)


def _expand_back(g, shape, axes, keepdim):
    """Reshape a reduced gradient so it broadcasts against the input shape."""
    if axes is None:
        return g.reshape((1,) * len(shape)) if len(shape) else g
    if not keepdim:
        xp = xp_of(g)
        g = xp.expand_dims(g, axis=tuple(sorted(axes)))
    return g


def sum_forward(ctx, a, dim=None, keepdim=False, dtype=None):
    axes = _axes(dim, a.ndim, "sum")
    ctx.saved = (a.shape, axes, keepdim, a.dtype)
    return a.sum(axis=axes, keepdims=keepdim, dtype=dtype)


def sum_backward(ctx, g):
    shape, axes, keepdim, dt = ctx.saved
    xp = xp_of(g)
    return (xp.broadcast_to(_expand_back(g, shape, axes, keepdim), shape).astype(dt, copy=False),)


def mean_forward(ctx, a, dim=None, keepdim=False):
    axes = _axes(dim, a.ndim, "mean")
    n = a.size if axes is None else int(_prod(a.shape[i] for i in axes))
    ctx.saved = (a.shape, axes, keepdim, n)
    return a.mean(axis=axes, keepdims=keepdim)


def mean_backward(ctx, g):
    shape, axes, keepdim, n = ctx.saved
    xp = xp_of(g)
    return (xp.broadcast_to(_expand_back(g, shape, axes, keepdim) / n, shape),)


def _prod(it):
    p = 1
    for x in it:
        p *= x
    return p


def amax_forward(ctx, a, dim=None, keepdim=False):
    axes = _axes(dim, a.ndim, "max")
    out = a.max(axis=axes, keepdims=keepdim)
    ctx.saved = (a, out, axes, keepdim)
    return out


def amax_backward(ctx, g):
    a, out, axes, keepdim = ctx.saved
    xp = xp_of(g)
    o = _expand_back(out, a.shape, axes, keepdim)
    mask = a == o
    cnt = mask.sum(axis=axes, keepdims=True).astype(g.dtype)  # ties share the gradient evenly
    return (xp.where(mask, _expand_back(g, a.shape, axes, keepdim) / cnt, g.dtype.type(0)).astype(g.dtype, copy=False),)


def amin_forward(ctx, a, dim=None, keepdim=False):
    axes = _axes(dim, a.ndim, "min")
    out = a.min(axis=axes, keepdims=keepdim)
    ctx.saved = (a, out, axes, keepdim)
    return out


amin_backward = amax_backward


def max_dim_forward(ctx, a, dim=0, keepdim=False):
    xp = xp_of(a)
    d = norm_dim(dim, a.ndim, "max")
    if a.ndim == 0:
        ctx.saved = None
        return a.copy()
    idx = xp.expand_dims(a.argmax(axis=d), d)
    out = xp.take_along_axis(a, idx, axis=d)
    ctx.saved = (a.shape, idx, d, keepdim)
    return out if keepdim else out.squeeze(d)


def max_dim_backward(ctx, g):
    if ctx.saved is None:
        return (g,)
    shape, idx, d, keepdim = ctx.saved
    xp = xp_of(g)
    if not keepdim:
        g = xp.expand_dims(g, d)
    pos = xp.arange(shape[d]).reshape((-1,) + (1,) * (len(shape) - d - 1))
    return (xp.where(pos == idx, g, g.dtype.type(0)),)  # the gradient goes to the arg-max only


def min_dim_forward(ctx, a, dim=0, keepdim=False):
    xp = xp_of(a)
    d = norm_dim(dim, a.ndim, "min")
    if a.ndim == 0:
        ctx.saved = None
        return a.copy()
    idx = xp.expand_dims(a.argmin(axis=d), d)
    out = xp.take_along_axis(a, idx, axis=d)
    ctx.saved = (a.shape, idx, d, keepdim)
    return out if keepdim else out.squeeze(d)


min_dim_backward = max_dim_backward


def argmax_forward(ctx, a, dim=None, keepdim=False):
    if a.size == 0:
        from blutensor.errors import ShapeError

        raise ShapeError("argmax: the input is empty (a zero-size tensor has no argmax)")
    if dim is None or a.ndim == 0:
        return a.argmax().astype("int64")
    d = norm_dim(dim, a.ndim, "argmax")
    out = a.argmax(axis=d).astype("int64")
    return xp_of(a).expand_dims(out, d) if keepdim else out


def argmin_forward(ctx, a, dim=None, keepdim=False):
    if a.size == 0:
        from blutensor.errors import ShapeError

        raise ShapeError("argmin: the input is empty (a zero-size tensor has no argmin)")
    if dim is None or a.ndim == 0:
        return a.argmin().astype("int64")
    d = norm_dim(dim, a.ndim, "argmin")
    out = a.argmin(axis=d).astype("int64")
    return xp_of(a).expand_dims(out, d) if keepdim else out


def var_forward(ctx, a, dim=None, keepdim=False, correction=1):
    axes = _axes(dim, a.ndim, "var")
    n = a.size if axes is None else int(_prod(a.shape[i] for i in axes))
    denom = n - correction
    if denom <= 0:
        import warnings

        warnings.warn(f"var/std: degrees of freedom is <= 0 ({n} elements, correction {correction}): the result "
                      f"is NaN (or inf)", RuntimeWarning, stacklevel=2)
    xp = xp_of(a)
    with np.errstate(divide="ignore", invalid="ignore"):
        mu = a.mean(axis=axes, keepdims=True) if n else xp.zeros((1,) * a.ndim, dtype=a.dtype)
        diff = a - mu
        out = (diff * diff).sum(axis=axes, keepdims=keepdim) / a.dtype.type(max(denom, 0))
    ctx.saved = (diff, axes, keepdim, denom)
    return out.astype(a.dtype, copy=False)


def var_backward(ctx, g):
    diff, axes, keepdim, denom = ctx.saved
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = g.dtype.type(2.0) / g.dtype.type(max(denom, 0))
        return ((_expand_back(g, diff.shape, axes, keepdim) * scale * diff).astype(g.dtype, copy=False),)


def prod_forward(ctx, a, dim=None, keepdim=False):
    axes = _axes(dim, a.ndim, "prod")
    out = a.prod(axis=axes, keepdims=keepdim)
    ctx.saved = (a, axes, keepdim)
    return out


def prod_backward(ctx, g):
    """d prod / d a_i = prod of the other elements: exclusive cumulative products from both sides, so zeros in
    the input give exact gradients (no division)."""
    a, axes, keepdim = ctx.saved
    xp = xp_of(g)
    ge = _expand_back(g, a.shape, axes, keepdim)
    ax = tuple(range(a.ndim)) if axes is None else tuple(sorted(axes))
    rest = tuple(i for i in range(a.ndim) if i not in ax)
    perm = rest + ax
    t = a.transpose(perm)
    lead = t.shape[:len(rest)]
    if a.size == 0:
        return (xp.zeros(a.shape, dtype=g.dtype),)
    flat = t.reshape(lead + (-1,))
    one = xp.ones(lead + (1,), dtype=a.dtype)
    left = xp.cumprod(xp.concatenate([one, flat[..., :-1]], axis=-1), axis=-1)
    right = xp.flip(xp.cumprod(xp.concatenate([one, xp.flip(flat, -1)[..., :-1]], axis=-1), axis=-1), -1)
    others = (left * right).reshape(t.shape)
    inv = [0] * a.ndim
    for i, p in enumerate(perm):
        inv[p] = i
    return ((others.transpose(inv) * ge).astype(g.dtype, copy=False),)


def logsumexp_forward(ctx, a, dim=None, keepdim=False):
    xp = xp_of(a)
    axes = _axes(dim, a.ndim, "logsumexp")
    m = a.max(axis=axes, keepdims=True) if a.size else xp.zeros((1,) * a.ndim, dtype=a.dtype)
    m = xp.where(xp.isfinite(m), m, 0)
    with np.errstate(divide="ignore"):
        out = xp.log(xp.exp(a - m).sum(axis=axes, keepdims=True)) + m
    ctx.saved = (a, out, axes, keepdim)
    if not keepdim:
        out = out.reshape(()) if axes is None else out.squeeze(axis=axes)
    return out.astype(a.dtype, copy=False)


def logsumexp_backward(ctx, g):
    a, out, axes, keepdim = ctx.saved
    xp = xp_of(g)
    return ((_expand_back(g, a.shape, axes, keepdim) * xp.exp(a - out)).astype(g.dtype, copy=False),)


def all_forward(ctx, a, dim=None, keepdim=False):
    return a.astype(bool).all(axis=_axes(dim, a.ndim, "all"), keepdims=keepdim)


def any_forward(ctx, a, dim=None, keepdim=False):
    return a.astype(bool).any(axis=_axes(dim, a.ndim, "any"), keepdims=keepdim)
