"""Adam (L2 weight decay added to the gradient) and the general Adam/AdamW step with PyTorch's options
(amsgrad, maximize), in PyTorch's exact update order."""

from __future__ import annotations

import math

import numpy as np

from blutensor.autograd.grad_mode import no_grad
from blutensor.creation import zeros_like
from blutensor.errors import ArgumentError
from blutensor.optim.optimizer import Optimizer, check_grads, check_hyper


def check_adam_group(opt: str, group: dict) -> None:
    for name in ("lr", "eps", "weight_decay"):
        check_hyper(opt, name, group[name])
    betas = group["betas"]
    if isinstance(betas, str) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise ArgumentError(f"{opt}: invalid hyperparameters: betas={betas!r} must be a pair (beta1, beta2)")
    check_hyper(opt, "betas[0]", betas[0], 0.0, 1.0)
    check_hyper(opt, "betas[1]", betas[1], 0.0, 1.0)
    for name in ("amsgrad", "maximize"):
        if not isinstance(group.get(name, False), bool):
            raise ArgumentError(f"{opt}: invalid hyperparameters: {name}={group[name]!r} must be a bool")


def _state(opt: Optimizer, p, amsgrad: bool) -> dict:
    st = opt.state.get(p)
    wide = "float32" if p.dtype.name == "bfloat16" else None  # moments of bf16 parameters kept in fp32
    if st is None:
        st = opt.state[p] = {"step": 0, "exp_avg": zeros_like(p, dtype=wide), "exp_avg_sq": zeros_like(p, dtype=wide)}
    if amsgrad and "max_exp_avg_sq" not in st:
        st["max_exp_avg_sq"] = zeros_like(p, dtype=wide)
    return st


def adam_group_step(opt: Optimizer, g: dict, decoupled: bool) -> None:
    """One step of every parameter of group ``g``: AdamW's decay when ``decoupled``, else Adam's L2."""
    from blutensor.optim.adamw import _f32

    lr, (b1, b2), eps, wd = float(g["lr"]), g["betas"], g["eps"], g["weight_decay"]
    amsgrad, maximize = g.get("amsgrad", False), g.get("maximize", False)
    for p in g["params"]:
        if p.grad is None:
            continue
        st = _state(opt, p, amsgrad)
        st["step"] += 1
        step = st["step"]
        x, write = _f32(p)
        m, v = st["exp_avg"]._data, st["exp_avg_sq"]._data
        gr = p.grad._data
        if gr.dtype != m.dtype:
            from blutensor.dtypes import float32
            from blutensor.ops._util import xp_of
            from blutensor.ops.elementwise import _convert

            gr = _convert(gr, p.grad.dtype, float32, xp_of(gr))
        dt = x.dtype.type
        if maximize:
            gr = -gr
        if wd:
            if decoupled:
                x *= dt(1 - lr * wd)
            else:
                gr = gr + dt(wd) * x
        m += dt(1 - b1) * (gr - m)
        v *= dt(b2)
        v += dt(1 - b2) * gr * gr
        bc1 = 1 - b1 ** step
        bc2_sqrt = math.sqrt(1 - b2 ** step)
        xp = np if type(x) is np.ndarray else __import__("cupy")
        if amsgrad:
            mx = st["max_exp_avg_sq"]._data
            xp.maximum(mx, v, out=mx)
            denom = xp.sqrt(mx) / dt(bc2_sqrt) + dt(eps)
        else:
            denom = xp.sqrt(v) / dt(bc2_sqrt) + dt(eps)
        x += (dt(-lr / bc1) * m) / denom
        if write is not None:
            write(x)
        p._version.v += 1


class Adam(Optimizer):
    """Adam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, maximize=False):
    the weight decay is L2 (added to the gradient), unlike AdamW's decoupled decay. ``foreach`` (PyTorch's
    kernel choice) is accepted and changes nothing."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None):
        group = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize)
        self._check_group(group)
        super().__init__(params, {**group, "betas": tuple(betas)})

    def _check_group(self, group: dict) -> None:
        check_adam_group("Adam", group)

    @no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        check_grads("Adam", self.param_groups)
        for g in self.param_groups:
            adam_group_step(self, g, decoupled=False)
        return loss
