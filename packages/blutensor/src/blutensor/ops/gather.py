"""Index ops along one dim: gather, scatter, scatter_add, index_select, index_add, take_along_dim.

Indices are int64 arrays checked against the dim's size before any work (a ShapeError naming the op, the
offending index and the size), so a bad index never reaches NumPy/CuPy's own indexing. Repeated indices
accumulate in ``scatter_add``/``index_add`` and in every backward; ``scatter`` with repeated indices keeps one
of the written values (which one is unspecified, as in PyTorch).
"""

from __future__ import annotations

import numpy as np
from blutensor.errors import ShapeError
from blutensor.ops._util import norm_dim, scatter_add, xp_of


def _check_index(op, index, n, what="dim"):
    """Refuse indices outside [0, n). On CUDA, the policy's ``validate_indices`` decides as for embedding and
    cross_entropy: 'lazy' flags a bad index on the device (raised at ``index_check.raise_pending``; the gather
    itself wraps around, as CuPy's indexing does), 'sync' checks here (one host sync), '0' skips the check."""
    if index.size and type(index) is not np.ndarray:
        from blutensor.backends import cupy as cupy_backend
        from blutensor.backends.cupy import index_check

        m = index_check.mode()
        if m == "off":
            return
        if m == "lazy" and cupy_backend.cupy_installed():
            idx = xp_of(index).ascontiguousarray(index.reshape(-1), dtype=np.int64)
            index_check.check_async(idx, 0, n, f"{op} ({what} of size {n})")
            return
    if index.size:
        lo, hi = int(index.min()), int(index.max())
        if lo < 0 or hi >= n:  # PyTorch's index ops take no negative indices
            bad = lo if lo < 0 else hi
            raise ShapeError(f"{op}: index {bad} is out of range for {what} of size {n} (indices must be in "
                             f"[0, {n}))")


def _dim(op, a, dim):
    return 0 if a.ndim == 0 else norm_dim(dim, a.ndim, op)


def _along(index, d):
    """Full advanced-index tuple addressing ``index``'s positions with dim ``d`` replaced by its values."""
    xp = xp_of(index)
    grids = [xp.arange(s).reshape((1,) * i + (s,) + (1,) * (index.ndim - i - 1)) for i, s in enumerate(index.shape)]
    grids[d] = index
    return tuple(grids)


def _fit(op, a, index, d, src=None):
    if index.ndim != max(a.ndim, 1) and not (a.ndim == 0 and index.ndim <= 1):
        raise ShapeError(f"{op}: index must have the input's number of dims ({a.ndim}), got shape "
                         f"{tuple(index.shape)}")
    for i, s in enumerate(index.shape):
        if i != d and a.ndim and s > a.shape[i]:
            raise ShapeError(f"{op}: index shape {tuple(index.shape)} exceeds input shape {tuple(a.shape)} "
                             f"outside dim {d}")
        if src is not None and src.ndim and s > src.shape[i]:
            raise ShapeError(f"{op}: index shape {tuple(index.shape)} exceeds src shape {tuple(src.shape)}")


def gather_forward(ctx, a, index, dim=0):
    d = _dim("gather", a, dim)
    _fit("gather", a, index, d)
    _check_index("gather", index, a.shape[d] if a.ndim else 1)
    a2 = a.reshape(1) if a.ndim == 0 else a
    idx = index.reshape(1) if index.ndim == 0 else index
    ctx.saved = (a.shape, idx, d, index.shape)
    return a2[_along(idx, d)].reshape(index.shape)


def gather_backward(ctx, g):
    shape, idx, d, ishape = ctx.saved
    xp = xp_of(g)
    out = xp.zeros(shape if shape else (1,), dtype=g.dtype)
    scatter_add(out, _along(idx, d), g.reshape(idx.shape))
    return out.reshape(shape), None


def take_along_dim_forward(ctx, a, index, dim=None):
    xp = xp_of(a)
    if dim is None:
        flat = a.reshape(-1)
        _check_index("take_along_dim", index, flat.size, "the flattened input")
        ctx.saved = (a.shape, index, None, None)
        return flat[index.reshape(-1)].reshape(index.shape)
    d = _dim("take_along_dim", a, dim)
    _check_index("take_along_dim", index, a.shape[d] if a.ndim else 1)
    if index.ndim != a.ndim:
        raise ShapeError(f"take_along_dim: input {tuple(a.shape)} and indices {tuple(index.shape)} must have the "
                         f"same number of dims")
    try:
        shape = list(np.broadcast_shapes(tuple(s for i, s in enumerate(a.shape) if i != d),
                                         tuple(s for i, s in enumerate(index.shape) if i != d)))
    except ValueError:
        raise ShapeError(f"take_along_dim: input {tuple(a.shape)} and indices {tuple(index.shape)} do not "
                         f"broadcast outside dim {d}") from None
    ash = shape[:d] + [a.shape[d]] + shape[d:]
    ish = shape[:d] + [index.shape[d]] + shape[d:]
    ab = xp.broadcast_to(a, ash)
    ib = xp.broadcast_to(index, ish)
    ctx.saved = (a.shape, ib, d, tuple(ash))
    return xp.take_along_axis(ab, ib, axis=d)


