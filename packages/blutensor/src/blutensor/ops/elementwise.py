"""Elementwise ops: arithmetic with broadcasting, unary math, comparisons, where, masked_fill.

Each op is a ``<op>_forward(ctx, *arrays, **attrs)`` / ``<op>_backward(ctx, grad)`` pair.
"""

from __future__ import annotations

import math

import numpy as np
from blutensor.backends import array_provider, array_providers
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


def _int_kind(x) -> bool:
    """Integer or bool array, or a Python int / bool."""
    dt = getattr(x, "dtype", None)
    return dt.kind in "iub" if dt is not None else isinstance(x, int)


def pow_forward(ctx, a, b):
    xp = xp_of(a if hasattr(a, "shape") else b)
    if _int_kind(a) and _int_kind(b) and (bool((b < 0).any()) if hasattr(b, "shape") else b < 0):
        from blutensor.errors import ArgumentError

        raise ArgumentError("pow: integers to negative integer powers are not allowed (convert the base with "
                            ".float())")
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        out = _promote(a ** b, a, b)
    if not hasattr(out, "shape"):
        out = xp.asarray(out)
    ctx.saved = (a, b, out)
    return out


def pow_backward(ctx, g):
    """PyTorch's rule: d/da = b a^(b-1), 0 where b == 0; d/db = a^b log(a), 0 where a == 0 and b >= 0."""
    a, b, out = ctx.saved
    xp = xp_of(g)
    ga = gb = None
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if ctx.needs[0]:
            if isinstance(b, int | float):
                ga = g * (b * a ** (b - 1)) if b != 0 else g * 0
            else:
                ga = xp.where(b == 0, g.dtype.type(0), g * b * a ** (b - 1))
                ga = unbroadcast(ga.astype(g.dtype, copy=False), shape_of(a))
        if ctx.needs[1]:
            la = xp.log(a) if hasattr(a, "shape") else g.dtype.type(math.log(a) if a > 0 else
                                                                      (-math.inf if a == 0 else math.nan))
            gb = xp.where((a == 0) & (b >= 0), g.dtype.type(0), g * out * la)
            gb = unbroadcast(gb.astype(g.dtype, copy=False), shape_of(b))
    return ga, gb


def _tie_split(a, b, g, greater):
    """Gradients of maximum/minimum: all to the winner, half to each operand on a tie (PyTorch's rule)."""
    xp = xp_of(g)
    win = (a > b) if greater else (a < b)
    tie = a == b
    half = g.dtype.type(0.5)
    one, zero = g.dtype.type(1), g.dtype.type(0)
    wa = xp.where(win, one, xp.where(tie, half, zero))
    return wa, one - wa


def maximum_forward(ctx, a, b):
    xp = xp_of(a if hasattr(a, "shape") else b)
    ctx.saved = (a, b)
    return _promote(xp.maximum(a, b), a, b)


def maximum_backward(ctx, g):
    a, b = ctx.saved
    wa, wb = _tie_split(a, b, g, True)
    return (unbroadcast(g * wa, shape_of(a)) if ctx.needs[0] else None,
            unbroadcast(g * wb, shape_of(b)) if ctx.needs[1] else None)


def minimum_forward(ctx, a, b):
    xp = xp_of(a if hasattr(a, "shape") else b)
    ctx.saved = (a, b)
    return _promote(xp.minimum(a, b), a, b)


def minimum_backward(ctx, g):
    a, b = ctx.saved
    wa, wb = _tie_split(a, b, g, False)
    return (unbroadcast(g * wa, shape_of(a)) if ctx.needs[0] else None,
            unbroadcast(g * wb, shape_of(b)) if ctx.needs[1] else None)


def _int_zero_division(op, a, b):
    """Integer division by zero has no value: refuse it by name (NumPy would give 0 with a warning)."""
    if _int_kind(a) and _int_kind(b):
        if (b == 0) if not hasattr(b, "shape") else bool((b == 0).any()):
            from blutensor.errors import ArgumentError

            raise ArgumentError(f"{op}: integer division by zero")


def _zero_grads(ctx, g, a, b):
    xp = xp_of(g)
    return (xp.zeros(shape_of(a), dtype=g.dtype) if ctx.needs[0] else None,
            xp.zeros(shape_of(b), dtype=g.dtype) if ctx.needs[1] else None)


def div_rounded_forward(ctx, a, b, rounding_mode="trunc", op=None):
    """Division rounded toward zero ("trunc") or down ("floor"); integers stay integers (PyTorch's div)."""
    xp = xp_of(a if hasattr(a, "shape") else b)
    _int_zero_division(op or f"div(rounding_mode={rounding_mode!r})", a, b)
    ctx.saved = (a, b)
    with np.errstate(divide="ignore", invalid="ignore"):
        if getattr(xp.result_type(a, b), "kind", "f") in "iub":
            q = xp.floor_divide(a, b)
            if rounding_mode == "trunc":
                q = q + ((q < 0) & (q * b != a))
            return q
        q = a / b
        return _promote(xp.trunc(q) if rounding_mode == "trunc" else xp.floor(q), a, b)


