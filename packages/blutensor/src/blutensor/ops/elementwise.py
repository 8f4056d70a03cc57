"""Elementwise ops: arithmetic with broadcasting, unary math, comparisons, where, masked_fill.

Each op is a ``<op>_forward(ctx, *arrays, **attrs)`` / ``<op>_backward(ctx, grad)`` pair.
"""

from __future__ import annotations

import math

import numpy as np
from blutensor.ops._util import shape_of, unbroadcast, xp_of

# ---- binary arithmetic ----

_F64 = np.dtype(np.float64)


def _promote(out, a, b):
    """PyTorch's rule for integer tensors with float scalars (or true division): the result takes
    the default float dtype, not NumPy's float64."""
    if out.dtype is not _F64 or getattr(a, "dtype", None) is _F64 or getattr(b, "dtype", None) is _F64:
        return out
    from blutensor.dtypes import get_default_dtype

    return out.astype(get_default_dtype().np)



def add_forward(ctx, a, b, alpha=1):
    ctx.saved = (shape_of(a), shape_of(b), alpha)
    return _promote(a + b if alpha == 1 else a + alpha * b, a, b)


def add_backward(ctx, g):
    sa, sb, alpha = ctx.saved
    return (unbroadcast(g, sa) if ctx.needs[0] else None,
            unbroadcast(g if alpha == 1 else alpha * g, sb) if ctx.needs[1] else None)


def sub_forward(ctx, a, b):
    ctx.saved = (shape_of(a), shape_of(b))
    return _promote(a - b, a, b)


def sub_backward(ctx, g):
    sa, sb = ctx.saved
    return (unbroadcast(g, sa) if ctx.needs[0] else None, unbroadcast(-g, sb) if ctx.needs[1] else None)


def mul_forward(ctx, a, b):
    ctx.saved = (a, b)
    return _promote(a * b, a, b)


def mul_backward(ctx, g):
    a, b = ctx.saved
    return (unbroadcast(g * b, shape_of(a)) if ctx.needs[0] else None,
            unbroadcast(g * a, shape_of(b)) if ctx.needs[1] else None)


def div_forward(ctx, a, b):
    ctx.saved = (a, b)
    return _promote(a / b, a, b)


def div_backward(ctx, g):
    a, b = ctx.saved
    ga = unbroadcast(g / b, shape_of(a)) if ctx.needs[0] else None
    gb = unbroadcast(-g * a / (b * b), shape_of(b)) if ctx.needs[1] else None
    return ga, gb


def pow_forward(ctx, a, b):
    out = _promote(a ** b, a, b)
    ctx.saved = (a, b, out)
    return out


def pow_backward(ctx, g):
    a, b, out = ctx.saved
    ga = gb = None
    if ctx.needs[0]:
        if isinstance(b, int | float):
            ga = g * (b * a ** (b - 1)) if b != 0 else g * 0
        else:
            ga = unbroadcast(g * b * a ** (b - 1), shape_of(a))
    if ctx.needs[1]:
        xp = xp_of(out)
        gb = unbroadcast(g * out * xp.log(a), shape_of(b))
    return ga, gb


def maximum_forward(ctx, a, b):
    xp = xp_of(a if hasattr(a, "shape") else b)
    ctx.saved = (a, b)
    return xp.maximum(a, b)


def maximum_backward(ctx, g):
    a, b = ctx.saved
    m = a >= b  # ties go to the first operand
    return (unbroadcast(g * m, shape_of(a)) if ctx.needs[0] else None,
            unbroadcast(g * ~m, shape_of(b)) if ctx.needs[1] else None)


def minimum_forward(ctx, a, b):
    xp = xp_of(a if hasattr(a, "shape") else b)
    ctx.saved = (a, b)
    return xp.minimum(a, b)


def minimum_backward(ctx, g):
    a, b = ctx.saved
    m = a <= b
    return (unbroadcast(g * m, shape_of(a)) if ctx.needs[0] else None,
            unbroadcast(g * ~m, shape_of(b)) if ctx.needs[1] else None)


# ---- unary math ----


def neg_forward(ctx, a):
    return -a


def neg_backward(ctx, g):
    return (-g,)


def exp_forward(ctx, a):
    out = xp_of(a).exp(a)
    ctx.saved = out
    return out


def exp_backward(ctx, g):
    return (g * ctx.saved,)


def log_forward(ctx, a):
    ctx.saved = a
    return xp_of(a).log(a)


def log_backward(ctx, g):
    return (g / ctx.saved,)


def tanh_forward(ctx, a):
    out = xp_of(a).tanh(a)
    ctx.saved = out
    return out


def tanh_backward(ctx, g):
    t = ctx.saved
    return (g * (1 - t * t),)


def sqrt_forward(ctx, a):
    out = xp_of(a).sqrt(a)
    ctx.saved = out
    return out


def sqrt_backward(ctx, g):
    return (g / (2 * ctx.saved),)


def rsqrt_forward(ctx, a):
    out = 1 / xp_of(a).sqrt(a)
    ctx.saved = out
    return out


