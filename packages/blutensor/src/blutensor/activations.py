"""Activation functions under PyTorch's ``torch.nn.functional`` names and signatures.

The elementwise ones are op-table rows (``ops/activation.py``) with their own backward; relu6, selu, celu,
softsign, tanhshrink and glu are compositions of those. ``inplace=True`` is accepted (PyTorch code passes it)
and computes out of place: the result is returned, the input is left as it is only when it needs no grad.
"""

from __future__ import annotations

import numbers

from blutensor.errors import ArgumentError, DTypeError, ShapeError
from blutensor.ops.dispatch import apply

_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def _float(op: str, x) -> None:
    dt = getattr(x, "dtype", None)
    if not getattr(dt, "is_floating_point", False):
        got = x._desc() if hasattr(x, "_desc") else type(x).__name__
        raise DTypeError(f"{op}: needs a floating-point tensor, got {got} (convert with .float())")


def _num(op: str, name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise DTypeError(f"{op}: {name} must be a number, got {type(v).__name__} {v!r}")
    return float(v)


def _done(x, out, inplace):
    if inplace and not x.requires_grad and not out.requires_grad:
        x._data[...] = out._data
        x._version.v += 1
        return x
    return out


def silu(input, inplace: bool = False):  # noqa: A002
    """x * sigmoid(x)."""
    _float("silu", input)
    return _done(input, apply("silu", input), inplace)


def softplus(input, beta: float = 1.0, threshold: float = 20.0):  # noqa: A002
    """log(1 + exp(beta x)) / beta; linear where beta x > threshold."""
    _float("softplus", input)
    return apply("softplus", input, beta=_num("softplus", "beta", beta), threshold=_num("softplus", "threshold",
                                                                                      threshold))


def hardtanh(input, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False):  # noqa: A002
    _float("hardtanh", input)
    lo, hi = _num("hardtanh", "min_val", min_val), _num("hardtanh", "max_val", max_val)
    if lo > hi:
        raise ArgumentError(f"hardtanh: min_val ({lo}) must not exceed max_val ({hi})")
    return _done(input, apply("hardtanh", input, min_val=lo, max_val=hi), inplace)


def relu6(input, inplace: bool = False):  # noqa: A002
    return hardtanh(input, 0.0, 6.0, inplace)


def elu(input, alpha: float = 1.0, inplace: bool = False):  # noqa: A002
    _float("elu", input)
    return _done(input, apply("elu", input, alpha=_num("elu", "alpha", alpha)), inplace)


def celu(input, alpha: float = 1.0, inplace: bool = False):  # noqa: A002
    """max(0, x) + min(0, alpha (exp(x / alpha) - 1))."""
    _float("celu", input)
    a = _num("celu", "alpha", alpha)
    if a == 0:
        raise ArgumentError("celu: alpha must not be 0")
    return _done(input, apply("elu", input, alpha=a, input_scale=1.0 / a), inplace)


def selu(input, inplace: bool = False):  # noqa: A002
    _float("selu", input)
    return _done(input, apply("elu", input, alpha=_SELU_ALPHA, scale=_SELU_SCALE), inplace)


def leaky_relu(input, negative_slope: float = 0.01, inplace: bool = False):  # noqa: A002
    _float("leaky_relu", input)
    return _done(input, apply("leaky_relu", input, negative_slope=_num("leaky_relu", "negative_slope",
                                                                       negative_slope)), inplace)


def hardsigmoid(input, inplace: bool = False):  # noqa: A002
    _float("hardsigmoid", input)
    return _done(input, apply("hardsigmoid", input), inplace)


def hardswish(input, inplace: bool = False):  # noqa: A002
    _float("hardswish", input)
    return _done(input, apply("hardswish", input), inplace)


def mish(input, inplace: bool = False):  # noqa: A002
    """x * tanh(softplus(x))."""
    _float("mish", input)
    return _done(input, apply("mish", input), inplace)


def logsigmoid(input):  # noqa: A002
    _float("logsigmoid", input)
    return apply("logsigmoid", input)


def softsign(input):  # noqa: A002
    """x / (1 + |x|)."""
    _float("softsign", input)
    return input / (apply("abs", input) + 1)


def tanhshrink(input):  # noqa: A002
    """x - tanh(x)."""
    _float("tanhshrink", input)
    return input - apply("tanh", input)


def glu(input, dim: int = -1):  # noqa: A002
    """a * sigmoid(b) for the two halves (a, b) of ``input`` along ``dim``."""
    from blutensor.functional import chunk
    from blutensor.ops._util import norm_dim

    _float("glu", input)
    if input.ndim == 0:
        raise ShapeError("glu: needs at least 1 dim, got a 0-d tensor")
    d = norm_dim(dim, input.ndim, "glu")
    if input.shape[d] % 2:
        raise ShapeError(f"glu: dim {d} of shape {tuple(input.shape)} must have an even size")
    a, b = chunk(input, 2, d)
    return a * apply("sigmoid", b)
