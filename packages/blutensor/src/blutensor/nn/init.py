"""Parameter initialisers (in place, no graph) with PyTorch's names, fan computations and gains:
uniform_, normal_, trunc_normal_, constant_, ones_, zeros_, eye_, xavier_uniform_/normal_,
kaiming_uniform_/normal_, orthogonal_, calculate_gain. Random draws come from the Philox default
generator (or ``generator=``), so a seed gives the same weights on CPU and CUDA."""

from __future__ import annotations

import math
import numbers

import numpy as np

from blutensor.autograd.grad_mode import no_grad
from blutensor.errors import ArgumentError, DTypeError, ShapeError


def _check(op: str, t) -> None:
    from blutensor._tensor import Tensor

    if not isinstance(t, Tensor):
        raise DTypeError(f"nn.init.{op}: expected a Tensor, got {type(t).__name__}")


def _calculate_fan_in_and_fan_out(t) -> tuple[int, int]:
    """(fan_in, fan_out) of a weight: dims 1 and 0 times the receptive field (the product of dims 2..)."""
    if t.ndim < 2:
        raise ShapeError(f"Fan in and fan out can not be computed for tensor with fewer than 2 dimensions, got "
                         f"shape {tuple(t.shape)}")
    rf = math.prod(t.shape[2:]) if t.ndim > 2 else 1
    return t.shape[1] * rf, t.shape[0] * rf


_fans = _calculate_fan_in_and_fan_out


def _fan(t, mode: str) -> int:
    if mode not in ("fan_in", "fan_out"):
        raise ArgumentError(f"nn.init: mode {mode!r} not supported, please use one of 'fan_in', 'fan_out'")
    fan_in, fan_out = _calculate_fan_in_and_fan_out(t)
    return fan_in if mode == "fan_in" else fan_out


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
    """The recommended gain for a nonlinearity (PyTorch's table)."""
    linear = ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d")
    if nonlinearity in linear or nonlinearity == "sigmoid":
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        if param is None:
            slope = 0.01
        elif isinstance(param, bool) or not isinstance(param, numbers.Real):
            raise ArgumentError(f"calculate_gain: negative_slope {param!r} is not a valid number")
        else:
            slope = float(param)
        return math.sqrt(2.0 / (1 + slope ** 2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise ArgumentError(f"calculate_gain: unsupported nonlinearity {nonlinearity!r}")


def normal_(t, mean: float = 0.0, std: float = 1.0, generator=None):
    _check("normal_", t)
    with no_grad():
        return t.normal_(mean, std, generator=generator)


def uniform_(t, a: float = 0.0, b: float = 1.0, generator=None):
    _check("uniform_", t)
    with no_grad():
        return t.uniform_(a, b, generator=generator)


def zeros_(t):
    _check("zeros_", t)
    with no_grad():
        return t.fill_(0)


def ones_(t):
    _check("ones_", t)
    with no_grad():
        return t.fill_(1)


def constant_(t, val: float):
    _check("constant_", t)
    with no_grad():
        return t.fill_(val)


def _write(t, arr: np.ndarray):
    from blutensor.creation import tensor

    with no_grad():
        return t.copy_(tensor(arr.astype(np.float32 if t.dtype.name == "bfloat16" else t.dtype.np),
                              dtype=t.dtype, device=t.device))


def eye_(t):
    """The identity matrix (2-D tensors only)."""
    _check("eye_", t)
    if t.ndim != 2:
        raise ShapeError(f"nn.init.eye_: only tensors with 2 dimensions are supported, got shape {tuple(t.shape)}")
    return _write(t, np.eye(*t.shape))


def trunc_normal_(t, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0, generator=None):
    """Normal(mean, std) restricted to [a, b] (absolute bounds, as in PyTorch), by redrawing the samples
    that fall outside."""
    _check("trunc_normal_", t)
    if not a < b:
        raise ArgumentError(f"nn.init.trunc_normal_: need a < b, got a={a}, b={b}")
    if not std > 0:
        raise ArgumentError(f"nn.init.trunc_normal_: std must be > 0, got {std}")
    cdf = lambda x: 0.5 * (1 + math.erf((x - mean) / (std * math.sqrt(2))))  # noqa: E731
    if cdf(b) - cdf(a) < 1e-4:
        raise ArgumentError(f"nn.init.trunc_normal_: [a, b] = [{a}, {b}] holds less than 1e-4 of Normal({mean}, "
                            f"{std}); the bounds are too far in the tail to sample")
    from blutensor.creation import _generator

    gen = _generator(generator)
    n = t.numel()
    out = np.empty(n, np.float64)
    pending = np.arange(n)
    while pending.size:
        z = gen.normal((pending.size,), np, np.float64) * std + mean
        ok = (z >= a) & (z <= b)
        out[pending[ok]] = z[ok]
        pending = pending[~ok]
    return _write(t, out.reshape(t.shape))


def xavier_uniform_(t, gain: float = 1.0, generator=None):
    """U(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out)) (Glorot & Bengio)."""
    _check("xavier_uniform_", t)
    fan_in, fan_out = _calculate_fan_in_and_fan_out(t)
    a = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(t, -a, a, generator)


def xavier_normal_(t, gain: float = 1.0, generator=None):
    """N(0, std^2) with std = gain * sqrt(2 / (fan_in + fan_out))."""
    _check("xavier_normal_", t)
    fan_in, fan_out = _calculate_fan_in_and_fan_out(t)
    return normal_(t, 0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)), generator)


def kaiming_uniform_(t, a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu", generator=None):
    """U(-bound, bound) with bound = gain * sqrt(3 / fan) (He et al.); ``a`` is leaky_relu's slope."""
    _check("kaiming_uniform_", t)
    if 0 in t.shape:
        return t
    bound = calculate_gain(nonlinearity, a) * math.sqrt(3.0 / _fan(t, mode))
    return uniform_(t, -bound, bound, generator)


def kaiming_normal_(t, a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu", generator=None):
    """N(0, std^2) with std = gain / sqrt(fan)."""
    _check("kaiming_normal_", t)
    if 0 in t.shape:
        return t
    return normal_(t, 0.0, calculate_gain(nonlinearity, a) / math.sqrt(_fan(t, mode)), generator)


def orthogonal_(t, gain: float = 1.0, generator=None):
    """A (semi-)orthogonal matrix from the QR decomposition of a normal draw (Saxe et al.), dims 1.. flattened."""
    _check("orthogonal_", t)
    if t.ndim < 2:
        raise ShapeError(f"nn.init.orthogonal_: only tensors with 2 or more dimensions are supported, got shape "
                         f"{tuple(t.shape)}")
    if t.numel() == 0:
        return t
    from blutensor.creation import _generator

    rows = t.shape[0]
    cols = t.numel() // rows
    w = _generator(generator).normal((rows, cols), np, np.float64)
    if rows < cols:
        w = w.T
    q, r = np.linalg.qr(w)
    q = q * np.sign(np.diag(r))
    if rows < cols:
        q = q.T
    return _write(t, (gain * q).reshape(t.shape))
