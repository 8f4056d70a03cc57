"""Fallback from a CUDA kernel class to blutensor's generic op for calls it does not cover
(attrs the kernel lacks, unusual dtypes): widens raw bf16 bits to fp32 around the generic kernel."""

from __future__ import annotations

import numpy as np


def _widen(a):
    from blutensor.backends import bf16_bits_to_f32
    from blutensor.backends.cupy._loader import cupy

    return bf16_bits_to_f32(a, cupy())


def _narrow(a):
    from blutensor.backends import f32_to_bf16_bits
    from blutensor.backends.cupy._loader import cupy

    return f32_to_bf16_bits(a, cupy())


def is_bf16(a) -> bool:
    return a is not None and hasattr(a, "dtype") and a.dtype == np.uint16


def forward(ctx, generic_forward, arrays, attrs, bf16_inputs=None):
    """Run ``generic_forward`` on ``arrays`` (bf16 bit arrays widened); record how to run its backward."""
    mask = tuple(is_bf16(a) for a in arrays) if bf16_inputs is None else bf16_inputs
    wide = [_widen(a) if m else a for a, m in zip(arrays, mask)]
    out = generic_forward(ctx, *wide, **attrs)
    ctx.fallback = mask
    if any(mask) and out is not None and out.dtype == np.float32:
        out = _narrow(out)
    return out


def backward(ctx, generic_backward, g):
    """Backward of a call that ran through :func:`forward` (a gradient the generic formula accumulated into
    ``ctx.grad_into`` comes back as ``ACCUMULATED`` and is passed on as it is)."""
    mask = ctx.fallback
    if any(mask) and g.dtype == np.uint16:
        g = _widen(g)
    grads = generic_backward(ctx, g)
    if not isinstance(grads, tuple):
        grads = (grads,)
    return tuple(
        _narrow(gr) if i < len(mask) and mask[i] and getattr(gr, "dtype", None) == np.float32 else gr
        for i, gr in enumerate(grads)
    )


def used(ctx) -> bool:
    return getattr(ctx, "fallback", None) is not None
