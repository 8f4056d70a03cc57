"""Gradient clipping by global norm (PyTorch's clip_grad_norm_ semantics), without a host sync.

The scale min(1, max_norm / (norm + 1e-6)) is computed and applied on the gradients' device (as PyTorch
does), so a CUDA training step never waits for the GPU here and the call can be captured in a CUDA graph.
fp32/bf16 CUDA gradients with the L2 norm go through the fused multi-tensor kernels (backends/cupy/norm.py).
"""

from __future__ import annotations

import math
import numbers

from blutensor.autograd.grad_mode import no_grad
from blutensor.errors import ArgumentError, DTypeError


def _f32(t):
    """A gradient's values as a float32/float64 array (bfloat16 widened; raw bits on CUDA)."""
    from blutensor.dtypes import float32
    from blutensor.ops._util import xp_of
    from blutensor.ops.elementwise import _convert

    d = t._data
    if t.dtype.name == "float64":
        return d
    return _convert(d, t.dtype, float32, xp_of(d)) if t.dtype.name != "float32" else d


def _fused_cuda(params, max_norm: float):
    """The norm (0-d fp32 device array) after clipping through kernels/grad_norm.cu, or None when the
    gradients are not all contiguous fp32/bf16 CUDA arrays of one device."""
    grads = [p.grad for p in params]
    dev = grads[0].device
    if dev.type != "cuda" or any(g.device != dev or g.dtype.name not in ("float32", "bfloat16") for g in grads):
        return None
    from blutensor.backends.cupy import cupy_installed

    if not cupy_installed() or any(not g._data.flags.c_contiguous for g in grads):
        return None
    from blutensor.backends.cupy.norm import clip_grads_

    return clip_grads_([g._data for g in grads], float(max_norm))


def _fused_cpu(params, max_norm: float):
    """The norm (0-d fp32 array) after clipping through the compiled CPU kernels (backends/numpy/optim.py), or None
    when the gradients are not all contiguous fp32 host arrays (or the kernels are unavailable)."""
    if any(p.grad.device.type != "cpu" or p.grad.dtype.name != "float32" for p in params):
        return None
    from blutensor.backends.numpy.optim import clip_grads_

    r = clip_grads_([p.grad._data for p in params], max_norm)
    if r is None:
        return None
    total, scaled = r
    if scaled:
        for p in params:
            p.grad._version.v += 1
    return total


@no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None):
    """Scale all gradients by min(1, max_norm / (total_norm + 1e-6)); returns the total norm before
    clipping (a 0-d tensor on the gradients' device, never read on the host unless
    ``error_if_nonfinite``). The total is the norm of the per-parameter norms, as in PyTorch. ``foreach``
    (PyTorch's kernel choice) is accepted; CUDA fp32/bf16 gradients always take the fused multi-tensor path."""
    from blutensor._tensor import Tensor
    from blutensor.ops._util import xp_of

    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise DTypeError(f"clip_grad_norm_: parameters[{i}] is a {type(p).__name__}, not a Tensor")
    for name, v in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(v, Tensor):
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or v != v:
            raise ArgumentError(f"clip_grad_norm_: {name} must be a number, got {type(v).__name__} {v!r:.40}")
    params = [p for p in params if p.grad is not None]
    if not params:
        from blutensor.creation import tensor

        return tensor(0.0)
    dev = params[0].grad.device
    p_ = float(norm_type)
    total = _fused_cuda(params, max_norm) if p_ == 2.0 else None
    if total is not None:
        for p in params:
            p.grad._version.v += 1
    else:
        total = _fused_cpu(params, float(max_norm)) if p_ == 2.0 else None
        if total is None:
            total = _generic(params, float(max_norm), p_)
    if error_if_nonfinite:
        tnorm = float(total)  # the one host read, only when asked for
        if not math.isfinite(tnorm):
            raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is {tnorm}; "
                               f"pass error_if_nonfinite=False to clip anyway")
    xp = xp_of(total)
    return Tensor._from_data(xp.asarray(total), None, dev)


