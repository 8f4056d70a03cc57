"""Attention over one block of keys that returns the log-sum-exp: the building block of ring / blockwise
attention (context parallelism merges the blocks' outputs with their LSEs).

``attention_block_forward(q, k, v, is_causal, scale) -> (o, lse)`` and
``attention_block_backward(q, k, v, o, lse, do, is_causal, scale) -> (dq, dk, dv)`` work on arrays of
shape (..., L, E) / (..., S, E) (NumPy or CuPy). On CUDA, float32/bfloat16 inputs of a head size the flash
kernels support run those kernels (blutensor.backends.cupy.sdpa, which compute the LSE anyway); elsewhere a tiled
implementation with the same online softmax runs, holding one (query tile x key tile) block of scores at a
time: memory O(L + S) beyond the inputs, never the (L x S) scores. ``is_causal`` masks key j > query i
(top-left aligned, as ``scaled_dot_product_attention``). The backward takes the *final* ``o`` and ``lse`` of
the rows (after merging every block), so each block's gradients are exact parts of the whole.
"""

from __future__ import annotations

import math

import numpy as np
from blutensor.backends import array_module, is_cuda_array
from blutensor.errors import ShapeError
from blutensor.ops.linalg import gemm

#: query rows and key columns per tile of the portable path (a 128 x 512 float64 block is 512 KiB)
TILE_Q, TILE_K = 128, 512


def _check(q, k, v) -> None:
    if q.ndim < 2 or k.ndim != q.ndim or v.ndim != q.ndim or q.shape[:-2] != k.shape[:-2] \
            or k.shape[:-1] != v.shape[:-1] or q.shape[-1] != k.shape[-1]:
        raise ShapeError(f"attention block: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be "
                         f"(..., L, E), (..., S, E), (..., S, Ev) with equal leading dims")


def _flash_variant(q, k, v):
    """The CUDA flash kernel variant for these arrays, or None (then the tiled path runs)."""
    if not is_cuda_array(q) or k.shape != v.shape or not (q.dtype == k.dtype == v.dtype):
        return None
    from blutensor.backends.cupy.sdpa import pick_variant

    return pick_variant(q.dtype, q.shape[-1])


def attention_block_forward(q, k, v, is_causal: bool = False, scale: float | None = None):
    """(o, lse): softmax(q k^T * scale [causal]) v and the natural-log sum of exp of each row's scores (-inf
    for a row that sees no key). lse has q's leading shape (..., L); float32 from the flash kernels, q's float
    dtype otherwise."""
    _check(q, k, v)
    sc = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    variant = _flash_variant(q, k, v)
    if variant is not None:
        from blutensor.backends.cupy.sdpa import _prepared, flash_attention_forward

        L, S, hd = q.shape[-2], k.shape[-2], q.shape[-1]
        o, lse = flash_attention_forward(_prepared(q, L, hd), _prepared(k, S, hd), _prepared(v, S, hd),
                                         bool(is_causal), sc, variant)
        return o.reshape(q.shape), lse.reshape(q.shape[:-1])
    return _tiled_forward(q, k, v, bool(is_causal), sc)


def attention_block_backward(q, k, v, o, lse, do, is_causal: bool = False, scale: float | None = None):
    """(dq, dk, dv) of this block given the rows' final output ``o``, log-sum-exp ``lse`` and output gradient."""
    _check(q, k, v)
    if o.shape != q.shape[:-1] + (v.shape[-1],) or do.shape != o.shape or lse.shape != q.shape[:-1]:
        raise ShapeError(f"attention block backward: o {tuple(o.shape)}, do {tuple(do.shape)}, lse "
                         f"{tuple(lse.shape)} do not fit q {tuple(q.shape)} and v {tuple(v.shape)}")
    sc = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    variant = _flash_variant(q, k, v)
    if variant is not None:
        from blutensor.backends.cupy.sdpa import _prepared, flash_attention_backward

        xp = array_module(q)
        L, S, hd = q.shape[-2], k.shape[-2], q.shape[-1]
        lse3 = xp.ascontiguousarray(lse.reshape(-1, L).astype(xp.float32, copy=False))
        dq, dk, dv = flash_attention_backward(_prepared(q, L, hd), _prepared(k, S, hd), _prepared(v, S, hd),
                                              _prepared(o.astype(q.dtype, copy=False), L, hd), lse3,
                                              _prepared(do.astype(q.dtype, copy=False), L, hd),
                                              bool(is_causal), sc, variant)
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)
    return _tiled_backward(q, k, v, o, lse, do, bool(is_causal), sc)


