"""Gradient clipping by global L2 norm."""

from __future__ import annotations

import math

from blutensor.autograd.grad_mode import no_grad


@no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
    """Scale all gradients so their global norm is at most ``max_norm``; returns the norm before."""
    from blutensor._tensor import Tensor

    params = [p for p in ([parameters] if isinstance(parameters, Tensor) else parameters) if p.grad is not None]
    if not params:
        from blutensor.creation import tensor

        return tensor(0.0)
    dev = params[0].grad.device
    xp = __import__("numpy") if dev.type == "cpu" else __import__("cupy")
    sq = [xp.sum(p.grad._data.astype(xp.float32) ** 2) if p.grad.dtype.name != "float64"
          else xp.sum(p.grad._data ** 2) for p in params]
    total = xp.sqrt(xp.sum(xp.stack(sq)))
    tnorm = float(total)
    if error_if_nonfinite and not math.isfinite(tnorm):
        raise RuntimeError(f"clip_grad_norm_: the total gradient norm is {tnorm}")
    coef = max_norm / (tnorm + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad._data *= p.grad._data.dtype.type(coef)
    return Tensor._from_data(xp.asarray(total, dtype=params[0].grad._data.dtype
                                        if params[0].grad.dtype.name in ("float32", "float64") else xp.float32),
                             None, dev)
