"""SGD with momentum, dampening, Nesterov and (coupled) weight decay, as PyTorch defines them."""

from __future__ import annotations

from blutensor.autograd.grad_mode import no_grad
from blutensor.errors import BluTensorError
from blutensor.optim.optimizer import Optimizer, check_grads, check_hyper


class SGD(Optimizer):
    """SGD(params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *, maximize=False,
    foreach=None): PyTorch's update; ``maximize`` ascends; ``foreach`` (a kernel choice) is accepted."""

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None):
        self._check_group(dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay))
        if nesterov and (momentum <= 0 or dampening != 0):
            raise BluTensorError("SGD: nesterov needs momentum > 0 and dampening == 0")
        if not isinstance(maximize, bool):
            raise BluTensorError(f"SGD: maximize must be a bool, got {type(maximize).__name__}")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov, maximize=maximize))

    def _check_group(self, group: dict) -> None:
        for name in ("lr", "momentum", "dampening", "weight_decay"):
            check_hyper("SGD", name, group[name])

    @no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        check_grads("SGD", self.param_groups)
        for g in self.param_groups:
            lr, mom, damp, wd, nest = g["lr"], g["momentum"], g["dampening"], g["weight_decay"], g["nesterov"]
            sign = -1 if g.get("maximize") else 1
            for p in g["params"]:
                if p.grad is None:
                    continue
                if p.dtype.name == "bfloat16":
                    _bf16_step(self, p, lr, mom, damp, wd, nest, sign)
                    continue
                d = p.grad._data if sign == 1 else -p.grad._data
                if wd:
                    d = d + wd * p._data
                if mom:
                    st = self.state.setdefault(p, {})
                    buf = st.get("momentum_buffer")
                    if buf is None:
                        from blutensor._tensor import Tensor

                        buf = st["momentum_buffer"] = Tensor._from_data(d.copy(), p.dtype, p.device)
                    else:
                        buf._data *= mom
                        buf._data += (1 - damp) * d
                    d = d + mom * buf._data if nest else buf._data
                p._data -= lr * d
                p._version.v += 1
        return loss


def _bf16_step(opt, p, lr, mom, damp, wd, nest, sign: int = 1) -> None:
    """SGD on a bfloat16 parameter: the update in float32 (momentum kept in float32), then rounded."""
    from blutensor._tensor import Tensor
    from blutensor.dtypes import float32
    from blutensor.ops._util import xp_of
    from blutensor.ops.elementwise import _convert

    xp = xp_of(p._data)
    x = _convert(p._data, p.dtype, float32, xp)
    d = _convert(p.grad._data, p.grad.dtype, float32, xp)
    if sign != 1:
        d = -d
    if wd:
        d = d + wd * x
    if mom:
        st = opt.state.setdefault(p, {})
        buf = st.get("momentum_buffer")
        if buf is None:
            buf = st["momentum_buffer"] = Tensor._from_data(d.copy(), float32, p.device)
        else:
            buf._data *= mom
            buf._data += (1 - damp) * d
        d = d + mom * buf._data if nest else buf._data
    p._data[...] = _convert(x - lr * d, float32, p.dtype, xp)
    p._version.v += 1
