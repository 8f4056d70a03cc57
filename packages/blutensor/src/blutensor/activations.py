"""Activation functions under PyTorch's ``torch.nn.functional`` names and signatures.

The elementwise ones (silu, softplus, elu, leaky_relu, hardsigmoid, hardswish, mish, logsigmoid) are op-table rows
(``ops/activation.py``) whose functions are generated into ``blutensor.functional``; written out here are hardtanh
(``min_val <= max_val`` check) and the compositions relu6, selu, celu, softsign, tanhshrink and glu.
``inplace=True`` (PyTorch code passes it) writes the result into the input when neither needs a gradient and
returns the input; otherwise the result is computed out of place and returned.
"""

from __future__ import annotations

import numbers

from blutensor.errors import ArgumentError, DTypeError, ShapeError
from blutensor.ops.dispatch import apply
from blutensor.ops.surface import inplace_result

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


_done = inplace_result


def hardtanh(input, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False):  # noqa: A002
    _float("hardtanh", input)
    lo, hi = _num("hardtanh", "min_val", min_val), _num("hardtanh", "max_val", max_val)
    if lo > hi:
        raise ArgumentError(f"hardtanh: min_val ({lo}) must not exceed max_val ({hi})")
    return _done(input, apply("hardtanh", input, min_val=lo, max_val=hi), inplace)


def relu6(input, inplace: bool = False):  # noqa: A002
    return hardtanh(input, 0.0, 6.0, inplace)


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
