"""Shape ops: views without copies (view, reshape, transpose, permute, expand, squeeze, unsqueeze,
indexing) and the copying ones (contiguous, cat, stack, advanced indexing, setitem)."""

from __future__ import annotations

import operator

import numpy as np
from blutensor.errors import DTypeError, ShapeError
from blutensor.ops._util import norm_dim, scatter_add, unbroadcast, xp_of


def _resolve_shape(shape, numel: int, op: str, src) -> tuple:
    try:
        shape = tuple(operator.index(s) for s in shape)
    except TypeError:
        raise DTypeError(f"{op}: shape {tuple(shape)!r} must hold ints (input shape {tuple(src)})") from None
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
    ctx.saved = a.shape
    if a.flags.c_contiguous:
        try:
            return a.reshape(shape)  # the array module checks the size (and resolves -1)
        except (ValueError, TypeError):
            _resolve_shape(shape, a.size, "view", a.shape)  # raises the descriptive error
            raise
    shape = _resolve_shape(shape, a.size, "view", a.shape)
    out = a.reshape(shape)
    if out.size and _ptr(out) != _ptr(a) or out.base is None:
        raise ShapeError(
            f"view: cannot view a non-contiguous tensor of shape {tuple(a.shape)} (strides "
            f"{tuple(s // a.itemsize for s in a.strides)}) as {shape} without a copy; use reshape() or "
            f".contiguous().view()")
    return out


def _ptr(a) -> int:
    """Address of the first element (NumPy or CuPy)."""
    return a.__array_interface__["data"][0] if hasattr(a, "__array_interface__") else a.data.ptr


def reshape_forward(ctx, a, shape=()):
    """A view when ``a`` is contiguous (dispatched as 'view'), else a contiguous copy."""
    shape = _resolve_shape(shape, a.size, "reshape", a.shape)
    ctx.saved = a.shape
    return xp_of(a).ascontiguousarray(a).reshape(shape)


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
    n = a.ndim
    if not (-n <= dim0 < n and -n <= dim1 < n):
        norm_dim(dim0, n, "transpose"), norm_dim(dim1, n, "transpose")  # raises the descriptive error
    ctx.saved = (dim0, dim1)
    return a.swapaxes(dim0, dim1)


def transpose_backward(ctx, g):
    d0, d1 = ctx.saved
    return (g.swapaxes(d0, d1),)


def expand_forward(ctx, a, shape=()):
    try:
        shape = tuple(operator.index(s) for s in shape)
    except TypeError:
        raise DTypeError(f"expand: shape {tuple(shape)!r} must hold ints (input shape {tuple(a.shape)})") from None
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
    if a.ndim == 0:  # dim 0 / -1 of a 0-d tensor: nothing to squeeze, as in PyTorch
        norm_dim(dim, 0, "squeeze") if not isinstance(dim, tuple | list) else None
        return a
    if isinstance(dim, tuple | list):
        ds = tuple(d for d in norm_dim(tuple(dim), a.ndim, "squeeze") if a.shape[d] == 1)
        return a.squeeze(ds) if ds else a
    d = norm_dim(dim, a.ndim, "squeeze")
    return a.squeeze(d) if a.shape[d] == 1 else a


def unsqueeze_forward(ctx, a, dim=0):
    ctx.saved = a.shape
    try:
        d = operator.index(dim)
    except TypeError:
        raise DTypeError(f"unsqueeze: dim must be an int, got {type(dim).__name__} {dim!r}") from None
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
    """Basic indexing (ints, slices, None, Ellipsis): a view of ``a``."""
    ctx.saved = (a.shape, index)
    try:
        out = a[index]
    except IndexError as e:
        raise ShapeError(f"indexing a tensor of shape {tuple(a.shape)} with {index!r}: {e}") from None
    if isinstance(out, np.generic):  # NumPy returns a scalar copy for a full integer index: keep a view
        out = a[(index if isinstance(index, tuple) else (index,)) + (Ellipsis,)]
    return out


def getitem_backward(ctx, g):
    shape, index = ctx.saved
    out = xp_of(g).zeros(shape, dtype=g.dtype)
    out[index] = g
    return (out,)


def index_forward(ctx, a, index=None):
    """Advanced indexing (integer/bool arrays): a copy; repeated indices accumulate in backward."""
    ctx.saved = (a.shape, index)
    try:
        return a[index]
    except IndexError as e:
        raise ShapeError(f"indexing a tensor of shape {tuple(a.shape)} with {_short(index)}: {e}") from None


def index_backward(ctx, g):
    shape, index = ctx.saved
    xp = xp_of(g)
    out = xp.zeros(shape, dtype=g.dtype)
    scatter_add(out, index, g)
    return (out,)


def _short(index) -> str:
    items = index if isinstance(index, tuple) else (index,)
    return "(" + ", ".join(f"array{tuple(i.shape)}" if hasattr(i, "shape") else repr(i) for i in items) + ")"


def setitem_forward(ctx, a, value, index=None):
    """Functional form of ``a[index] = value``: returns a new array (autograd-aware in-place)."""
    out = a.copy()
    try:
        out[index] = value
    except ValueError as e:
        raise ShapeError(f"setitem: cannot assign a value of shape {tuple(getattr(value, 'shape', ()))} to "
                         f"the selection {_short(index)} of a tensor of shape {tuple(a.shape)}: {e}") from None
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