def div_rounded_backward(ctx, g):
    a, b = ctx.saved
    return _zero_grads(ctx, g, a, b)


def floor_divide_forward(ctx, a, b):
    return div_rounded_forward(ctx, a, b, rounding_mode="floor", op="floor_divide")


floor_divide_backward = div_rounded_backward


def _modulo_forward(name: str, rem, ctx, a, b):
    xp = xp_of(a if hasattr(a, "shape") else b)
    _int_zero_division(name, a, b)
    ctx.saved = (a, b)
    with np.errstate(divide="ignore", invalid="ignore"):
        return _promote(getattr(xp, rem)(a, b), a, b)


def _modulo_backward(quot: str, ctx, g):
    """d/da (a - b*q(a/b)) = 1, d/db = -q(a/b), with q = floor (remainder) or trunc (fmod)."""
    a, b = ctx.saved
    xp = xp_of(g)
    ga = unbroadcast(g, shape_of(a)) if ctx.needs[0] else None
    gb = None
    if ctx.needs[1]:
        with np.errstate(divide="ignore", invalid="ignore"):
            gb = unbroadcast((-g * getattr(xp, quot)(a / b)).astype(g.dtype, copy=False), shape_of(b))
    return ga, gb


def remainder_forward(ctx, a, b):
    """Python's modulo: the result has the divisor's sign (PyTorch's remainder / ``%``)."""
    return _modulo_forward("remainder", "remainder", ctx, a, b)


def remainder_backward(ctx, g):
    return _modulo_backward("floor", ctx, g)


def fmod_forward(ctx, a, b):
    """C's fmod: the result has the dividend's sign (PyTorch's fmod)."""
    return _modulo_forward("fmod", "fmod", ctx, a, b)


def fmod_backward(ctx, g):
    return _modulo_backward("trunc", ctx, g)


def isclose_forward(ctx, a, b, rtol=1e-5, atol=1e-8, equal_nan=False):
    xp = xp_of(a if hasattr(a, "shape") else b)
    with np.errstate(invalid="ignore", over="ignore"):
        return xp.isclose(a, b, rtol=rtol, atol=atol, equal_nan=equal_nan)


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
    want = a.dtype
    if want.kind in "iub" and any(isinstance(v, float) or getattr(getattr(v, "dtype", None), "kind", "") == "f"
                                  for v in (min, max)):  # a float bound makes an integer input float (PyTorch)
        from blutensor.dtypes import get_default_dtype

        want = get_default_dtype().np
    return out.astype(want, copy=False)


def clamp_backward(ctx, g):
    a, lo, hi = ctx.saved
    m = True
    if lo is not None:
        m = m & (a >= lo)
    if hi is not None:
        m = m & (a <= hi)
    return (g * m,)


def erf(x, xp):
    """Error function: CuPy's on the GPU, the C library's (math.erf) on the CPU (a registered array provider's
    ``erf`` for its array type)."""
    if array_providers and (prov := array_provider(x)) is not None:
        return prov.erf(x)
    if xp is np:
        return np.frompyfunc(math.erf, 1, 1)(x).astype(x.dtype)
    from cupyx.scipy.special import erf as cerf

    return cerf(x)


def _convert(a, src, dst, xp):
    """Convert storage of blutensor dtype ``src`` to ``dst`` (bfloat16 is raw bits on CUDA)."""
    if xp is np:
        return a.astype(dst.np)
    from blutensor.backends import bf16_bits_to_f32, f32_to_bf16_bits

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


def _weak_scalar(s, dt, xp):
    kind = dt.kind
    if isinstance(s, bool) or (isinstance(s, int) and kind != "b") or kind == "f":
        return xp.asarray(s, dtype=dt)
    if isinstance(s, int):
        return xp.asarray(s, dtype=np.int64)
    from blutensor.dtypes import get_default_dtype

    return xp.asarray(s, dtype=get_default_dtype().np)


def where_forward(ctx, cond, a, b):
    xp = xp_of(cond)
    # a Python scalar branch is a weak operand (PyTorch's promotion): the other branch's dtype unless its category
    # is higher (a float scalar with an integer tensor gives the default float dtype)
    if not hasattr(a, "dtype") and hasattr(b, "dtype"):
        a = _weak_scalar(a, b.dtype, xp)
    elif not hasattr(b, "dtype") and hasattr(a, "dtype"):
        b = _weak_scalar(b, a.dtype, xp)
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
