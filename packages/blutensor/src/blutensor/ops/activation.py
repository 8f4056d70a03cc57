"""Activation functions beyond relu/gelu/sigmoid/tanh: silu, softplus, hardtanh, elu (celu, selu), leaky_relu,
hardswish, hardsigmoid, mish, logsigmoid.

Each is a ``<op>_forward(ctx, x, **attrs)`` / ``<op>_backward(ctx, grad)`` pair over NumPy or CuPy arrays
(the array module ``xp`` of the input), computed in the input's dtype; overflow-free forms where the naive
formula overflows (softplus, logsigmoid, mish).
"""

from __future__ import annotations

from blutensor.ops._util import xp_of


def _sigmoid(x, xp):
    return 0.5 * (xp.tanh(0.5 * x) + 1)


def _softplus(x, xp):
    """log(1 + exp(x)) without overflow: max(x, 0) + log1p(exp(-|x|))."""
    return xp.maximum(x, 0) + xp.log1p(xp.exp(-xp.abs(x)))


def _same(out, x):
    return out.astype(x.dtype, copy=False)


def silu_forward(ctx, x):
    xp = xp_of(x)
    ctx.saved = x
    return _same(x * _sigmoid(x, xp), x)


def silu_backward(ctx, g):
    x = ctx.saved
    s = _sigmoid(x, xp_of(x))
    return (_same(g * s * (1 + x * (1 - s)), g),)


def softplus_forward(ctx, x, beta=1.0, threshold=20.0):
    xp = xp_of(x)
    ctx.saved = (x, beta, threshold)
    bx = x * beta
    return _same(xp.where(bx > threshold, x, _softplus(bx, xp) / beta), x)


def softplus_backward(ctx, g):
    x, beta, threshold = ctx.saved
    xp = xp_of(x)
    bx = x * beta
    return (_same(xp.where(bx > threshold, g, g * _sigmoid(bx, xp)), g),)


def hardtanh_forward(ctx, x, min_val=-1.0, max_val=1.0):
    xp = xp_of(x)
    ctx.saved = (x, min_val, max_val)
    return _same(xp.clip(x, min_val, max_val), x)


def hardtanh_backward(ctx, g):
    x, lo, hi = ctx.saved
    return (_same(g * ((x > lo) & (x < hi)), g),)


def elu_forward(ctx, x, alpha=1.0, scale=1.0, input_scale=1.0):
    """scale * (x if x > 0 else alpha * (exp(x * input_scale) - 1)): elu, celu (input_scale 1/alpha), selu."""
    xp = xp_of(x)
    ctx.saved = (x, alpha, scale, input_scale)
    neg = alpha * xp.expm1(xp.minimum(x, 0) * input_scale)
    return _same(scale * xp.where(x > 0, x, neg), x)


def elu_backward(ctx, g):
    x, alpha, scale, input_scale = ctx.saved
    xp = xp_of(x)
    dneg = alpha * input_scale * xp.exp(xp.minimum(x, 0) * input_scale)
    return (_same(g * scale * xp.where(x > 0, 1, dneg), g),)


def leaky_relu_forward(ctx, x, negative_slope=0.01):
    xp = xp_of(x)
    ctx.saved = (x, negative_slope)
    return _same(xp.where(x > 0, x, x * negative_slope), x)


def leaky_relu_backward(ctx, g):
    x, slope = ctx.saved
    return (_same(xp_of(x).where(x > 0, g, g * slope), g),)


def hardsigmoid_forward(ctx, x):
    xp = xp_of(x)
    ctx.saved = x
    return _same(xp.clip(x / 6 + 0.5, 0, 1), x)


def hardsigmoid_backward(ctx, g):
    x = ctx.saved
    return (_same(g * ((x > -3) & (x < 3)) / 6, g),)


def hardswish_forward(ctx, x):
    xp = xp_of(x)
    ctx.saved = x
    return _same(x * xp.clip(x + 3, 0, 6) / 6, x)


def hardswish_backward(ctx, g):
    x = ctx.saved
    xp = xp_of(x)
    d = xp.where(x < -3, 0, xp.where(x <= 3, x / 3 + 0.5, 1))
    return (_same(g * d, g),)


def mish_forward(ctx, x):
    xp = xp_of(x)
    ctx.saved = x
    return _same(x * xp.tanh(_softplus(x, xp)), x)


def mish_backward(ctx, g):
    x = ctx.saved
    xp = xp_of(x)
    t = xp.tanh(_softplus(x, xp))
    return (_same(g * (t + x * (1 - t * t) * _sigmoid(x, xp)), g),)


def logsigmoid_forward(ctx, x):
    xp = xp_of(x)
    ctx.saved = x
    return _same(-_softplus(-x, xp), x)


def logsigmoid_backward(ctx, g):
    x = ctx.saved
    return (_same(g * _sigmoid(-x, xp_of(x)), g),)