def rsqrt_backward(ctx, g):
    o = ctx.saved
    return (-0.5 * g * o * o * o,)


def sin_forward(ctx, a):
    ctx.saved = a
    return xp_of(a).sin(a)


def sin_backward(ctx, g):
    return (g * xp_of(g).cos(ctx.saved),)


def cos_forward(ctx, a):
    ctx.saved = a
    return xp_of(a).cos(a)


def cos_backward(ctx, g):
    return (-g * xp_of(g).sin(ctx.saved),)


def abs_forward(ctx, a):
    ctx.saved = a
    return xp_of(a).abs(a)


def abs_backward(ctx, g):
    return (g * xp_of(g).sign(ctx.saved),)


def sigmoid_forward(ctx, a):
    xp = xp_of(a)
    out = 0.5 * (xp.tanh(0.5 * a) + 1)  # overflow-free logistic
    ctx.saved = out
    return out.astype(a.dtype, copy=False)


def sigmoid_backward(ctx, g):
    s = ctx.saved
    return (g * s * (1 - s),)


def relu_forward(ctx, a):
    ctx.saved = a > 0
    return xp_of(a).where(ctx.saved, a, a.dtype.type(0))  # +0.0 for negatives (a * mask gives -0.0)


def relu_backward(ctx, g):
    return (g * ctx.saved,)


def clamp_forward(ctx, a, min=None, max=None):  # noqa: A002 - PyTorch's names
    xp = xp_of(a)
    ctx.saved = (a, min, max)
    out = a
    if min is not None:
        out = xp.maximum(out, min)
    if max is not None:
        out = xp.minimum(out, max)
    return out.astype(a.dtype, copy=False)


def clamp_backward(ctx, g):
    a, lo, hi = ctx.saved
    m = True
    if lo is not None:
        m = m & (a >= lo)
    if hi is not None:
        m = m & (a <= hi)
    return (g * m,)


def erf(x, xp):
    """Error function: CuPy's on the GPU, the C library's (math.erf) on the CPU."""
    if xp is np:
        return np.frompyfunc(math.erf, 1, 1)(x).astype(x.dtype)
    from cupyx.scipy.special import erf as cerf

    return cerf(x)


def _convert(a, src, dst, xp):
    """Convert storage of blutensor dtype ``src`` to ``dst`` (bfloat16 is raw bits on CUDA)."""
    if xp is np:
        return a.astype(dst.np)
    from blutensor.backend import bf16_bits_to_f32, f32_to_bf16_bits

    if src.name == "bfloat16":
        a = bf16_bits_to_f32(a, xp)
    if dst.name == "bfloat16":
        return f32_to_bf16_bits(a.astype(xp.float32, copy=False), xp)
    return a.astype(dst.cuda_storage)


def cast_forward(ctx, a, src=None, dst=None):
    ctx.saved = (src, dst)
    ctx.out_dtype = dst
    return _convert(a, src, dst, xp_of(a))


def cast_backward(ctx, g):
    src, dst = ctx.saved
    return (_convert(g, dst, src, xp_of(g)),)


# ---- comparisons and selection (no gradient to conditions) ----


def _cmp(fn):
    def forward(ctx, a, b):
        return fn(a, b)

    return forward


eq_forward = _cmp(lambda a, b: a == b)
ne_forward = _cmp(lambda a, b: a != b)
lt_forward = _cmp(lambda a, b: a < b)
le_forward = _cmp(lambda a, b: a <= b)
gt_forward = _cmp(lambda a, b: a > b)
ge_forward = _cmp(lambda a, b: a >= b)


def logical_not_forward(ctx, a):
    return ~a.astype(bool)


def where_forward(ctx, cond, a, b):
    xp = xp_of(cond)
    # a Python scalar branch takes the other branch's dtype (PyTorch's promotion for scalars)
    if not hasattr(a, "dtype") and hasattr(b, "dtype"):
        a = xp.asarray(a, dtype=b.dtype)
    elif not hasattr(b, "dtype") and hasattr(a, "dtype"):
        b = xp.asarray(b, dtype=a.dtype)
    ctx.saved = (cond, shape_of(a), shape_of(b))
    return _promote(xp.where(cond, a, b), a, b)


def where_backward(ctx, g):
    cond, sa, sb = ctx.saved
    zero = g.dtype.type(0)
    xp = xp_of(g)
    ga = unbroadcast(xp.where(cond, g, zero), sa) if ctx.needs[1] else None
    gb = unbroadcast(xp.where(cond, zero, g), sb) if ctx.needs[2] else None
    return None, ga, gb


def masked_fill_forward(ctx, a, mask, value=0.0):
    xp = xp_of(a)
    ctx.saved = (mask, a.shape)
    return xp.where(mask, xp.asarray(value, dtype=a.dtype), a)


def masked_fill_backward(ctx, g):
    mask, sa = ctx.saved
    xp = xp_of(g)
    return unbroadcast(xp.where(mask, g.dtype.type(0), g), sa), None
