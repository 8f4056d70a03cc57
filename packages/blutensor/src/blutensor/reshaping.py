"""Copying rearrangements and einsum under PyTorch's names: flip, roll, diagonal, repeat, repeat_interleave,
unbind, movedim, t, einsum (functions; re-exported by ``functional`` and bound as Tensor methods)."""

from __future__ import annotations

import numbers

from blutensor.errors import ArgumentError, DTypeError, ShapeError
from blutensor.ops._util import norm_dim
from blutensor.ops.dispatch import apply


def flip(a, dims):
    """A copy with the order of ``dims`` reversed."""
    dims = (dims,) if isinstance(dims, numbers.Integral) else tuple(dims)
    return apply("flip", a, dims=dims)


def roll(a, shifts, dims=None):
    """Elements shifted (cyclically) by ``shifts`` along ``dims`` (the flattened tensor when None)."""
    if dims is None:
        if not isinstance(shifts, numbers.Integral):
            if len(shifts) != 1:
                raise ArgumentError(f"roll: give dims for {len(shifts)} shifts")
            shifts = shifts[0]
        return apply("roll", a, shifts=int(shifts), dims=None)
    sh = (shifts,) if isinstance(shifts, numbers.Integral) else tuple(shifts)
    dm = (dims,) if isinstance(dims, numbers.Integral) else tuple(dims)
    if len(sh) != len(dm):
        raise ArgumentError(f"roll: shifts {sh} and dims {dm} must have the same length")
    return apply("roll", a, shifts=tuple(int(x) for x in sh), dims=dm)


def diagonal(a, offset=0, dim1=0, dim2=1):
    """The diagonal (offset above/below) of the dim1 x dim2 planes, as the last dim (a copy)."""
    return apply("diagonal", a, offset=int(offset), dim1=dim1, dim2=dim2)


def repeat(a, *sizes):
    """Tile ``a`` ``sizes[i]`` times along dim i (PyTorch's Tensor.repeat; NumPy's tile)."""
    from blutensor.functional import _size

    return apply("repeat", a, sizes=_size(sizes))


def repeat_interleave(a, repeats, dim=None, *, output_size=None):
    """Each element repeated ``repeats`` times (an int, or a Tensor of per-element counts) along ``dim``."""
    from blutensor._tensor import Tensor

    if isinstance(repeats, Tensor):
        if repeats.dtype.is_floating_point or repeats.dtype.name == "bool":
            raise DTypeError(f"repeat_interleave: repeats must hold ints, got {repeats._desc()}")
        return apply("repeat_interleave", a, repeats._data, dim=dim, output_size=output_size)
    if isinstance(repeats, bool) or not isinstance(repeats, numbers.Integral):
        raise DTypeError(f"repeat_interleave: repeats must be an int or an int Tensor, got {type(repeats).__name__}")
    return apply("repeat_interleave", a, int(repeats), dim=dim, output_size=output_size)


def unbind(a, dim=0):
    """The slices along ``dim`` as a tuple of views."""
    if a.ndim == 0:
        raise ShapeError("unbind: cannot unbind a 0-d tensor")
    d = norm_dim(dim, a.ndim, "unbind")
    return tuple(apply("getitem", a, index=(slice(None),) * d + (i,)) for i in range(a.shape[d]))


def movedim(a, source, destination):
    """Dims ``source`` moved to positions ``destination`` (a view)."""
    src = (source,) if isinstance(source, numbers.Integral) else tuple(source)
    dst = (destination,) if isinstance(destination, numbers.Integral) else tuple(destination)
    if len(src) != len(dst):
        raise ArgumentError(f"movedim: source {src} and destination {dst} must have the same length")
    nd = a.ndim
    src = tuple(norm_dim(d, nd, "movedim") for d in src)
    dst = tuple(norm_dim(d, nd, "movedim") for d in dst)
    order = [d for d in range(nd) if d not in src]
    for d, s_ in sorted(zip(dst, src)):
        order.insert(d, s_)
    from blutensor.functional import permute

    return permute(a, tuple(order))


def t(a):
    """Transpose of a matrix (0-d and 1-d tensors are returned as they are)."""
    if a.ndim > 2:
        raise ShapeError(f"t: expects a tensor with <= 2 dims, got shape {tuple(a.shape)} (use transpose or mT)")
    return a if a.ndim < 2 else apply("transpose", a, dim0=0, dim1=1)


def einsum(equation, *operands):
    """Einstein summation (``"bij,bjk->bik"``; ``...`` for broadcast dims), differentiable in every operand."""
    from blutensor._tensor import Tensor

    if not isinstance(equation, str):
        raise DTypeError(f"einsum: the equation must be a str, got {type(equation).__name__}")
    if len(operands) == 1 and isinstance(operands[0], list | tuple):
        operands = tuple(operands[0])
    if not operands:
        raise ArgumentError("einsum: needs at least one operand")
    for i, o in enumerate(operands):
        if not isinstance(o, Tensor):
            raise DTypeError(f"einsum: operand {i} is a {type(o).__name__}, not a Tensor")
    want = operands[0].dtype
    if any(o.dtype is not want for o in operands):
        from blutensor.dtypes import result_type
        from blutensor.functional import cast

        want = result_type(*operands)
        operands = tuple(cast(o, want) for o in operands)
    return apply("einsum", *operands, equation=equation)