def take_along_dim_backward(ctx, g):
    from blutensor.ops._util import unbroadcast

    shape, ib, d, ash = ctx.saved
    xp = xp_of(g)
    if d is None:
        out = xp.zeros(int(np.prod(shape)), dtype=g.dtype)
        scatter_add(out, ib.reshape(-1), g.reshape(-1))
        return out.reshape(shape), None
    out = xp.zeros(ash, dtype=g.dtype)
    scatter_add(out, _along(ib % ash[d] if ash[d] else ib, d), g)
    return unbroadcast(out, shape), None


def scatter_forward(ctx, a, index, src, dim=0):
    """A copy of ``a`` with ``src`` (an array or a scalar) written at ``index`` along ``dim``."""
    d = _dim("scatter", a, dim)
    srca = src if hasattr(src, "shape") else None
    _fit("scatter", a, index, d, srca)
    _check_index("scatter", index, a.shape[d] if a.ndim else 1)
    out = a.copy()
    sel = _along(index, d)
    vals = src[tuple(slice(0, s) for s in index.shape)] if srca is not None and srca.ndim else src
    out[sel] = vals
    ctx.saved = (index, d, srca is not None)
    ctx.src_shape = getattr(src, "shape", ())
    return out


def scatter_backward(ctx, g):
    index, d, has_src = ctx.saved
    ga = g.copy()
    sel = _along(index, d)
    ga[sel] = 0
    gs = None
    if has_src and len(ctx.needs) > 2 and ctx.needs[2]:
        gs = _pad_to(g[sel], ctx)
    return ga, None, gs


def _pad_to(v, ctx):
    shape = ctx.src_shape
    if tuple(v.shape) == tuple(shape):
        return v
    out = xp_of(v).zeros(shape, dtype=v.dtype)
    out[tuple(slice(0, s) for s in v.shape)] = v
    return out


def scatter_add_forward(ctx, a, index, src, dim=0):
    d = _dim("scatter_add", a, dim)
    _fit("scatter_add", a, index, d, src)
    _check_index("scatter_add", index, a.shape[d] if a.ndim else 1)
    out = a.copy()
    scatter_add(out, _along(index, d), src[tuple(slice(0, s) for s in index.shape)])
    ctx.saved = (index, d, True)
    ctx.src_shape = src.shape
    return out


def scatter_add_backward(ctx, g):
    index, d, _ = ctx.saved
    gs = _pad_to(g[_along(index, d)], ctx) if ctx.needs[2] else None
    return g, None, gs


def index_select_forward(ctx, a, index, dim=0):
    xp = xp_of(a)
    d = _dim("index_select", a, dim)
    if index.ndim > 1:
        raise ShapeError(f"index_select: index must be 0-d or 1-d, got shape {tuple(index.shape)}")
    n = a.shape[d] if a.ndim else 1
    _check_index("index_select", index, n)
    ctx.saved = (a.shape, index.reshape(-1), d)
    if a.ndim == 0:
        return a.reshape(1)[index.reshape(-1)].reshape(())
    return xp.take(a, index.reshape(-1), axis=d)


def index_select_backward(ctx, g):
    shape, index, d = ctx.saved
    xp = xp_of(g)
    if not shape:
        return g.sum().reshape(()), None
    out = xp.zeros(shape, dtype=g.dtype)
    scatter_add(out, (slice(None),) * d + (index,), g)
    return out, None


def index_add_forward(ctx, a, index, source, dim=0, alpha=1):
    d = _dim("index_add", a, dim)
    if index.ndim > 1:
        raise ShapeError(f"index_add: index must be 0-d or 1-d, got shape {tuple(index.shape)}")
    idx = index.reshape(-1)
    want = list(a.shape)
    if a.ndim:
        want[d] = idx.size
    if tuple(source.shape) != tuple(want) and not (a.ndim == 0 and source.size == idx.size):
        raise ShapeError(f"index_add: source shape {tuple(source.shape)} must be {tuple(want)} (input "
                         f"{tuple(a.shape)} with dim {d} of the index's length {idx.size})")
    _check_index("index_add", idx, a.shape[d] if a.ndim else 1)
    out = a.copy().reshape(a.shape if a.ndim else (1,))
    scatter_add(out, (slice(None),) * d + (idx,), source.reshape(out.shape[:d] + (idx.size,) + out.shape[d + 1:])
                * alpha if alpha != 1 else source.reshape(out.shape[:d] + (idx.size,) + out.shape[d + 1:]))
    ctx.saved = (idx, d, alpha, source.shape)
    return out.reshape(a.shape)


def index_add_backward(ctx, g):
    idx, d, alpha, sshape = ctx.saved
    xp = xp_of(g)
    gs = None
    if ctx.needs[2]:
        g2 = g.reshape(g.shape if g.ndim else (1,))
        gs = xp.take(g2, idx, axis=d).reshape(sshape)
        if alpha != 1:
            gs = (gs * alpha).astype(g.dtype, copy=False)
    return g, None, gs
