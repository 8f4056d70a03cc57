"""Fused classifier on CUDA (kernels/cross_entropy.cu): softmax + cross-entropy + logits gradient.

The forward reads the logits, computes per-row log-sum-exp and loss and, when a gradient will be needed,
writes the logits gradient (for an incoming grad of 1) into a buffer it owns: the logits array itself
when the call passes ``inplace_grad=True`` (GPT-2 does: its logits are dead after the loss), else a new
array. The backward only rescales that buffer by the incoming grad, on device (no-op when it is 1).
"""

from __future__ import annotations

import numpy as np

from blutensor.backends.cupy import _fallback
from blutensor.backends.cupy._loader import NULL, aligned16, cupy, first_bad_index, launch, num_sms, smem_optin, suffix
from blutensor.backends.cupy.occupancy import full_grid
from blutensor.errors import AutogradError, ShapeError
from blutensor.ops import nn_ops
from blutensor.ops.table import Kernel

FILE = "cross_entropy.cu"
_STORAGE = (np.dtype(np.float32), np.dtype(np.uint16))
#: keep each row in shared memory between the passes when it fits (False: always the two-pass kernel)
USE_SMEM_ROW = True


def cross_entropy_forward(
    logits,
    target,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    want_grad: bool = True,
    inplace_grad: bool = False,
    float_loss: bool = False,
):
    """(loss, grad, lse) for contiguous ``logits`` (N, C) fp32/bf16-bits and int64 ``target`` (N,).

    loss: 0-d array ('mean'/'sum', logits' storage dtype) or (N,) ('none'); grad: d(loss)/d(logits)
    for an upstream grad of 1 (None unless ``want_grad``; it IS ``logits`` when ``inplace_grad``);
    lse: fp32 (N,) log-sum-exp per row. ``float_loss``: the loss is float32 whatever the logits' dtype
    (autocast: bf16 logits, fp32 loss).
    """
    cp = cupy()
    N, C = logits.shape
    sfx = suffix(logits)
    count = cp.empty(1, dtype=cp.float32)
    mean = reduction == "mean"
    launch(FILE, "blu_cross_entropy_count", 1, 1024, (target, np.int64(N), np.int64(ignore_index), count))
    loss_rows = cp.empty(N, dtype=cp.float32)
    lse = cp.empty(N, dtype=cp.float32)
    grad = None
    if want_grad:
        grad = logits if inplace_grad else cp.empty_like(logits)
    if N:
        vec = aligned16(logits, grad) and C % (16 // logits.dtype.itemsize) == 0
        row_bytes = C * logits.dtype.itemsize
        if USE_SMEM_ROW and grad is not None and vec and row_bytes + 1024 <= smem_optin():
            # the row stays in shared memory between the two passes: logits read once, gradient written once;
            # persistent grid (one full wave): each block prefetches its next row (cp.async) while it writes this
            # row's gradient. fp32 rows (200 KB) fit once per SM (1024 threads); bf16 rows (100 KB) twice, as
            # two 512-thread blocks whose reductions overlap the other's memory traffic
            name = f"blu_cross_entropy_forward_smem_{sfx}"
            block = 512 if logits.dtype == np.uint16 else 1024
            launch(
                FILE,
                name,
                full_grid(FILE, name, block, min(N, 2**31 - 1), row_bytes, default=1),
                block,
                (
                    logits,
                    target,
                    np.int64(N),
                    np.int32(C),
                    np.int64(ignore_index),
                    np.float32(label_smoothing),
                    loss_rows,
                    lse,
                    grad,
                    count,
                    np.int32(mean),
                ),
                shared_mem=row_bytes,
            )
        else:
            _launch_two_pass(
                logits, target, N, C, ignore_index, label_smoothing, loss_rows, lse, grad, count, mean, vec, sfx
            )
    if reduction == "none":
        if logits.dtype == np.uint16 and not float_loss:
            from blutensor.backends import f32_to_bf16_bits

            return f32_to_bf16_bits(loss_rows, cp), grad, lse
        return loss_rows, grad, lse
    rsfx = "f32" if float_loss else sfx
    out = cp.empty((), dtype=cp.float32 if float_loss else logits.dtype)
    launch(FILE, f"blu_cross_entropy_reduce_{rsfx}", 1, 1024, (loss_rows, np.int64(N), count, np.int32(mean), out))
    return out, grad, lse


def _launch_two_pass(logits, target, N, C, ignore_index, ls, loss_rows, lse, grad, count, mean, vec, sfx):
    """Rows too wide for shared memory (or unaligned): pass 2 re-reads the logits (mostly from L2)."""
    launch(
        FILE,
        f"blu_cross_entropy_forward_{sfx}",
        min(N, 2**31 - 1),
        1024,
        (
            logits,
            target,
            np.int64(N),
            np.int32(C),
            np.int64(ignore_index),
            np.float32(ls),
            loss_rows,
            lse,
            NULL if grad is None else grad,
            count,
            np.int32(mean),
            np.int32(vec),
        ),
    )


def scale_grad_(grad, g) -> None:
    """grad *= g in place, on device: g a 0-d/1-element array (skipped when it is 1) or one value per row."""
    N, C = grad.shape
    per_row = g.size != 1
    vec = aligned16(grad) and C % (16 // grad.dtype.itemsize) == 0
    grid = min(N, 2**31 - 1) if per_row else max(1, min(-(-grad.size // (256 * 8)), num_sms() * 8))
    launch(
        FILE,
        f"blu_cross_entropy_backward_{suffix(grad)}",
        grid,
        256,
        (grad, np.int64(N), np.int32(C), g, np.int32(per_row), np.int32(vec)),
    )


class CrossEntropyCuda(Kernel):
    """cross_entropy on CUDA: one fused forward that also writes the logits gradient (in place if allowed)."""

    PLUGIN_NAME = "blutensor.cuda.cross_entropy"
    OP = "cross_entropy"
    BACKEND = "cuda"
    DTYPES = ("float32", "bfloat16")
    PRIORITY = 10
    BF16_NATIVE = True
    SAVES = ()  # the backward needs only the gradient buffer it owns

    @staticmethod
    def forward(
        ctx,
        logits,
        target,
        ignore_index=-100,
        reduction="mean",
        label_smoothing=0.0,
        inplace_grad=False,
        float_loss=False,
    ):
        """``float_loss`` (set by autocast): a float32 loss from bf16 logits (read directly, computed in fp32)."""
        cp = cupy()
        ok = (
            logits.dtype in _STORAGE
            and logits.ndim >= 1
            and tuple(target.shape) == tuple(logits.shape[:-1])
            and reduction in ("mean", "sum", "none")
            and target.dtype.kind in "iu"
            and logits.shape[-1] > 0
        )
        if not ok:
            attrs = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
            if float_loss and logits.dtype == np.uint16:  # generic op on widened logits, loss kept float32
                ctx.fallback = (True, False)
                return nn_ops.cross_entropy_forward(ctx, _fallback._widen(logits), target, **attrs)
            return _fallback.forward(
                ctx,
                nn_ops.cross_entropy_forward,
                (logits, target),
                attrs,
                bf16_inputs=(logits.dtype == np.uint16, False),
            )
        C = logits.shape[-1]
        want_grad = bool(ctx.needs) and bool(ctx.needs[0])
        z = logits.reshape(-1, C)
        inplace = bool(inplace_grad) and z.flags.c_contiguous and z.data.ptr == logits.data.ptr
        z = cp.ascontiguousarray(z)
        t = cp.ascontiguousarray(target.reshape(-1), dtype=cp.int64)
        bad = first_bad_index(t, 0, C, allowed=int(ignore_index), what="cross_entropy target")
        if bad is not None:
            raise ShapeError(f"cross_entropy: target index {bad} out of range for {C} classes")
        loss, grad, _ = cross_entropy_forward(
            z, t, int(ignore_index), reduction, float(label_smoothing), want_grad, inplace, bool(float_loss)
        )
        ctx.saved = (grad, logits.shape, reduction)
        ctx.ce_done = False
        return loss.reshape(target.shape) if reduction == "none" else loss

    @staticmethod
    def backward(ctx, g):
        if _fallback.used(ctx):
            return _fallback.backward(ctx, nn_ops.cross_entropy_backward, g)
        grad, shape, reduction = ctx.saved
        if ctx.ce_done:
            raise AutogradError(
                "cross_entropy (fused CUDA kernel) can run its backward only once: its gradient "
                "buffer was already handed out; select the generic kernel with "
                "BLUTRAIN_KERNELS=cross_entropy=blutensor.cross_entropy for repeated backward"
            )
        ctx.ce_done = True
        cp = cupy()
        if g.dtype != grad.dtype and grad.dtype == np.uint16:  # float_loss: fp32 upstream grad, bf16 buffer
            from blutensor.backends.cupy.cast import to_bf16

            g = to_bf16(g)
        g = cp.ascontiguousarray(g, dtype=grad.dtype)
        scale_grad_(grad, g.reshape(-1) if reduction == "none" else g.reshape(1))
        return grad.reshape(shape), None