def _key_end(i1: int, S: int, causal: bool) -> int:
    return min(S, i1) if causal else S


def _scores(q_t, k_t, i0: int, j0: int, causal: bool, sc: float, xp):
    s = gemm(q_t, k_t.swapaxes(-1, -2)) * sc
    i1, j1 = i0 + q_t.shape[-2], j0 + k_t.shape[-2]
    if causal and j1 - 1 > i0:  # the tile reaches above the diagonal
        vis = xp.arange(i0, i1)[:, None] >= xp.arange(j0, j1)[None, :]
        s = xp.where(vis, s, -xp.inf)
    return s


def _tiled_forward(q, k, v, causal: bool, sc: float):
    xp = array_module(q)
    L, S = q.shape[-2], k.shape[-2]
    lead = q.shape[:-2]
    ft = np.result_type(q.dtype, np.float32) if q.dtype.kind == "f" else np.float32
    o = xp.zeros(lead + (L, v.shape[-1]), dtype=q.dtype)
    lse = xp.full(lead + (L,), -np.inf, dtype=ft)
    for i0 in range(0, L, TILE_Q):
        i1 = min(L, i0 + TILE_Q)
        q_t = q[..., i0:i1, :]
        m = xp.full(lead + (i1 - i0, 1), -np.inf, dtype=ft)
        den = xp.zeros(lead + (i1 - i0, 1), dtype=ft)
        acc = xp.zeros(lead + (i1 - i0, v.shape[-1]), dtype=ft)
        for j0 in range(0, _key_end(i1, S, causal), TILE_K):
            j1 = min(_key_end(i1, S, causal), j0 + TILE_K)
            s = _scores(q_t, k[..., j0:j1, :], i0, j0, causal, sc, xp)
            m_new = xp.maximum(m, s.max(axis=-1, keepdims=True))
            base = xp.where(xp.isfinite(m_new), m_new, 0.0)
            p = xp.exp(s - base)
            corr = xp.exp(m - base)
            den = den * corr + p.sum(axis=-1, keepdims=True)
            acc = acc * corr + gemm(p.astype(v.dtype, copy=False), v[..., j0:j1, :])
            m = m_new
        seen = den > 0
        o[..., i0:i1, :] = acc / xp.where(seen, den, 1.0)
        lse[..., i0:i1] = xp.where(seen, xp.log(xp.where(seen, den, 1.0)) + xp.where(seen, m, 0.0), -np.inf)[..., 0]
    return o, lse


def _tiled_backward(q, k, v, o, lse, do, causal: bool, sc: float):
    xp = array_module(q)
    L, S = q.shape[-2], k.shape[-2]
    D = (do * o).sum(axis=-1, keepdims=True)  # rowsum(dO * O): the softmax backward's correction
    dq, dk, dv = xp.zeros_like(q), xp.zeros_like(k), xp.zeros_like(v)
    safe = xp.where(xp.isfinite(lse), lse, 0.0)[..., None]
    live = xp.isfinite(lse)[..., None]
    for i0 in range(0, L, TILE_Q):
        i1 = min(L, i0 + TILE_Q)
        q_t, do_t, D_t = q[..., i0:i1, :], do[..., i0:i1, :], D[..., i0:i1, :]
        for j0 in range(0, _key_end(i1, S, causal), TILE_K):
            j1 = min(_key_end(i1, S, causal), j0 + TILE_K)
            k_t, v_t = k[..., j0:j1, :], v[..., j0:j1, :]
            s = _scores(q_t, k_t, i0, j0, causal, sc, xp)
            p = xp.where(live[..., i0:i1, :], xp.exp(s - safe[..., i0:i1, :]), 0.0)
            dv[..., j0:j1, :] += gemm(p.swapaxes(-1, -2), do_t)
            ds = p * (gemm(do_t, v_t.swapaxes(-1, -2)) - D_t) * sc
            dq[..., i0:i1, :] += gemm(ds, k_t)
            dk[..., j0:j1, :] += gemm(ds.swapaxes(-1, -2), q_t)
    return dq, dk, dv
