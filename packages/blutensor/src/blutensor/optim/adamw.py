"""AdamW with PyTorch's exact update order (decoupled weight decay, bias-corrected moments)."""

from __future__ import annotations

import math

import numpy as np

from blutensor.autograd.grad_mode import no_grad
from blutensor.creation import zeros_like
from blutensor.optim.adam import adam_group_step, check_adam_group
from blutensor.optim.optimizer import Optimizer, check_grads


def _f32(p):
    """(compute array, writer) for a parameter: bfloat16 storage is widened to float32."""
    d = p._data
    if p.dtype.name != "bfloat16":
        return d, None
    from blutensor.dtypes import float32
    from blutensor.ops._util import xp_of
    from blutensor.ops.elementwise import _convert

    return _convert(d, p.dtype, float32, xp_of(d)), lambda v: d.__setitem__(
        Ellipsis, _convert(v, float32, p.dtype, xp_of(d)))


def adamw_state(optimizer: Optimizer, p) -> dict:
    """``p``'s AdamW state, made as its first update makes it when missing: step 0 and zero moments (float32 for
    bfloat16 parameters)."""
    st = optimizer.state.get(p)
    if st is None:
        f32 = "float32" if p.dtype.name == "bfloat16" else None
        st = optimizer.state[p] = {"step": 0, "exp_avg": zeros_like(p, dtype=f32),
                                   "exp_avg_sq": zeros_like(p, dtype=f32)}
    return st


class AdamW(Optimizer):
    """AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
    maximize=False, fused=None). Groups with amsgrad or maximize take the general Adam step (not the fused
    CUDA kernel)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, fused: bool | None = None):
        group = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        self._check_group(group)
        super().__init__(params, {**group, "betas": tuple(betas)})
        self.fused = fused

    def _check_group(self, group: dict) -> None:
        check_adam_group("AdamW", group)

    def init_state(self) -> None:
        """Make every trainable parameter's state now, as its first update would (step 0, zero moments): a
        caller that keeps long-lived device buffers together allocates them before the first activations."""
        for g in self.param_groups:
            for p in g["params"]:
                if p.requires_grad:
                    adamw_state(self, p)

    @no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        if not self.fused:
            check_grads("AdamW", self.param_groups)
        for g in self.param_groups:
            if g.get("amsgrad") or g.get("maximize"):
                adam_group_step(self, g, decoupled=True)
                continue
            if self.fused and any(p.device.type == "cuda" for p in g["params"]):
                from blutensor.backends.cupy.adamw import fused_step

                fused_step(self, g)  # one multi-tensor launch for the whole group
                continue
            lr, (b1, b2), eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
            lr = float(lr)
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = adamw_state(self, p)
                st["step"] += 1
                adamw_update(p, st["exp_avg"]._data, st["exp_avg_sq"]._data, st["step"], lr, b1, b2, eps, wd)
                p._version.v += 1
        return loss


def adamw_update(p, m, v, step: int, lr: float, b1: float, b2: float, eps: float, wd: float) -> None:
    """One AdamW update of parameter ``p`` with moment arrays ``m`` and ``v`` (in place)."""
    x, write = _f32(p)
    gr = p.grad._data
    if gr.dtype != m.dtype:
        from blutensor.dtypes import float32
        from blutensor.ops._util import xp_of
        from blutensor.ops.elementwise import _convert

        gr = _convert(gr, p.grad.dtype, float32, xp_of(gr))
    from blutensor.backends.numpy.optim import adamw_

    if adamw_(x, gr, m, v, step, lr, b1, b2, eps, wd):  # host float32: the compiled kernel, bit-identical
        if write is not None:
            write(x)
        return
    dt = x.dtype.type
    x *= dt(1 - lr * wd)
    m += dt(1 - b1) * (gr - m)  # lerp(m, g, 1-b1) for weight < 0.5
    v *= dt(b2)
    v += dt(1 - b2) * gr * gr
    bc1 = 1 - b1 ** step
    bc2_sqrt = math.sqrt(1 - b2 ** step)
    step_size = lr / bc1
    xp = np if type(x) is np.ndarray else __import__("cupy")
    denom = xp.sqrt(v) / dt(bc2_sqrt) + dt(eps)
    x += (dt(-step_size) * m) / denom  # addcdiv_(m, denom, value=-step_size): (value * m) / denom
    if write is not None:
        write(x)
