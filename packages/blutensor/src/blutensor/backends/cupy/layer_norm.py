"""Fused residual-add + LayerNorm on CUDA (kernels/layer_norm.cu) and its op kernel class."""

from __future__ import annotations

import math

import numpy as np

from blutensor.autograd.node import ACCUMULATED, Summed
from blutensor.backends.cupy import _fallback
from blutensor.backends.cupy._loader import aligned16, cupy, launch, num_sms, ptr, suffix
from blutensor.backends.cupy.occupancy import full_grid
from blutensor.ops import nn_ops
from blutensor.ops.table import Kernel

FILE = "layer_norm.cu"
_STORAGE = (np.dtype(np.float32), np.dtype(np.uint16))


#: register-resident entries (kernels/layer_norm.cu *_r<NV>_*): NV = 16-byte vectors a lane holds
_FWD_NV = (1, 2, 3, 4, 6, 8)
_BWD_NV = {"f32": (1, 2, 3, 4, 6, 8), "bf16": (1, 2, 3, 4)}
#: warps (rows in flight) per block of the register-resident kernels
_WPB = 8
#: use the register-resident kernels when the row fits (False: always the generic kernels)
USE_REG_ROWS = True
#: backward of register-resident rows with dweight/dbias summed in shared memory (``*_s<NV>_*``: ~80 instead of
#: ~128 registers at C = 768, so 3 blocks a SM instead of 2) rather than in registers (``*_r<NV>_*``); bitwise
#: the same results, and faster (measured: see benchmarks/results/blutensor_memkern_h200.json)
BWD_SMEM_ACC = True


