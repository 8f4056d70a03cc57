"""Copying rearrangements: flip, roll, diagonal, repeat (tile), repeat_interleave, pad.

Each keeps what it needs for backward: flip/roll invert themselves, repeat sums the tiles, repeat_interleave
and pad scatter-add through their index maps (a reflected or replicated element receives every copy's
gradient).
"""

from __future__ import annotations

import numpy as np
from blutensor.errors import ArgumentError, ShapeError
from blutensor.ops._util import norm_dim, scatter_add, xp_of


def flip_forward(ctx, a, dims=()):
    d = tuple(norm_dim(x, a.ndim, "flip") for x in dims) if a.ndim else ()
    ctx.saved = d
    return xp_of(a).flip(a, d).copy() if d else a.copy()


def flip_backward(ctx, g):
    return (xp_of(g).flip(g, ctx.saved) if ctx.saved else g,)


def roll_forward(ctx, a, shifts=(), dims=None):
    xp = xp_of(a)
    if dims is None:
        ctx.saved = (shifts, None, a.shape)
        return xp.roll(a.reshape(-1), shifts).reshape(a.shape)
    d = tuple(norm_dim(x, a.ndim, "roll") for x in dims) if a.ndim else tuple(0 for _ in dims)
    ctx.saved = (shifts, d, a.shape)
    if a.ndim == 0:
        return a.copy()
    return xp.roll(a, shifts, axis=d)


def roll_backward(ctx, g):
    shifts, d, shape = ctx.saved
    xp = xp_of(g)
    neg = tuple(-s for s in shifts) if isinstance(shifts, tuple) else -shifts
    if d is None:
        return (xp.roll(g.reshape(-1), neg).reshape(shape),)
    return (xp.roll(g, neg, axis=d) if g.ndim else g,)


def _diag_index(shape, offset, d1, d2):
    n1, n2 = shape[d1], shape[d2]
    r0, c0 = max(-offset, 0), max(offset, 0)
    n = max(min(n1 - r0, n2 - c0), 0)
    return r0, c0, n


def diagonal_forward(ctx, a, offset=0, dim1=0, dim2=1):
    if a.ndim < 2:
        raise ShapeError(f"diagonal: needs at least 2 dims, got shape {tuple(a.shape)}")
    d1, d2 = norm_dim(dim1, a.ndim, "diagonal"), norm_dim(dim2, a.ndim, "diagonal")
    if d1 == d2:
        raise ShapeError(f"diagonal: dim1 and dim2 must differ, got {dim1} and {dim2}")
    ctx.saved = (a.shape, offset, d1, d2)
    return a.diagonal(offset, d1, d2).copy()


def diagonal_backward(ctx, g):
    shape, offset, d1, d2 = ctx.saved
    xp = xp_of(g)
    out = xp.zeros(shape, dtype=g.dtype)
    r0, c0, n = _diag_index(shape, offset, d1, d2)
    i = xp.arange(n)
    xp.moveaxis(out, (d1, d2), (-2, -1))[..., i + r0, i + c0] = g
    return (out,)


def repeat_forward(ctx, a, sizes=()):
    if len(sizes) < a.ndim:
        raise ShapeError(f"repeat: {len(sizes)} repeat counts for a tensor with {a.ndim} dims (need at least "
                         f"{a.ndim})")
    if any(s < 0 for s in sizes):
        raise ArgumentError(f"repeat: repeat counts must be >= 0, got {tuple(sizes)}")
    a2 = a.reshape((1,) * (len(sizes) - a.ndim) + a.shape)
    ctx.saved = (a.shape, a2.shape, tuple(sizes))
    return xp_of(a).tile(a2, sizes)


def repeat_backward(ctx, g):
    shape, s2, sizes = ctx.saved
    inter = []
    for r, s in zip(sizes, s2):
        inter += [r, s]
    return (g.reshape(inter).sum(axis=tuple(range(0, 2 * len(sizes), 2))).reshape(shape),)