def _generic(params, max_norm: float, p_: float):
    """Array-module version: norms, clamped scale and the multiply all stay on the device."""
    from blutensor.dtypes import float32
    from blutensor.ops._util import xp_of
    from blutensor.ops.elementwise import _convert

    xp = xp_of(params[0].grad._data)
    if math.isinf(p_):
        norms = [xp.abs(_f32(p.grad)).max() for p in params]
        total = xp.stack(norms).max()
    else:
        norms = [(xp.abs(_f32(p.grad)) ** p_).sum() ** (1.0 / p_) if p_ != 2 else xp.sqrt((_f32(p.grad) ** 2).sum())
                 for p in params]
        stacked = xp.stack(norms)
        total = (xp.abs(stacked) ** p_).sum() ** (1.0 / p_) if p_ != 2 else xp.sqrt((stacked * stacked).sum())
    if xp is __import__("numpy"):  # host arrays: deciding on the host is free and skips a pass when coef == 1
        coef = min(max_norm / (float(total) + 1e-6), 1.0)
        if not coef < 1.0:  # also a NaN/inf norm: gradients left as they are (the caller names the bad one)
            return total
    else:  # device arrays: clamped scale computed in the norm's dtype, as PyTorch does
        coef = xp.minimum(total.dtype.type(max_norm) / (total + total.dtype.type(1e-6)), total.dtype.type(1.0))
    for p in params:
        g = p.grad
        if g.dtype.name in ("float32", "float64"):
            g._data *= xp.asarray(coef, dtype=g._data.dtype)
        else:
            g._data[...] = _convert(_f32(g) * xp.asarray(coef, dtype=float32.np), float32, g.dtype, xp)
        g._version.v += 1
    return total


@no_grad()
def get_total_norm(tensors, norm_type: float = 2.0):
    """The norm of the norms of ``tensors`` (typically gradients) as a 0-d tensor on their device, computed
    without a host read and without touching them (PyTorch's ``get_total_norm``). CUDA fp32/bf16 with the L2
    norm is one multi-tensor kernel (backends/cupy/norm.py), so a captured training step can log the norm."""
    from blutensor._tensor import Tensor
    from blutensor.ops._util import xp_of

    ts = [tensors] if isinstance(tensors, Tensor) else [t for t in tensors if t is not None]
    for i, t in enumerate(ts):
        if not isinstance(t, Tensor):
            raise DTypeError(f"get_total_norm: tensors[{i}] is a {type(t).__name__}, not a Tensor")
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real) or norm_type != norm_type:
        raise ArgumentError(f"get_total_norm: norm_type must be a number, got {type(norm_type).__name__} "
                            f"{norm_type!r:.40}")
    if not ts:
        from blutensor.creation import tensor

        return tensor(0.0)
    dev, p_ = ts[0].device, float(norm_type)
    if (p_ == 2.0 and dev.type == "cuda" and all(t.device == dev and t.dtype.name in ("float32", "bfloat16")
                                                  and t._data.flags.c_contiguous for t in ts)):
        from blutensor.backends.cupy.norm import global_grad_norm

        return Tensor._from_data(global_grad_norm([t._data for t in ts]), None, dev)
    xp = xp_of(ts[0]._data)
    if math.isinf(p_):
        total = xp.stack([xp.abs(_f32(t)).max() for t in ts]).max()
    elif p_ == 2.0:
        sq = xp.stack([(_f32(t) * _f32(t)).sum() for t in ts])
        total = xp.sqrt(sq.sum())
    else:
        total = (xp.stack([(xp.abs(_f32(t)) ** p_).sum() for t in ts]).sum()) ** (1.0 / p_)
    return Tensor._from_data(xp.asarray(total), None, dev)


def clip_grad_value_(parameters, clip_value: float, foreach: bool | None = None) -> None:
    """Clamp every gradient elementwise into [-clip_value, clip_value] in place (PyTorch's semantics;
    ``foreach`` is accepted as in :func:`clip_grad_norm_`)."""
    from blutensor._tensor import Tensor

    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise DTypeError(f"clip_grad_value_: parameters[{i}] is a {type(p).__name__}, not a Tensor")
    if isinstance(clip_value, bool) or not isinstance(clip_value, numbers.Real) or clip_value != clip_value:
        raise ArgumentError(f"clip_grad_value_: clip_value must be a number, got {type(clip_value).__name__} "
                            f"{clip_value!r:.40}")
    c = float(clip_value)
    for p in params:
        if p.grad is not None:
            p.grad.clamp_(-c, c)
