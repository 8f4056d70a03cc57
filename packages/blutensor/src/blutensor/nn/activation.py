"""Activation modules under PyTorch's names; each calls the ``nn.functional`` function of the same name
with the module's arguments (so a module and its function always agree).

``inplace=True`` is accepted for PyTorch compatibility and computes the same values out of place (the
input tensor is left unchanged; autograd needs it)."""

from __future__ import annotations

import numbers
import warnings

from blutensor.errors import ArgumentError, DTypeError
from blutensor.nn import functional as F
from blutensor.nn.module import Module


def _real(owner: str, name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or v != v:
        raise ArgumentError(f"{owner}: {name} must be a number, got {type(v).__name__} {v!r:.40}")
    return float(v)


def _flag(owner: str, v) -> bool:
    if not isinstance(v, bool):
        raise DTypeError(f"{owner}: inplace must be a bool, got {type(v).__name__}")
    return v


class _Simple(Module):
    """An activation without parameters: ``forward(x) = F.<fn>(x)``."""

    fn = ""

    def __init__(self, inplace: bool = False):
        super().__init__()
        self.inplace = _flag(type(self).__name__, inplace)

    def forward(self, input):
        return getattr(F, self.fn)(input)

    def extra_repr(self) -> str:
        return "inplace=True" if self.inplace else ""


class SiLU(_Simple):
    fn = "silu"


class Mish(_Simple):
    fn = "mish"


class SELU(_Simple):
    fn = "selu"


class ReLU6(_Simple):
    fn = "relu6"


class Hardswish(_Simple):
    fn = "hardswish"


class Hardsigmoid(_Simple):
    fn = "hardsigmoid"


class _NoInplace(Module):
    fn = ""

    def forward(self, input):
        return getattr(F, self.fn)(input)


class Sigmoid(_NoInplace):
    fn = "sigmoid"


class Tanh(_NoInplace):
    fn = "tanh"


class LogSigmoid(_NoInplace):
    fn = "logsigmoid"


class Softsign(_NoInplace):
    fn = "softsign"


class Tanhshrink(_NoInplace):
    fn = "tanhshrink"


class ELU(Module):
    def __init__(self, alpha: float = 1.0, inplace: bool = False):
        super().__init__()
        self.alpha, self.inplace = _real("ELU", "alpha", alpha), _flag("ELU", inplace)

    def forward(self, input):
        return F.elu(input, self.alpha)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}"


class CELU(Module):
    def __init__(self, alpha: float = 1.0, inplace: bool = False):
        super().__init__()
        self.alpha, self.inplace = _real("CELU", "alpha", alpha), _flag("CELU", inplace)
        if self.alpha == 0:
            raise ArgumentError("CELU: alpha must not be 0")

    def forward(self, input):
        return F.celu(input, self.alpha)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}"


class LeakyReLU(Module):
    def __init__(self, negative_slope: float = 1e-2, inplace: bool = False):
        super().__init__()
        self.negative_slope = _real("LeakyReLU", "negative_slope", negative_slope)
        self.inplace = _flag("LeakyReLU", inplace)

    def forward(self, input):
        return F.leaky_relu(input, self.negative_slope)

    def extra_repr(self) -> str:
        return f"negative_slope={self.negative_slope}"


class Softplus(Module):
    """log(1 + exp(beta x)) / beta, linear above ``threshold`` (in units of beta x)."""

    def __init__(self, beta: float = 1.0, threshold: float = 20.0):
        super().__init__()
        self.beta, self.threshold = _real("Softplus", "beta", beta), _real("Softplus", "threshold", threshold)

    def forward(self, input):
        return F.softplus(input, self.beta, self.threshold)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, threshold={self.threshold}"


class Hardtanh(Module):
    def __init__(self, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False):
        super().__init__()
        self.min_val, self.max_val = _real("Hardtanh", "min_val", min_val), _real("Hardtanh", "max_val", max_val)
        self.inplace = _flag("Hardtanh", inplace)
        if self.max_val <= self.min_val:
            raise ArgumentError(f"Hardtanh: max_val ({self.max_val}) must be larger than min_val ({self.min_val})")

    def forward(self, input):
        return F.hardtanh(input, self.min_val, self.max_val)

    def extra_repr(self) -> str:
        return f"min_val={self.min_val}, max_val={self.max_val}"


class GLU(Module):
    """a * sigmoid(b) for the two halves a, b of ``dim``."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, input):
        return F.glu(input, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


def _legacy_softmax_dim(name: str, ndim: int) -> int:
    warnings.warn(f"Implicit dimension choice for {name} has been deprecated. Change the call to include dim=X "
                  f"as an argument.", stacklevel=3)
    return 0 if ndim in (0, 1, 3) else 1


class Softmax(Module):
    def __init__(self, dim: int | None = None):
        super().__init__()
        self.dim = dim

    def forward(self, input):
        dim = self.dim if self.dim is not None else _legacy_softmax_dim("softmax", input.ndim)
        return F.softmax(input, dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class LogSoftmax(Module):
    def __init__(self, dim: int | None = None):
        super().__init__()
        self.dim = dim

    def forward(self, input):
        dim = self.dim if self.dim is not None else _legacy_softmax_dim("log_softmax", input.ndim)
        return F.log_softmax(input, dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class Softmin(Module):
    def __init__(self, dim: int | None = None):
        super().__init__()
        self.dim = dim

    def forward(self, input):
        dim = self.dim if self.dim is not None else _legacy_softmax_dim("softmin", input.ndim)
        return F.softmax(-input, dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"