def repeat_interleave_forward(ctx, a, repeats, dim=None, output_size=None):
    """``repeats``: a Python int or an int array (one count per element along ``dim``)."""
    xp = xp_of(a)
    src = a.reshape(-1) if dim is None else a
    d = 0 if dim is None else (0 if a.ndim == 0 else norm_dim(dim, a.ndim, "repeat_interleave"))
    if src.ndim == 0:
        src = src.reshape(1)
    n = src.shape[d]
    r = repeats
    if hasattr(r, "shape"):
        if r.ndim > 1 or (r.ndim == 1 and r.size not in (1, n)):
            raise ShapeError(f"repeat_interleave: repeats of shape {tuple(r.shape)} must be 0-d or hold one count "
                             f"for each of the {n} elements along dim {d}")
        if r.size and int(r.min()) < 0:
            raise ArgumentError("repeat_interleave: repeats must be >= 0")
        r = r.reshape(-1)
        if r.size == 1:
            r = int(r[0])
        elif xp is not np:  # CuPy's repeat takes an int or a host list of counts
            r = r.get().tolist()
    elif r < 0:
        raise ArgumentError(f"repeat_interleave: repeats must be >= 0, got {r}")
    pos = xp.repeat(xp.arange(n), r)
    if output_size is not None and int(pos.size) != output_size:
        raise ShapeError(f"repeat_interleave: output_size {output_size} does not match the {int(pos.size)} "
                         f"repeated elements")
    ctx.saved = (a.shape, src.shape, pos, d)
    return xp.take(src, pos, axis=d)


def repeat_interleave_backward(ctx, g):
    shape, sshape, pos, d = ctx.saved
    out = xp_of(g).zeros(sshape, dtype=g.dtype)
    scatter_add(out, (slice(None),) * d + (pos,), g)
    return out.reshape(shape), None


def _pad_map(n, left, right, mode, xp):
    """Source position of each output position along one dim (-1: the constant fill)."""
    if mode == "constant":
        m = np.concatenate([np.full(max(left, 0), -1), np.arange(n), np.full(max(right, 0), -1)])
        lo = -left if left < 0 else 0
        hi = m.size + right if right < 0 else m.size
        m = m[lo:hi]
    else:
        npmode = {"reflect": "reflect", "replicate": "edge", "circular": "wrap"}[mode]
        m = np.pad(np.arange(n), (max(left, 0), max(right, 0)), mode=npmode)
        lo = -left if left < 0 else 0
        hi = m.size + right if right < 0 else m.size
        m = m[lo:hi]
    return m if xp is np else xp.asarray(m)


def pad_forward(ctx, a, pad=(), mode="constant", value=0.0):
    """PyTorch's F.pad: ``pad`` = (left, right) pairs from the last dim backwards; negative sizes crop."""
    xp = xp_of(a)
    npairs = len(pad) // 2
    maps = []
    out = a
    for k in range(npairs):
        d = a.ndim - 1 - k
        left, right = pad[2 * k], pad[2 * k + 1]
        n = a.shape[d]
        if mode == "reflect" and (left >= n or right >= n):
            raise ShapeError(f"pad: reflect padding ({left}, {right}) must be smaller than dim {d} of size {n} "
                             f"(shape {tuple(a.shape)})")
        if mode == "circular" and (left > n or right > n):
            raise ShapeError(f"pad: circular padding ({left}, {right}) must be at most dim {d}'s size {n}")
        if mode in ("reflect", "replicate", "circular") and n == 0:
            raise ShapeError(f"pad: {mode} padding needs a non-empty dim {d}, got shape {tuple(a.shape)}")
        if n + left + right < 0:
            raise ShapeError(f"pad: padding ({left}, {right}) leaves a negative size for dim {d} of size {n}")
        m = _pad_map(n, left, right, mode, xp)
        maps.append((d, m))
        valid = m >= 0
        out = xp.take(out, xp.where(valid, m, 0), axis=d)
        if mode == "constant" and not bool(valid.all()):
            shape = [1] * out.ndim
            shape[d] = m.size
            out = xp.where(valid.reshape(shape), out, xp.asarray(value, dtype=out.dtype))
    ctx.saved = (a.shape, maps)
    return out.astype(a.dtype, copy=False) if out is not a else a.copy()


def pad_backward(ctx, g):
    shape, maps = ctx.saved
    xp = xp_of(g)
    for d, m in reversed(maps):
        valid = m >= 0
        tshape = list(g.shape)
        tshape[d] = shape[d]
        out = xp.zeros(tshape, dtype=g.dtype)
        keep = xp.nonzero(valid)[0]
        sel = xp.take(g, keep, axis=d)
        scatter_add(out, (slice(None),) * d + (m[keep],), sel)
        g = out
    return (g,)
