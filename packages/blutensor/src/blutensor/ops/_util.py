"""Helpers shared by op kernels: array module lookup, broadcasting reduction, shapes."""

from __future__ import annotations

import operator

import numpy as np
from blutensor.backends import array_module, array_provider, array_providers


def xp_of(a):
    """NumPy or CuPy for an array (fast path for NumPy)."""
    return np if type(a) is np.ndarray else array_module(a)


def into_grad(ctx, i: int, g):
    """``g`` added into the leaf gradient buffer the engine offered for input ``i`` (``ctx.grad_into``, see
    blutensor.autograd.engine) and ``ACCUMULATED`` returned, or ``g`` itself where none was offered (or the
    dtypes or shapes differ). The same one add the engine would make: results do not change."""
    into = getattr(ctx, "grad_into", None)
    if g is None or into is None or i >= len(into) or into[i] is None:
        return g
    buf = into[i]
    if g.dtype != buf.dtype or tuple(g.shape) != tuple(buf.shape):
        return g
    from blutensor.autograd.node import ACCUMULATED

    buf += g
    return ACCUMULATED


def sum_pending(ctx, i: int, g):
    """``Summed(g + pending)`` where the engine offered the gradient already pending for input ``i``
    (``ctx.grad_pending``, see blutensor.autograd.engine) and it matches ``g``, else ``g``. In place into ``g``
    (a fresh array of this backward): the same one add, with the same result, as the engine's."""
    pend = getattr(ctx, "grad_pending", None)
    if g is None or pend is None or i >= len(pend) or pend[i] is None:
        return g
    p = pend[i]
    if p.dtype != g.dtype or tuple(p.shape) != tuple(g.shape) or xp_of(p) is not xp_of(g):
        return g
    from blutensor.autograd.node import Summed

    g += p
    return Summed(g)


def shape_of(a) -> tuple:
    return getattr(a, "shape", ())


def unbroadcast(g, shape: tuple):
    """Sum ``g`` over the axes that broadcasting added or expanded to reach ``shape``."""
    if g.shape == shape:
        return g
    nd = g.ndim - len(shape)
    if nd > 0:
        g = g.sum(axis=tuple(range(nd)))
    axes = tuple(i for i, s in enumerate(shape) if s == 1 and g.shape[i] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g.reshape(shape)


def norm_dim(dim, ndim: int, op: str):
    """Normalise a dim (int, tuple or None) against ``ndim``; error names the op."""
    if dim is None:
        return None
    if isinstance(dim, list | tuple):
        dims = tuple(norm_dim(d, ndim, op) for d in dim)
        if len(set(dims)) != len(dims):
            from blutensor.errors import ShapeError

            raise ShapeError(f"{op}: dims {tuple(dim)} repeat a dim of a tensor with {ndim} dims")
        return dims
    try:
        d = operator.index(dim)
    except TypeError:
        from blutensor.errors import DTypeError

        raise DTypeError(f"{op}: dim must be an int, got {type(dim).__name__} {dim!r}") from None
    if not -max(ndim, 1) <= d < max(ndim, 1):
        from blutensor.errors import ShapeError

        raise ShapeError(f"{op}: dim {dim} out of range for a tensor with {ndim} dims")
    return d % max(ndim, 1)


def scatter_add(out, index, values) -> None:
    """``out[index] += values`` with repeated indices accumulating (NumPy add.at / cupyx.scatter_add; a registered
    array provider's ``scatter_add`` for its array type)."""
    if array_providers and (prov := array_provider(out, values)) is not None:
        return prov.scatter_add(out, index, values)
    if type(out) is np.ndarray:
        np.add.at(out, index, values)
    else:
        import cupyx

        cupyx.scatter_add(out, index, values)
