"""Convolution, pooling and padding under ``torch.nn.functional``'s names: conv1d, conv2d, max_pool1d,
max_pool2d, avg_pool1d, avg_pool2d, pad.

The kernels are 2-d (``ops/conv.py``); the 1-d forms run them on a height-1 view. Arguments follow PyTorch:
an int or a tuple per spatial dim, ``padding`` may be ``"valid"`` or ``"same"`` (stride 1) for convolutions.
"""

from __future__ import annotations

import numbers

from blutensor.errors import ArgumentError, DTypeError, ShapeError
from blutensor.ops.dispatch import apply


def _pair(op: str, name: str, v, n: int, minimum: int = 0) -> tuple:
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        v = (int(v),) * n
    elif isinstance(v, list | tuple) and len(v) == n and all(isinstance(x, numbers.Integral) and not
                                                                 isinstance(x, bool) for x in v):
        v = tuple(int(x) for x in v)
    else:
        raise DTypeError(f"{op}: {name} must be an int or a tuple of {n} ints, got {v!r}")
    if any(x < minimum for x in v):
        raise ArgumentError(f"{op}: {name} must be >= {minimum}, got {v}")
    return v


def _input(op: str, x, nd: int):
    from blutensor._tensor import Tensor

    if not isinstance(x, Tensor):
        raise DTypeError(f"{op}: input must be a Tensor, got {type(x).__name__}")
    if x.ndim not in (nd + 1, nd + 2):
        raise ShapeError(f"{op}: input must be {nd + 1}-D (C, ...) or {nd + 2}-D (N, C, ...), got shape "
                         f"{tuple(x.shape)}")
    return x.ndim == nd + 1  # unbatched


def _conv(op, x, weight, bias, stride, padding, dilation, groups, nd):
    unbatched = _input(op, x, nd)
    if weight.ndim != nd + 2:
        raise ShapeError(f"{op}: weight must be {nd + 2}-D (out, in/groups, k...), got shape {tuple(weight.shape)}")
    if isinstance(groups, bool) or not isinstance(groups, numbers.Integral) or groups < 1:
        raise ArgumentError(f"{op}: groups must be a positive int, got {groups!r}")
    stride = _pair(op, "stride", stride, nd, 1)
    dilation = _pair(op, "dilation", dilation, nd, 1)
    ks = tuple(weight.shape[2:])
    if isinstance(padding, str):
        if padding == "valid":
            padding = (0,) * nd
        elif padding == "same":
            if any(s != 1 for s in stride):
                raise ArgumentError(f"{op}: padding='same' needs stride 1, got {stride}")
            tot = [d * (k - 1) for d, k in zip(dilation, ks)]
            if any(t % 2 for t in tot):  # uneven: pad the extra element on the right, as PyTorch does
                pads = []
                for t in reversed(tot):
                    pads += [t // 2, t - t // 2]
                x = pad(x, tuple(pads))
                padding = (0,) * nd
            else:
                padding = tuple(t // 2 for t in tot)
        else:
            raise ArgumentError(f"{op}: padding must be an int, a tuple, 'valid' or 'same', got {padding!r}")
    padding = _pair(op, "padding", padding, nd, 0)
    if unbatched:
        x = x.unsqueeze(0)
    if nd == 1:
        x, weight = x.unsqueeze(2), weight.unsqueeze(2)
        stride, padding, dilation = (1,) + stride, (0,) + padding, (1,) + dilation
    out = apply("conv2d", x, weight, stride=stride, padding=padding, dilation=dilation, groups=int(groups))
    if nd == 1:
        out = out.squeeze(2)
    if bias is not None:
        if tuple(bias.shape) != (weight.shape[0],):
            raise ShapeError(f"{op}: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        out = out + bias.reshape((1, -1) + (1,) * nd)
    return out.squeeze(0) if unbatched else out


def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):  # noqa: A002
    """1-d cross-correlation of (N, C, L) with weight (O, C/groups, k)."""
    return _conv("conv1d", input, weight, bias, stride, padding, dilation, groups, 1)


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):  # noqa: A002
    """2-d cross-correlation of (N, C, H, W) with weight (O, C/groups, kh, kw)."""
    return _conv("conv2d", input, weight, bias, stride, padding, dilation, groups, 2)


def _pool_args(op, x, kernel_size, stride, padding, nd):
    unbatched = _input(op, x, nd)
    k = _pair(op, "kernel_size", kernel_size, nd, 1)
    s = k if stride is None or (isinstance(stride, list | tuple) and not stride) else _pair(op, "stride", stride,
                                                                                             nd, 1)
    p = _pair(op, "padding", padding, nd, 0)
    if unbatched:
        x = x.unsqueeze(0)
    if nd == 1:
        x = x.unsqueeze(2)
        k, s, p = (1,) + k, (1,) + s, (0,) + p
    return x, k, s, p, unbatched


def _unpool(out, nd, unbatched):
    if nd == 1:
        out = out.squeeze(2)
    return out.squeeze(0) if unbatched else out


def _max_pool(op, x, kernel_size, stride, padding, dilation, ceil_mode, return_indices, nd):
    x4, k, s, p, unb = _pool_args(op, x, kernel_size, stride, padding, nd)
    d = _pair(op, "dilation", dilation, nd, 1)
    if nd == 1:
        d = (1,) + d
    attrs = dict(kernel_size=k, stride=s, padding=p, dilation=d, ceil_mode=bool(ceil_mode))
    out = _unpool(apply("max_pool2d", x4, **attrs), nd, unb)
    if return_indices:
        idx = _unpool(apply("max_pool2d_indices", x4, **attrs), nd, unb)
        return out, idx
    return out


def max_pool1d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,  # noqa: A002
               return_indices=False):
    return _max_pool("max_pool1d", input, kernel_size, stride, padding, dilation, ceil_mode, return_indices, 1)


