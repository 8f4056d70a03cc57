"""Shape ops: views without copies (view, reshape, transpose, permute, expand, squeeze, unsqueeze,
indexing) and the copying ones (contiguous, cat, stack, advanced indexing, setitem)."""

from __future__ import annotations

from blutensor.errors import ShapeError
from blutensor.ops._util import norm_dim, unbroadcast, xp_of


def _resolve_shape(shape, numel: int, op: str, src) -> tuple:
    shape = tuple(int(s) for s in shape)
    neg = [i for i, s in enumerate(shape) if s == -1]
    if len(neg) > 1:
        raise ShapeError(f"{op}: only one dimension can be -1, got {shape}")
    if neg:
        rest = 1
        for i, s in enumerate(shape):
            if i != neg[0]:
                rest *= s
        if rest == 0 or numel % rest:
            raise ShapeError(f"{op}: shape {shape} is invalid for input of shape {tuple(src)} ({numel} elements)")
        shape = shape[: neg[0]] + (numel // rest,) + shape[neg[0] + 1:]
    n = 1
    for s in shape:
        n *= s
    if n != numel or any(s < 0 for s in shape):
        raise ShapeError(f"{op}: shape {shape} is invalid for input of shape {tuple(src)} ({numel} elements)")
    return shape


def view_forward(ctx, a, shape=()):
    shape = _resolve_shape(shape, a.size, "view", a.shape)
    ctx.saved = a.shape
    out = a.view()
    try:
        out.shape = shape  # raises instead of copying when strides do not allow a view
    except AttributeError:
        raise ShapeError(
            f"view: cannot view a non-contiguous tensor of shape {tuple(a.shape)} as {shape} without a copy; "
            f"use reshape() or .contiguous().view()") from None
    return out


def reshape_forward(ctx, a, shape=()):
    shape = _resolve_shape(shape, a.size, "reshape", a.shape)
    ctx.saved = a.shape
    return a.reshape(shape)


def view_backward(ctx, g):
    return (g.reshape(ctx.saved),)


reshape_backward = view_backward


def permute_forward(ctx, a, dims=()):
    dims = tuple(norm_dim(d, a.ndim, "permute") for d in dims)
    if sorted(dims) != list(range(a.ndim)):
        raise ShapeError(f"permute: dims {dims} are not a permutation of {a.ndim} dims")
    ctx.saved = dims
    return a.transpose(dims)


def permute_backward(ctx, g):
    inv = [0] * len(ctx.saved)
    for i, d in enumerate(ctx.saved):
        inv[d] = i
    return (g.transpose(inv),)


def transpose_forward(ctx, a, dim0=0, dim1=1):
    d0, d1 = norm_dim(dim0, a.ndim, "transpose"), norm_dim(dim1, a.ndim, "transpose")
    ctx.saved = (d0, d1)
    return a.swapaxes(d0, d1)


def transpose_backward(ctx, g):
    d0, d1 = ctx.saved
    return (g.swapaxes(d0, d1),)


def expand_forward(ctx, a, shape=()):
    shape = tuple(int(s) for s in shape)
    if len(shape) < a.ndim:
        raise ShapeError(f"expand: target {shape} has fewer dims than input {tuple(a.shape)}")
    full = tuple(a.shape[i - (len(shape) - a.ndim)] if s == -1 else s for i, s in enumerate(shape))
    ctx.saved = a.shape
    try:
        return xp_of(a).broadcast_to(a, full)
    except ValueError:
        raise ShapeError(f"expand: cannot expand shape {tuple(a.shape)} to {shape}") from None


def expand_backward(ctx, g):
    return (unbroadcast(g, ctx.saved),)


def squeeze_forward(ctx, a, dim=None):
    ctx.saved = a.shape
    if dim is None:
        return a.squeeze()
    d = norm_dim(dim, a.ndim, "squeeze")
    return a.squeeze(d) if a.shape[d] == 1 else a


def unsqueeze_forward(ctx, a, dim=0):
    ctx.saved = a.shape
    d = int(dim)
    if not -(a.ndim + 1) <= d <= a.ndim:
        raise ShapeError(f"unsqueeze: dim {dim} out of range for a tensor with {a.ndim} dims")
    return xp_of(a).expand_dims(a, d % (a.ndim + 1))


squeeze_backward = view_backward
unsqueeze_backward = view_backward


def contiguous_forward(ctx, a):
    return xp_of(a).ascontiguousarray(a)


def contiguous_backward(ctx, g):
    return (g,)


def clone_forward(ctx, a):
    return a.copy()


clone_backward = contiguous_backward


def getitem_forward(ctx, a, index=None):
    ctx.saved = (a.shape, a.dtype, index)
    try:
        return a[index]
    except IndexError as e:
        raise ShapeError(f"indexing a tensor of shape {tuple(a.shape)} with {index!r}: {e}") from None


def getitem_backward(ctx, g):
    shape, dt, index = ctx.saved
    xp = xp_of(g)
    out = xp.zeros(shape, dtype=g.dtype)
    if _is_basic(index):
        out[index] = g
    else:
        xp.add.at(out, index, g)  # repeated indices accumulate
    return (out,)


def _is_basic(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(isinstance(i, int | slice) or i is None or i is Ellipsis for i in items)


def setitem_forward(ctx, a, value, index=None):
    """Functional form of ``a[index] = value``: returns a new array (autograd-aware in-place)."""
    out = a.copy()
    out[index] = value
    ctx.saved = (index, getattr(value, "shape", ()))
    return out


def setitem_backward(ctx, g):
    index, vshape = ctx.saved
    ga = g.copy()
    ga[index] = 0
    gv = unbroadcast(g[index], vshape) if ctx.needs[1] else None
    return ga, gv


def cat_forward(ctx, *arrays, dim=0):
    a0 = arrays[0]
    d = norm_dim(dim, a0.ndim, "cat")
    for i, a in enumerate(arrays):
        if a.ndim != a0.ndim or any(a.shape[k] != a0.shape[k] for k in range(a0.ndim) if k != d):
            raise ShapeError(f"cat: tensor {i} has shape {tuple(a.shape)}, which does not match tensor 0's "
                             f"{tuple(a0.shape)} outside dim {d}")
    ctx.saved = (d, [a.shape[d] for a in arrays])
    return xp_of(a0).concatenate(arrays, axis=d)


def cat_backward(ctx, g):
    d, sizes = ctx.saved
    out, start = [], 0
    for s in sizes:
        sl = [slice(None)] * g.ndim
        sl[d] = slice(start, start + s)
        out.append(g[tuple(sl)])
        start += s
    return tuple(out)


def stack_forward(ctx, *arrays, dim=0):
    a0 = arrays[0]
    for i, a in enumerate(arrays):
        if a.shape != a0.shape:
            raise ShapeError(f"stack: tensor {i} has shape {tuple(a.shape)}, tensor 0 has {tuple(a0.shape)}")
    d = int(dim) % (a0.ndim + 1)
    ctx.saved = d
    return xp_of(a0).stack(arrays, axis=d)


def stack_backward(ctx, g):
    d = ctx.saved
    return tuple(g.take(i, axis=d) for i in range(g.shape[d]))


def tril_forward(ctx, a, diagonal=0):
    ctx.saved = diagonal
    return xp_of(a).tril(a, diagonal)


def tril_backward(ctx, g):
    return (xp_of(g).tril(g, ctx.saved),)


def triu_forward(ctx, a, diagonal=0):
    ctx.saved = diagonal
    return xp_of(a).triu(a, diagonal)


def triu_backward(ctx, g):
    return (xp_of(g).triu(g, ctx.saved),)
