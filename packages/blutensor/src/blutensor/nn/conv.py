"""Convolution and pooling modules (Conv1d, Conv2d, MaxPool1d/2d, AvgPool1d/2d) over the
``nn.functional`` conv/pool functions, with PyTorch's arguments and default initialisation."""

from __future__ import annotations

import math
import numbers

from blutensor.creation import empty
from blutensor.errors import ArgumentError, DTypeError
from blutensor.nn import functional as F
from blutensor.nn import init
from blutensor.nn.module import Module
from blutensor.nn.parameter import Parameter


def _tuple(owner: str, name: str, v, n: int, low: int = 0) -> tuple:
    vals = tuple(v) if isinstance(v, tuple | list) else (v,) * n
    if len(vals) != n or any(isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < low for x in vals):
        raise ArgumentError(f"{owner}: {name} must be an int >= {low} or a tuple of {n} such ints, got {v!r}")
    return tuple(int(x) for x in vals)


class _ConvNd(Module):
    _n = 0
    _fn = ""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None, dtype=None):
        super().__init__()
        name, n = type(self).__name__, self._n
        for k, v in (("in_channels", in_channels), ("out_channels", out_channels), ("groups", groups)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
                raise ArgumentError(f"{name}: {k} must be a positive int, got {v!r}")
        if in_channels % groups or out_channels % groups:
            raise ArgumentError(f"{name}: in_channels ({in_channels}) and out_channels ({out_channels}) must be "
                                f"divisible by groups ({groups})")
        if padding_mode not in ("zeros", "reflect", "replicate", "circular"):
            raise ArgumentError(f"{name}: padding_mode must be 'zeros', 'reflect', 'replicate' or 'circular', got "
                                f"{padding_mode!r}")
        self.kernel_size = _tuple(name, "kernel_size", kernel_size, n, 1)
        self.stride = _tuple(name, "stride", stride, n, 1)
        self.dilation = _tuple(name, "dilation", dilation, n, 1)
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise ArgumentError(f"{name}: padding must be 'same', 'valid', an int or a tuple, got {padding!r}")
            if padding == "same" and any(s != 1 for s in self.stride):
                raise ArgumentError(f"{name}: padding='same' is not supported for strided convolutions")
            self.padding = padding
        else:
            self.padding = _tuple(name, "padding", padding, n)
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.padding_mode = padding_mode
        self.weight = Parameter(empty(out_channels, in_channels // groups, *self.kernel_size, device=device,
                                      dtype=dtype))
        self.bias = Parameter(empty(out_channels, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """PyTorch's default: kaiming_uniform_(a=sqrt(5)) weights, U(-1/sqrt(fan_in), 1/sqrt(fan_in)) bias."""
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = init._calculate_fan_in_and_fan_out(self.weight)
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            init.uniform_(self.bias, -bound, bound)

    def forward(self, input):
        fn = getattr(F, self._fn)
        if self.padding_mode == "zeros":
            return fn(input, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
        if isinstance(self.padding, str):
            raise ArgumentError(f"{type(self).__name__}: padding_mode={self.padding_mode!r} needs numeric padding")
        pad = tuple(p for p in reversed(self.padding) for _ in range(2))
        x = F.pad(input, pad, mode=self.padding_mode)
        return fn(x, self.weight, self.bias, self.stride, (0,) * self._n, self.dilation, self.groups)

    def extra_repr(self) -> str:
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
        if self.padding != (0,) * self._n:
            s += f", padding={self.padding}"
        if self.dilation != (1,) * self._n:
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        return s


class Conv1d(_ConvNd):
    """1-D convolution over (N, C_in, L) (or unbatched (C_in, L)) inputs."""

    _n, _fn = 1, "conv1d"


class Conv2d(_ConvNd):
    """2-D convolution over (N, C_in, H, W) (or unbatched (C_in, H, W)) inputs."""

    _n, _fn = 2, "conv2d"


class _MaxPoolNd(Module):
    _n, _fn = 0, ""

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices: bool = False,
                 ceil_mode: bool = False):
        super().__init__()
        name = type(self).__name__
        self.kernel_size = _tuple(name, "kernel_size", kernel_size, self._n, 1)
        self.stride = self.kernel_size if stride is None else _tuple(name, "stride", stride, self._n, 1)
        self.padding = _tuple(name, "padding", padding, self._n)
        self.dilation = _tuple(name, "dilation", dilation, self._n, 1)
        for k, v in (("return_indices", return_indices), ("ceil_mode", ceil_mode)):
            if not isinstance(v, bool):
                raise DTypeError(f"{name}: {k} must be a bool, got {type(v).__name__}")
        self.return_indices, self.ceil_mode = return_indices, ceil_mode

    def forward(self, input):
        return getattr(F, self._fn)(input, self.kernel_size, self.stride, self.padding, self.dilation,
                                    ceil_mode=self.ceil_mode, return_indices=self.return_indices)

    def extra_repr(self) -> str:
        return (f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
                f"dilation={self.dilation}, ceil_mode={self.ceil_mode}")


class MaxPool1d(_MaxPoolNd):
    _n, _fn = 1, "max_pool1d"


class MaxPool2d(_MaxPoolNd):
    _n, _fn = 2, "max_pool2d"


class _AvgPoolNd(Module):
    _n, _fn = 0, ""

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False, count_include_pad: bool = True,
                 divisor_override: int | None = None):
        super().__init__()
        name = type(self).__name__
        self.kernel_size = _tuple(name, "kernel_size", kernel_size, self._n, 1)
        self.stride = self.kernel_size if stride is None else _tuple(name, "stride", stride, self._n, 1)
        self.padding = _tuple(name, "padding", padding, self._n)
        self.ceil_mode, self.count_include_pad, self.divisor_override = ceil_mode, count_include_pad, divisor_override

    def forward(self, input):
        kw = {"divisor_override": self.divisor_override} if self.divisor_override is not None else {}
        return getattr(F, self._fn)(input, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                                    self.count_include_pad, **kw)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AvgPool1d(_AvgPoolNd):
    _n, _fn = 1, "avg_pool1d"

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False, count_include_pad: bool = True):
        super().__init__(kernel_size, stride, padding, ceil_mode, count_include_pad)


class AvgPool2d(_AvgPoolNd):
    _n, _fn = 2, "avg_pool2d"