def _vec_ok(C: int, arr_dtype, *arrays) -> bool:
    return C % (16 // np.dtype(arr_dtype).itemsize) == 0 and aligned16(*arrays)


def reg_nv(C: int, itemsize: int, choices) -> int | None:
    """Smallest NV in ``choices`` with 32*NV 16-byte vectors covering a row of C elements (None: too wide)."""
    need = -(-C // ((16 // itemsize) * 32))
    return next((n for n in choices if n >= need), None)


def layer_norm_forward(x, weight, bias, eps: float = 1e-5, residual=None, write_sum: bool = True):
    """LayerNorm over the last dim of contiguous ``x`` (N, C), optionally of ``x + residual``.

    Returns (y, mean, rstd, sum) where sum = x + residual (None without residual); mean/rstd are fp32 (N,).
    """
    cp = cupy()
    C = x.shape[-1]
    N = x.size // C if C else 0
    y = cp.empty_like(x)
    mean = cp.empty(N, dtype=cp.float32)
    rstd = cp.empty(N, dtype=cp.float32)
    s = cp.empty_like(x) if residual is not None and write_sum else None
    if N == 0:
        return y, mean, rstd, s
    vec = _vec_ok(C, x.dtype, x, residual, s, weight, bias, y)
    nv = reg_nv(C, x.dtype.itemsize, _FWD_NV) if vec and USE_REG_ROWS else None
    if nv is not None:  # the row lives in registers: read once, written once
        name = f"blu_layer_norm_forward_r{nv}_{suffix(x)}"
        grid = full_grid(FILE, name, _WPB * 32, -(-N // _WPB))
        args = (x, ptr(residual), ptr(s), ptr(weight), ptr(bias), y, mean, rstd, np.int64(N), np.int32(C))
        launch(FILE, name, grid, _WPB * 32, (*args, np.float32(eps)))
        return y, mean, rstd, s
    wpb = 8
    grid = min(math.ceil(N / wpb), num_sms() * 16)
    launch(
        FILE,
        f"blu_layer_norm_forward_{suffix(x)}",
        grid,
        wpb * 32,
        (
            x,
            ptr(residual),
            ptr(s),
            ptr(weight),
            ptr(bias),
            y,
            mean,
            rstd,
            np.int64(N),
            np.int32(C),
            np.float32(eps),
            np.int32(vec),
        ),
    )
    return y, mean, rstd, s


def layer_norm_backward(
    g, x, weight, mean, rstd, grad_sum=None, need_dx: bool = True, need_dw: bool = True, need_db: bool = True,
    dw_into=None, db_into=None,
):
    """Gradients (dx, dweight, dbias) of LayerNorm; ``x`` is the LayerNorm input (the sum when fused).

    ``grad_sum``, the gradient reaching the residual sum directly, is added into dx (fused residual).
    dweight/dbias are reduced deterministically (per-block partials, summed in block order). ``dw_into`` /
    ``db_into`` (float32 (C,), C-contiguous): the final reduction adds the sums into these buffers (gradient
    accumulation in the kernel, bit-identical to reducing then adding) and returns them as dweight / dbias.
    """
    cp = cupy()
    C = x.shape[-1]
    N = x.size // C if C else 0
    dx = cp.empty_like(x) if need_dx else None
    want_wb = (need_dw and weight is not None) or need_db
    acc = want_wb and (dw_into is not None or db_into is not None)
    if acc:  # one accumulating reduction: a wanted gradient without a buffer gets a zeroed float32 one
        dw = (dw_into if dw_into is not None else cp.zeros(C, dtype=cp.float32)) if need_dw and weight is not None \
            else None
        db = (db_into if db_into is not None else cp.zeros(C, dtype=cp.float32)) if need_db else None
        if N == 0:
            return dx, dw, db
    else:
        dw = cp.empty(C, dtype=x.dtype) if need_dw and weight is not None else None
        db = cp.empty(C, dtype=x.dtype) if need_db else None
    if N == 0:
        if dw is not None:
            dw.fill(0)
        if db is not None:
            db.fill(0)
        return dx, dw, db
    vec = _vec_ok(C, x.dtype, g, x, weight, grad_sum, dx)
    nv = reg_nv(C, x.dtype.itemsize, _BWD_NV[suffix(x)]) if vec and USE_REG_ROWS else None
    if nv is not None:  # rows and dweight/dbias partial sums in registers
        kind = "s" if BWD_SMEM_ACC else "r"
        name = f"blu_layer_norm_backward_{kind}{nv}_{suffix(x)}"
        smem = (_WPB if BWD_SMEM_ACC else 1) * 2 * C * 4
        nblocks = full_grid(FILE, name, _WPB * 32, -(-N // _WPB), smem)
        part = cp.empty((nblocks, 2 * C), dtype=cp.float32) if want_wb else None
        launch(
            FILE,
            name,
            nblocks,
            _WPB * 32,
            (g, x, ptr(weight), mean, rstd, ptr(grad_sum), ptr(dx), ptr(part), np.int64(N), np.int32(C))
            + (np.int32(need_dx), np.int32(want_wb)),
            shared_mem=smem,
        )
        if want_wb:
            _reduce(part, nblocks, C, dw, db, "acc" if acc else suffix(x))
        return dx, dw, db
    wpb = max(1, min(4, (40 * 1024) // (8 * C))) if want_wb else 4
    smem = wpb * 2 * C * 4 if want_wb else 0
    nblocks = min(math.ceil(N / wpb), num_sms() * 8)
    part = cp.empty((nblocks, 2 * C), dtype=cp.float32) if want_wb else None
    launch(
        FILE,
        f"blu_layer_norm_backward_{suffix(x)}",
        nblocks,
        wpb * 32,
        (
            g,
            x,
            ptr(weight),
            mean,
            rstd,
            ptr(grad_sum),
            ptr(dx),
            ptr(part),
            np.int64(N),
            np.int32(C),
            np.int32(vec),
            np.int32(need_dx),
            np.int32(want_wb),
        ),
        shared_mem=smem,
    )
    if want_wb:
        _reduce(part, nblocks, C, dw, db, "acc" if acc else suffix(x))
    return dx, dw, db


def _reduce(part, nblocks: int, C: int, dw, db, sfx: str) -> None:
    """dw/db = the per-block partials summed in fixed order (blocks of 32 columns x up to 32 slices)."""
    slices = max(1, min(32, nblocks // 4))
    launch(
        FILE,
        f"blu_layer_norm_backward_reduce_{sfx}",
        -(-2 * C // 32),
        32 * slices,
        (part, np.int32(nblocks), np.int32(C), ptr(dw), ptr(db)),
    )


#: the partials' reduction, for the fused residual-norm kernels (backends.cupy.decoder's add_rms_norm)
reduce_partials = _reduce


def _as(d, x):
    """A gradient the accumulating reduction wrote as float32 (a zeroed stand-in buffer) in ``x``'s storage dtype."""
    if d.dtype == x.dtype:
        return d
    from blutensor.backends.cupy.cast import to_bf16

    return to_bf16(d)


class LayerNormCuda(Kernel):
    """layer_norm on CUDA: one fused kernel forward (rows in registers when they fit), deterministic backward;
    dweight / dbias added by the reduction into the float32 ``.grad`` buffers the engine offers (``GRAD_INTO``),
    and the input's pending gradient (a pre-LN residual stream's) added into dx by the kernel (``GRAD_SUM``)."""

    PLUGIN_NAME = "blutensor.cuda.layer_norm"
    OP = "layer_norm"
    BACKEND = "cuda"
    DTYPES = ("float32", "bfloat16")
    PRIORITY = 10
    BF16_NATIVE = True
    SAVES = (0, 1)
    SAME_DTYPE = (0, 1, 2)
    GRAD_INTO = True
    #: backward adds the gradient already pending for its input (the residual stream's) into dx in the same pass
    GRAD_SUM = True

    @staticmethod
    def forward(ctx, x, w=None, b=None, normalized_shape=(), eps=1e-5):
        n = len(normalized_shape)
        ok = (
            x.dtype in _STORAGE
            and n >= 1
            and tuple(x.shape[x.ndim - n :]) == tuple(normalized_shape)
            and all(p is None or (p.dtype == x.dtype and tuple(p.shape) == tuple(normalized_shape)) for p in (w, b))
        )
        if not ok:
            return _fallback.forward(
                ctx, nn_ops.layer_norm_forward, (x, w, b), dict(normalized_shape=normalized_shape, eps=eps)
            )
        cp = cupy()
        C = math.prod(normalized_shape)
        x2 = cp.ascontiguousarray(x).reshape(-1, C)
        w1 = None if w is None else cp.ascontiguousarray(w).reshape(C)
        b1 = None if b is None else cp.ascontiguousarray(b).reshape(C)
        y, mean, rstd, _ = layer_norm_forward(x2, w1, b1, float(eps))
        ctx.saved = (x2, w1, mean, rstd, x.shape, tuple(normalized_shape), b is not None)
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, g):
        if _fallback.used(ctx):
            return _fallback.backward(ctx, nn_ops.layer_norm_backward, g)
        cp = cupy()
        x2, w1, mean, rstd, shape, nshape, has_b = ctx.saved
        needs = tuple(ctx.needs) + (False,) * 3
        into = tuple(getattr(ctx, "grad_into", None) or ()) + (None,) * 3
        C = x2.shape[-1]
        dwi = into[1].reshape(C) if into[1] is not None and needs[1] and w1 is not None else None
        dbi = into[2].reshape(C) if into[2] is not None and needs[2] and has_b else None
        g2 = cp.ascontiguousarray(g).reshape(x2.shape)
        pend = getattr(ctx, "grad_pending", None)
        gs = pend[0] if pend is not None and needs[0] else None
        if gs is not None and not (gs.dtype == x2.dtype and gs.size == x2.size and gs.flags.c_contiguous):
            gs = None
        dx, dw, db = layer_norm_backward(
            g2, x2, w1, mean, rstd, None if gs is None else gs.reshape(x2.shape), needs[0],
            needs[1] and w1 is not None, needs[2] and has_b, dwi, dbi
        )
        return (
            None if dx is None else Summed(dx.reshape(shape)) if gs is not None else dx.reshape(shape),
            ACCUMULATED if dwi is not None else None if dw is None else _as(dw, x2).reshape(nshape),
            ACCUMULATED if dbi is not None else None if db is None else _as(db, x2).reshape(nshape),
        )


# ------------------------------------------------------------------------- residual add + LayerNorm (F.add_layer_norm)
#: kernels/add_rms_norm.cu's register-resident entries of both norms (blu_add_layer_norm_* / blu_add_rms_norm_*
#: *_r<NV>_* and *_s<NV>_*): file, storage mixes <x>_<h>_<y>_<w> with entries
ADD_FILE = "add_rms_norm.cu"
ADD_MIXES = ("f32_f32_f32_f32", "bf16_f32_bf16_f32", "f32_f32_bf16_f32", "bf16_bf16_bf16_bf16")


def _sx(dtype) -> str:
    return "bf16" if np.dtype(dtype) == np.uint16 else "f32"


def add_norm_nv(C: int, x_dtype, h_dtype, y_dtype, w_dtype) -> int | None:
    """The NV of the fused register-resident entry (LayerNorm's or RMSNorm's) for rows of C elements and these
    storages (None: no entry: a row too wide, a width that is not a whole number of 16-byte vectors of h, or a
    storage mix without kernels; add_layer_norm then runs as add + layer_norm, the same values, and add_rms_norm
    takes its warp-per-row kernels)."""
    mix = "_".join(_sx(d) for d in (x_dtype, h_dtype, y_dtype, w_dtype))
    if mix not in ADD_MIXES or not USE_REG_ROWS:
        return None
    V = 16 // np.dtype(h_dtype).itemsize
    if C <= 0 or C % V:
        return None
    return reg_nv(C, np.dtype(h_dtype).itemsize, _BWD_NV[_sx(h_dtype)])


def add_layer_norm_forward(x2, r2, w, b, eps: float, y_dtype):
    """(h, y, mean, rstd) for contiguous rows x2, r2 (N, C): h = x2 + r2 in r2's storage, y = layer_norm(h) * w + b
    in ``y_dtype`` storage (float32 or uint16 bf16 bits); w, b (C,) of one storage, or None. The caller checked
    :func:`add_norm_nv` (and 16-byte alignment: :func:`add_layer_norm_aligned`)."""
    cp = cupy()
    N, C = x2.shape
    h = cp.empty_like(r2)
    y = cp.empty((N, C), dtype=y_dtype)
    mean = cp.empty(N, dtype=cp.float32)
    rstd = cp.empty(N, dtype=cp.float32)
    wd = np.float32 if w is None and b is None else (w if w is not None else b).dtype
    nv = add_norm_nv(C, x2.dtype, r2.dtype, y_dtype, wd)
    if N:
        tag = "_".join(_sx(d) for d in (x2.dtype, r2.dtype, y_dtype, wd))
        name = f"blu_add_layer_norm_forward_r{nv}_{tag}"
        grid = full_grid(ADD_FILE, name, _WPB * 32, -(-N // _WPB))
        launch(ADD_FILE, name, grid, _WPB * 32, (x2, r2, ptr(w), ptr(b), h, y, mean, rstd, np.int64(N), np.int32(C),
                                                 np.float32(eps)))
    return h, y, mean, rstd


def add_norm_aligned(*arrays) -> bool:
    """Every given array starts on a 16-byte boundary (the fused kernels' vector loads)."""
    return aligned16(*arrays)


def add_layer_norm_backward(gy2, gh2, h2, w, mean, rstd, x_dtype, need_dw: bool, need_db: bool, dw_into=None,
                            db_into=None, param_dtype=None):
    """(dres, dx, dw, db): the gradient of the sum in h's storage (dres) and, when x's storage differs, in x's (dx,
    else None: dres serves both); dw / db in w's storage, or added into ``dw_into`` / ``db_into`` (float32 (C,)
    ``.grad`` buffers) when given. ``gy2`` (gradient of y) and ``gh2`` (gradient reaching h) may each be None.

    The grid is the one kernels/layer_norm.cu's backward takes for these rows (same rows per warp, same partials,
    same reduction), so dweight / dbias are bitwise those of layer_norm's backward."""
    cp = cupy()
    N, C = h2.shape
    wd = np.dtype(param_dtype if param_dtype is not None else np.float32 if w is None else w.dtype)
    want = need_dw or need_db
    acc = want and (dw_into is not None or db_into is not None)
    if acc:  # a wanted gradient without a buffer gets a zeroed float32 one, cast to w's storage after
        dw = (dw_into.reshape(C) if dw_into is not None else cp.zeros(C, dtype=cp.float32)) if need_dw else None
        db = (db_into.reshape(C) if db_into is not None else cp.zeros(C, dtype=cp.float32)) if need_db else None
    else:
        dw = cp.zeros(C, dtype=wd) if need_dw else None
        db = cp.zeros(C, dtype=wd) if need_db else None
    dx = None if np.dtype(x_dtype) == h2.dtype else cp.empty((N, C), dtype=x_dtype)
    if gy2 is None or N == 0:  # only h got a gradient: it is the gradient of both addends; dw, db get nothing
        dres = cp.zeros_like(h2) if gh2 is None else gh2.copy()
        if dx is not None:  # x bf16, h float32 (autocast's mix): the float32 gradient rounded
            from blutensor.backends.cupy.cast import to_bf16

            dx = to_bf16(dres)
        return dres, dx, _cast_back(dw, dw_into, wd), _cast_back(db, db_into, wd)
    dres = cp.empty_like(h2)
    nv = add_norm_nv(C, x_dtype, h2.dtype, gy2.dtype, wd)
    tag = "_".join(_sx(d) for d in (x_dtype, h2.dtype, gy2.dtype, wd))
    name = f"blu_add_layer_norm_backward_s{nv}_{tag}"
    smem = _WPB * 2 * C * 4
    # the grid of layer_norm's own backward on these rows (its occupancy, not this kernel's): same partials
    nblocks = full_grid(FILE, f"blu_layer_norm_backward_s{nv}_{_sx(h2.dtype)}", _WPB * 32, -(-N // _WPB), smem)
    part = cp.empty((nblocks, 2 * C), dtype=cp.float32) if want else None
    launch(ADD_FILE, name, nblocks, _WPB * 32,
           (gy2, ptr(gh2), h2, ptr(w), mean, rstd, dres, ptr(dx), ptr(part), np.int64(N), np.int32(C), np.int32(want)),
           shared_mem=smem)
    if want:
        _reduce(part, nblocks, C, dw, db, "acc" if acc else _sx(wd))
    return dres, dx, _cast_back(dw, dw_into, wd), _cast_back(db, db_into, wd)


def _cast_back(d, into, wd):
    """A gradient the accumulating reduction wrote into a float32 stand-in buffer, in w's storage ``wd``."""
    if d is None or into is not None or d.dtype == wd:
        return d
    from blutensor.backends.cupy.cast import to_bf16

    return to_bf16(d)
