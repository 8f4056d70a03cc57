"""Gradient clipping by global norm (PyTorch's clip_grad_norm_ semantics)."""

from __future__ import annotations

import math

from blutensor.autograd.grad_mode import no_grad


def _f32(t):
    """A gradient's values as a float32/float64 array (bfloat16 widened; raw bits on CUDA)."""
    from blutensor.dtypes import float32
    from blutensor.ops._util import xp_of
    from blutensor.ops.elementwise import _convert

    d = t._data
    if t.dtype.name == "float64":
        return d
    return _convert(d, t.dtype, float32, xp_of(d)) if t.dtype.name != "float32" else d


@no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
    """Scale all gradients by min(1, max_norm / (total_norm + 1e-6)); returns the total norm before
    clipping. The total is the norm of the per-parameter norms, as in PyTorch."""
    from blutensor._tensor import Tensor
    from blutensor.ops._util import xp_of

    params = [p for p in ([parameters] if isinstance(parameters, Tensor) else parameters) if p.grad is not None]
    if not params:
        from blutensor.creation import tensor

        return tensor(0.0)
    dev = params[0].grad.device
    xp = xp_of(params[0].grad._data)
    p_ = float(norm_type)
    if math.isinf(p_):
        norms = [xp.abs(_f32(p.grad)).max() for p in params]
        total = xp.stack(norms).max()
    else:
        norms = [(xp.abs(_f32(p.grad)) ** p_).sum() ** (1.0 / p_) if p_ != 2 else xp.sqrt((_f32(p.grad) ** 2).sum())
                 for p in params]
        stacked = xp.stack(norms)
        total = (xp.abs(stacked) ** p_).sum() ** (1.0 / p_) if p_ != 2 else xp.sqrt((stacked * stacked).sum())
    tnorm = float(total)
    if error_if_nonfinite and not math.isfinite(tnorm):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is {tnorm}; "
                           f"pass error_if_nonfinite=False to clip anyway")
    coef = min(max_norm / (tnorm + 1e-6), 1.0)
    if coef < 1.0:
        from blutensor.dtypes import float32
        from blutensor.ops.elementwise import _convert

        for p in params:
            g = p.grad
            if g.dtype.name in ("float32", "float64"):
                g._data *= g._data.dtype.type(coef)
            else:
                g._data[...] = _convert(_f32(g) * float32.np.type(coef), float32, g.dtype, xp)
            g._version.v += 1
    return Tensor._from_data(xp.asarray(total), None, dev)
