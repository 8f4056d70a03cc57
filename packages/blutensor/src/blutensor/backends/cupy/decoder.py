"""CUDA kernels of Llama-style blocks: RMSNorm (kernels/rms_norm.cu), RoPE (kernels/rope.cu) and SwiGLU
(kernels/swiglu.cu), fp32 and bf16 storage, fp32 math. Calls the kernels do not cover (several normalized dims,
other dtypes, mismatched tables) run blutensor's NumPy-style reference on CuPy (``blutensor.ops.decoder_ops``)."""

from __future__ import annotations

import numpy as np

from blutensor.backends.cupy import _fallback
from blutensor.backends.cupy._loader import aligned16, cupy, launch, num_sms, ptr, suffix
from blutensor.ops import decoder_ops as ref
from blutensor.ops.table import Kernel

_STORAGE = (np.dtype(np.float32), np.dtype(np.uint16))
_BLOCK = 256
#: row slices of the deterministic dweight pass (each a fixed-order sum, then added in order)
DW_SLICES = 64


def _row_grid(N: int) -> int:
    """Blocks of 8 warps (one row per warp) for N rows, at most 32 per SM (grid-stride beyond)."""
    return max(1, min(-(-N // (_BLOCK // 32)), 32 * num_sms()))


def _flat_grid(n: int) -> int:
    return max(1, min(-(-n // _BLOCK), 16 * num_sms()))


def rms_norm_forward(x2, w, eps: float):
    """(y, rstd) for contiguous rows x2 (N, C) and weight w (C,) or None."""
    cp = cupy()
    N, C = x2.shape
    y = cp.empty_like(x2)
    rstd = cp.empty((N,), dtype=cp.float32)
    if N:
        launch("rms_norm.cu", f"blu_rms_norm_forward_{suffix(x2)}", _row_grid(N), _BLOCK,
               (x2, ptr(w), y, rstd, np.int64(N), np.int32(C), np.float32(eps)))
    return y, rstd


def rms_norm_backward(g2, x2, w, rstd, need_dx: bool, need_dw: bool, dw_into=None):
    """(dx, dw): dx per row, dw as fixed-order sums over DW_SLICES row slices (no atomics: deterministic).
    ``dw_into`` (float32 (C,), C-contiguous): the reduction adds the sum into it (a leaf's ``.grad`` buffer) and
    returns it as dw."""
    cp = cupy()
    N, C = x2.shape
    sfx = suffix(x2)
    dx = dw = None
    if need_dx:
        dx = cp.empty_like(x2)
        if N:
            launch("rms_norm.cu", f"blu_rms_norm_backward_{sfx}", _row_grid(N), _BLOCK,
                   (g2, x2, ptr(w), rstd, dx, np.int64(N), np.int32(C)))
    if need_dw:
        S = max(1, min(DW_SLICES, N))
        part = cp.empty((S, C), dtype=cp.float32)
        dw = cp.empty((C,), dtype=x2.dtype) if dw_into is None else dw_into
        cols = -(-C // _BLOCK)
        if N:
            launch("rms_norm.cu", f"blu_rms_norm_backward_dw_{sfx}", (cols, S), _BLOCK,
                   (g2, x2, rstd, part, np.int64(N), np.int32(C)))
            launch("rms_norm.cu", f"blu_rms_norm_backward_reduce_{sfx if dw_into is None else 'acc'}", cols,
                   _BLOCK, (part, dw, np.int32(S), np.int32(C)))
        elif dw_into is None:
            dw.fill(0)
    return dx, dw


class RmsNormCuda(Kernel):
    """rms_norm over the last dim on CUDA: one warp per row forward and backward, deterministic dweight, added by
    the reduction into the float32 ``.grad`` buffer the engine offers (``GRAD_INTO``)."""

    PLUGIN_NAME = "blutensor.cuda.rms_norm"
    OP = "rms_norm"
    BACKEND = "cuda"
    DTYPES = ("float32", "bfloat16")
    PRIORITY = 10
    BF16_NATIVE = True
    SAVES = (0, 1)
    SAME_DTYPE = (0, 1)
    GRAD_INTO = True

    @staticmethod
    def forward(ctx, x, w=None, normalized_shape=(), eps=1e-6):
        n = len(normalized_shape)
        ok = (x.dtype in _STORAGE and n == 1 and x.ndim >= 1 and x.shape[-1] == normalized_shape[0]
              and (w is None or (w.dtype == x.dtype and tuple(w.shape) == tuple(normalized_shape))))
        if not ok:
            return _fallback.forward(ctx, ref.rms_norm_forward, (x, w),
                                     dict(normalized_shape=normalized_shape, eps=eps))
        cp = cupy()
        C = normalized_shape[0]
        x2 = cp.ascontiguousarray(x).reshape(-1, C)
        w1 = None if w is None else cp.ascontiguousarray(w)
        y, rstd = rms_norm_forward(x2, w1, float(eps))
        ctx.saved = (x2, w1, rstd, x.shape)
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, g):
        if _fallback.used(ctx):
            return _fallback.backward(ctx, ref.rms_norm_backward, g)
        x2, w1, rstd, shape = ctx.saved
        needs = tuple(ctx.needs) + (False, False)
        g2 = cupy().ascontiguousarray(g).reshape(x2.shape)
        need_dw = bool(needs[1]) and w1 is not None
        into = tuple(getattr(ctx, "grad_into", None) or ()) + (None, None)
        dwi = into[1].reshape(-1) if need_dw and into[1] is not None else None
        dx, dw = rms_norm_backward(g2, x2, w1, rstd, bool(needs[0]), need_dw, dwi)
        if dwi is not None:
            from blutensor.autograd.node import ACCUMULATED

            dw = ACCUMULATED
        return (None if dx is None else dx.reshape(shape)), dw


def _sfx(dtype) -> str:
    return "bf16" if np.dtype(dtype) == np.uint16 else "f32"


def add_rms_norm_forward(x2, r2, w, eps: float, y_dtype):
    """(h, y, rstd) for contiguous rows x2, r2 (N, C): h = x2 + r2 (r2's storage), y = rms_norm(h) * w in
    ``y_dtype`` storage (float32 or uint16 bf16 bits); w (C,) or None (then f32 is assumed for the entry name)."""
    cp = cupy()
    N, C = x2.shape
    h = cp.empty_like(r2)
    y = cp.empty((N, C), dtype=y_dtype)
    rstd = cp.empty((N,), dtype=cp.float32)
    if N:
        tag = "_".join(_sfx(a) for a in (x2.dtype, r2.dtype, y_dtype, np.float32 if w is None else w.dtype))
        nv = _reg_nv(x2, r2, y_dtype, w)
        if nv is not None:  # the row in registers (the template LayerNorm shares, without the mean and bias)
            from blutensor.backends.cupy import layer_norm as ln

            name = f"blu_add_rms_norm_forward_r{nv}_{tag}"
            grid = ln.full_grid(ln.ADD_FILE, name, _BLOCK, -(-N // (_BLOCK // 32)))
            launch(ln.ADD_FILE, name, grid, _BLOCK, (x2, r2, ptr(w), ptr(None), h, y, ptr(None), rstd, np.int64(N),
                                                     np.int32(C), np.float32(eps)))
            return h, y, rstd
        launch("add_rms_norm.cu", f"blu_add_rms_norm_forward_{tag}", _row_grid(N), _BLOCK,
               (x2, r2, ptr(w), h, y, rstd, np.int64(N), np.int32(C), np.float32(eps)))
    return h, y, rstd


def _reg_nv(x2, r2, y_dtype, w) -> int | None:
    """NV of the register-resident add_rms_norm entries for these rows (kernels/add_rms_norm.cu's template shared
    with add_layer_norm), or None: the warp-per-row kernels."""
    from blutensor.backends.cupy import layer_norm as ln

    nv = ln.add_norm_nv(x2.shape[1], x2.dtype, r2.dtype, y_dtype, np.float32 if w is None else w.dtype)
    return nv if nv is not None and ln.add_norm_aligned(x2, r2, w) else None


def add_rms_norm_backward(gy2, gh2, h2, w, rstd, x_dtype, need_dw: bool, dw_into=None):
    """(dres, dx, dw): the gradient of the sum in h's storage (dres) and, when x's storage differs, in x's (dx,
    else None: dres serves both); dw (w's storage) as fixed-order sums over DW_SLICES row slices, when asked.
    ``gy2`` (gradient of y) and ``gh2`` (gradient reaching h) may each be None. ``dw_into`` (float32 (C,),
    C-contiguous, whatever w's storage): the reduction adds the sum into it (a leaf's ``.grad`` buffer) and returns
    it as dw."""
    cp = cupy()
    N, C = h2.shape
    y_dtype = np.float32 if gy2 is None else gy2.dtype
    w_dtype = np.float32 if w is None else w.dtype
    tag = "_".join(_sfx(a) for a in (x_dtype, h2.dtype, y_dtype, w_dtype))
    dres = cp.empty_like(h2)
    dx = None if np.dtype(x_dtype) == h2.dtype else cp.empty((N, C), dtype=x_dtype)
    nv = None
    if gy2 is not None and N:
        from blutensor.backends.cupy import layer_norm as ln

        nv = ln.add_norm_nv(C, x_dtype, h2.dtype, gy2.dtype, w_dtype)
        nv = nv if nv is not None and ln.add_norm_aligned(gy2, gh2, h2, w, dx) else None
    if nv is not None:  # rows in registers; dweight from per-block partials, reduced as layer_norm's
        from blutensor.backends.cupy import layer_norm as ln

        name = f"blu_add_rms_norm_backward_s{nv}_{tag}"
        smem = (_BLOCK // 32) * 2 * C * 4
        nblocks = ln.full_grid(ln.ADD_FILE, name, _BLOCK, -(-N // (_BLOCK // 32)), smem)
        want = need_dw and w is not None
        part = cp.empty((nblocks, 2 * C), dtype=cp.float32) if want else None
        launch(ln.ADD_FILE, name, nblocks, _BLOCK, (gy2, ptr(gh2), h2, ptr(w), ptr(None), rstd, dres, ptr(dx),
                                                     ptr(part), np.int64(N), np.int32(C), np.int32(want)),
               shared_mem=smem)
        dw = None
        if want:
            dw = cp.empty((C,), dtype=w.dtype) if dw_into is None else dw_into
            ln.reduce_partials(part, nblocks, C, dw, None, _sfx(w.dtype) if dw_into is None else "acc")
        return dres, dx, dw
    if N:
        launch("add_rms_norm.cu", f"blu_add_rms_norm_backward_{tag}", _row_grid(N), _BLOCK,
               (ptr(gy2), ptr(gh2), h2, ptr(w), rstd, dres, ptr(dx), np.int64(N), np.int32(C)))
    dw = None
    if need_dw and w is not None:
        dw = cp.empty((C,), dtype=w.dtype) if dw_into is None else dw_into
        if gy2 is None or not N:
            if dw_into is None:
                dw.fill(0)
        else:
            S = max(1, min(DW_SLICES, N))
            part = cp.empty((S, C), dtype=cp.float32)
            cols = -(-C // _BLOCK)
            launch("add_rms_norm.cu", f"blu_add_rms_norm_backward_dw_{_sfx(gy2.dtype)}_{_sfx(h2.dtype)}", (cols, S),
                   _BLOCK, (gy2, h2, rstd, part, np.int64(N), np.int32(C)))
            red = _sfx(w.dtype) if dw_into is None else "acc"
            launch("add_rms_norm.cu", f"blu_add_rms_norm_backward_reduce_{red}", cols, _BLOCK,
                   (part, dw, np.int32(S), np.int32(C)))
    return dres, dx, dw


def rope_apply(x, cos, sin, backward: bool = False, transpose: bool = False):
    """The rotation of contiguous x (..., T, H, D) by fp32 tables (T, D/2); ``backward``: the inverse.

    ``transpose``: forward writes (..., H, T, D); backward reads x as (..., H, T, D) and writes (..., T, H, D)."""
    cp = cupy()
    if transpose and backward:
        H, T, D = x.shape[-3], x.shape[-2], x.shape[-1]
        y = cp.empty(x.shape[:-3] + (T, H, D), dtype=x.dtype)
    elif transpose:
        T, H, D = x.shape[-3], x.shape[-2], x.shape[-1]
        y = cp.empty(x.shape[:-3] + (H, T, D), dtype=x.dtype)
    else:
        T, H, D = x.shape[-3], x.shape[-2], x.shape[-1]
        y = cp.empty_like(x)
    pairs = x.size // 2
    if pairs:
        name = f"blu_rope_{'backward' if backward else 'forward'}_{'t_' if transpose else ''}{suffix(x)}"
        launch("rope.cu", name, _flat_grid(pairs), _BLOCK,
               (x, cos, sin, y, np.int64(pairs), np.int32(T), np.int32(H), np.int32(D // 2)))
    return y


class RopeCuda(Kernel):
    """rope on CUDA: one thread per rotated pair, fp32 tables whatever the dtype of x; ``transpose=True`` writes
    the (..., H, T, D) layout attention reads in the same pass (and reads it back in the backward)."""

    PLUGIN_NAME = "blutensor.cuda.rope"
    OP = "rope"
    BACKEND = "cuda"
    DTYPES = ("float32", "bfloat16")
    PRIORITY = 10
    BF16_NATIVE = True

    @staticmethod
    def forward(ctx, x, cos, sin, transpose=False):
        ok = (x.dtype in _STORAGE and x.ndim >= 3 and x.shape[-1] % 2 == 0 and cos.dtype == np.float32
              and sin.dtype == np.float32 and tuple(cos.shape) == (x.shape[-3], x.shape[-1] // 2)
              and tuple(sin.shape) == tuple(cos.shape))
        if not ok:
            return _fallback.forward(ctx, ref.rope_forward, (x, cos, sin), {"transpose": transpose}, bf16_inputs=(
                _fallback.is_bf16(x), _fallback.is_bf16(cos), _fallback.is_bf16(sin)))
        cp = cupy()
        c, s = cp.ascontiguousarray(cos), cp.ascontiguousarray(sin)
        ctx.saved = (c, s, bool(transpose))
        return rope_apply(cp.ascontiguousarray(x), c, s, transpose=bool(transpose))

    @staticmethod
    def backward(ctx, g):
        if _fallback.used(ctx):
            return _fallback.backward(ctx, ref.rope_backward, g)
        c, s, transpose = ctx.saved
        return rope_apply(cupy().ascontiguousarray(g), c, s, backward=True, transpose=transpose), None, None


class SwigluCuda(Kernel):
    """swiglu on CUDA: one elementwise kernel each way, the backward recomputing sigmoid(gate)."""

    PLUGIN_NAME = "blutensor.cuda.swiglu"
    OP = "swiglu"
    BACKEND = "cuda"
    DTYPES = ("float32", "bfloat16")
    PRIORITY = 10
    BF16_NATIVE = True
    SAVES = (0, 1)
    SAME_DTYPE = (0, 1)

    @staticmethod
    def forward(ctx, gate, up):
        if gate.dtype not in _STORAGE or gate.dtype != up.dtype or gate.shape != up.shape:
            return _fallback.forward(ctx, ref.swiglu_forward, (gate, up), {})
        cp = cupy()
        gc, uc = cp.ascontiguousarray(gate), cp.ascontiguousarray(up)
        y = cp.empty_like(gc)
        n = gc.size
        if n:
            launch("swiglu.cu", f"blu_swiglu_forward_{suffix(gc)}", _flat_grid(n), _BLOCK,
                   (gc, uc, y, np.int64(n), np.int32(aligned16(gc, uc, y))))
        ctx.saved = (gc, uc)
        return y

    @staticmethod
    def backward(ctx, g):
        if _fallback.used(ctx):
            return _fallback.backward(ctx, ref.swiglu_backward, g)
        cp = cupy()
        gc, uc = ctx.saved
        needs = tuple(ctx.needs) + (False, False)
        dg = cp.empty_like(gc) if needs[0] else None
        du = cp.empty_like(uc) if needs[1] else None
        n = gc.size
        if n and (dg is not None or du is not None):
            gg = cp.ascontiguousarray(g)
            launch("swiglu.cu", f"blu_swiglu_backward_{suffix(gc)}", _flat_grid(n), _BLOCK,
                   (gg, gc, uc, ptr(dg), ptr(du), np.int64(n), np.int32(aligned16(gg, gc, uc, dg, du))))
        return dg, du


__all__ = ["RmsNormCuda", "RopeCuda", "SwigluCuda"]
