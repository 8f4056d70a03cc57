"""Reductions over dims with keepdim: sum, mean, max/min (values and indices), var, argmax."""

from __future__ import annotations

from blutensor.ops._util import norm_dim, xp_of


def _axes(dim, ndim, op):
    d = norm_dim(dim, ndim, op)
    if d is None:
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
    cnt = mask.sum(axis=axes, keepdims=True)  # ties share the gradient evenly
    return (xp.where(mask, _expand_back(g, a.shape, axes, keepdim) / cnt, g.dtype.type(0)),)


def amin_forward(ctx, a, dim=None, keepdim=False):
    axes = _axes(dim, a.ndim, "min")
    out = a.min(axis=axes, keepdims=keepdim)
    ctx.saved = (a, out, axes, keepdim)
    return out


amin_backward = amax_backward


def max_dim_forward(ctx, a, dim=0, keepdim=False):
    xp = xp_of(a)
    d = norm_dim(dim, a.ndim, "max")
    idx = xp.expand_dims(a.argmax(axis=d), d)
    out = xp.take_along_axis(a, idx, axis=d)
    ctx.saved = (a.shape, idx, d, keepdim)
    return out if keepdim else out.squeeze(d)


def max_dim_backward(ctx, g):
    shape, idx, d, keepdim = ctx.saved
    xp = xp_of(g)
    if not keepdim:
        g = xp.expand_dims(g, d)
    pos = xp.arange(shape[d]).reshape((-1,) + (1,) * (len(shape) - d - 1))
    return (xp.where(pos == idx, g, g.dtype.type(0)),)  # the gradient goes to the arg-max only


def min_dim_forward(ctx, a, dim=0, keepdim=False):
    xp = xp_of(a)
    d = norm_dim(dim, a.ndim, "min")
    idx = xp.expand_dims(a.argmin(axis=d), d)
    out = xp.take_along_axis(a, idx, axis=d)
    ctx.saved = (a.shape, idx, d, keepdim)
    return out if keepdim else out.squeeze(d)


min_dim_backward = max_dim_backward


def argmax_forward(ctx, a, dim=None, keepdim=False):
    if dim is None:
        return a.argmax().astype("int64")
    d = norm_dim(dim, a.ndim, "argmax")
    out = a.argmax(axis=d).astype("int64")
    return xp_of(a).expand_dims(out, d) if keepdim else out


def argmin_forward(ctx, a, dim=None, keepdim=False):
    if dim is None:
        return a.argmin().astype("int64")
    d = norm_dim(dim, a.ndim, "argmin")
    out = a.argmin(axis=d).astype("int64")
    return xp_of(a).expand_dims(out, d) if keepdim else out


def var_forward(ctx, a, dim=None, keepdim=False, correction=1):
    axes = _axes(dim, a.ndim, "var")
    n = a.size if axes is None else int(_prod(a.shape[i] for i in axes))
    mu = a.mean(axis=axes, keepdims=True)
    diff = a - mu
    out = (diff * diff).sum(axis=axes, keepdims=keepdim) / max(n - correction, 0)
    ctx.saved = (diff, axes, keepdim, n - correction)
    return out.astype(a.dtype, copy=False)


def var_backward(ctx, g):
    diff, axes, keepdim, denom = ctx.saved
    return (_expand_back(g, diff.shape, axes, keepdim) * (2.0 / denom) * diff,)