def max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,  # noqa: A002
               return_indices=False):
    """Max over windows; ``return_indices`` also gives each maximum's flat position in its (H, W) plane."""
    return _max_pool("max_pool2d", input, kernel_size, stride, padding, dilation, ceil_mode, return_indices, 2)


def avg_pool1d(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True):  # noqa: A002
    x4, k, s, p, unb = _pool_args("avg_pool1d", input, kernel_size, stride, padding, 1)
    return _unpool(apply("avg_pool2d", x4, kernel_size=k, stride=s, padding=p, ceil_mode=bool(ceil_mode),
                         count_include_pad=bool(count_include_pad)), 1, unb)


def avg_pool2d(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,  # noqa: A002
               divisor_override=None):
    x4, k, s, p, unb = _pool_args("avg_pool2d", input, kernel_size, stride, padding, 2)
    if divisor_override is not None and (isinstance(divisor_override, bool) or
                                         not isinstance(divisor_override, numbers.Integral) or divisor_override <= 0):
        raise ArgumentError(f"avg_pool2d: divisor_override must be a positive int, got {divisor_override!r}")
    return _unpool(apply("avg_pool2d", x4, kernel_size=k, stride=s, padding=p, ceil_mode=bool(ceil_mode),
                         count_include_pad=bool(count_include_pad), divisor_override=divisor_override), 2, unb)


_PAD_MODES = ("constant", "reflect", "replicate", "circular")


def pad(input, pad, mode: str = "constant", value=None):  # noqa: A002
    """Pad the last ``len(pad) // 2`` dims: ``pad = (left_last, right_last, left_prev, right_prev, ...)``;
    negative amounts crop. Modes: constant (``value``, default 0), reflect, replicate, circular."""
    from blutensor._tensor import Tensor

    if not isinstance(input, Tensor):
        raise DTypeError(f"pad: input must be a Tensor, got {type(input).__name__}")
    if not isinstance(pad, list | tuple) or len(pad) % 2 or not all(
            isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in pad):
        raise DTypeError(f"pad: pad must be a tuple of an even number of ints, got {pad!r}")
    if len(pad) // 2 > input.ndim:
        raise ShapeError(f"pad: {len(pad)} pad values for a tensor with {input.ndim} dims (at most "
                         f"{2 * input.ndim})")
    if mode not in _PAD_MODES:
        raise ArgumentError(f"pad: mode must be one of {', '.join(_PAD_MODES)}, got {mode!r}")
    if mode != "constant" and value not in (None, 0, 0.0):
        raise ArgumentError(f"pad: value is only used by mode='constant', got value={value!r} with mode={mode!r}")
    v = 0.0 if value is None else value
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise DTypeError(f"pad: value must be a number, got {type(v).__name__}")
    return apply("pad", input, pad=tuple(int(p) for p in pad), mode=mode, value=v)
