"""Trace rules: the few blutensor functions that must be replaced while tracing.

* ``xp_of`` returns :class:`TracedNumpy` for traced arrays (array constructors become nodes);
* ``gemm``, ``scatter_add`` and ``erf`` branch on the concrete array type: they record a node;
* ``embedding`` and ``cross_entropy`` contain host syncs (bounds checks, the count of non-ignored
  targets): their traced forms compute the same values without leaving the device;
* ``AdamW.step`` keeps its Python state (step counter, learning rate) on the host: its traced form
  turns the scalars into per-call host inputs and replays the counter increment before each call;
* ``Optimizer.zero_grad(set_to_none=False)`` fills traced zeros.

Each rule computes exactly what the eager code computes, in the same order; the compiled==eager
tests hold them to it.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np

from blucompiler.trace import _ORIG, TracedArray, TracedNumpy, TraceUnsupported

_XP_MODULES = ("blutensor.ops._util", "blutensor.ops.elementwise", "blutensor.ops.reduction",
               "blutensor.ops.shape", "blutensor.ops.nn_ops")
_SCATTER_MODULES = ("blutensor.ops._util", "blutensor.ops.shape", "blutensor.ops.nn_ops")


class Rules:
    """Context manager installing the trace rules for one tracer."""

    def __init__(self, tracer):
        self.tr = tracer
        self.tnp = TracedNumpy(tracer)
        self.undo: list = []

    def _set(self, obj, name, value):
        self.undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def __enter__(self):
        import importlib

        from blutensor.ops import _util, elementwise, linalg
        from blutensor.ops.table import OPS
        from blutensor.optim import adamw
        from blutensor.optim.optimizer import Optimizer

        _ORIG.setdefault("gemm", linalg.gemm)
        _ORIG.setdefault("scatter_add", _util.scatter_add)
        _ORIG.setdefault("erf", elementwise.erf)
        _ORIG.setdefault("xp_of", _util.xp_of)
        tr, tnp = self.tr, self.tnp
        orig_xp = _ORIG["xp_of"]

        def xp_of(a):
            return tnp if type(a) is TracedArray else orig_xp(a)

        def gemm(a, b):
            if isinstance(a, TracedArray) or isinstance(b, TracedArray):
                return tr.matmul(a, b)
            return _ORIG["gemm"](a, b)

        def scatter_add(out, index, values):
            if isinstance(out, TracedArray) or isinstance(values, TracedArray):
                return tr.scatter_add(out, index, values)
            return _ORIG["scatter_add"](out, index, values)

        def erf(x, xp):
            if isinstance(x, TracedArray):
                return tr.ew("erf", x)
            return _ORIG["erf"](x, xp)

        for m in _XP_MODULES:
            self._set(importlib.import_module(m), "xp_of", xp_of)
        for m in _SCATTER_MODULES:
            self._set(importlib.import_module(m), "scatter_add", scatter_add)
        self._set(linalg, "gemm", gemm)
        self._set(elementwise, "erf", erf)
        emb, ce = OPS["embedding"], OPS["cross_entropy"]
        self._set(emb, "forward", staticmethod(partial(embedding_forward, emb.forward)))
        self._set(ce, "forward", staticmethod(partial(cross_entropy_forward, ce.forward)))
        self._set(ce, "backward", staticmethod(partial(cross_entropy_backward, ce.backward)))
        self._set(adamw.AdamW, "step", _adamw_step_rule(tr, adamw.AdamW.step))
        self._set(Optimizer, "zero_grad", _zero_grad_rule(tr, Optimizer.zero_grad))
        from blutensor.optim import sgd

        self._set(sgd.SGD, "step", _sgd_step_rule(tr, sgd.SGD.step))
        import blutensor.optim as optim
        from blutensor.optim import clip

        rule = _clip_rule(clip.clip_grad_norm_)
        self._set(clip, "clip_grad_norm_", rule)
        if hasattr(optim, "clip_grad_norm_"):
            self._set(optim, "clip_grad_norm_", rule)
        return self

    def __exit__(self, *exc):
        for obj, name, value in reversed(self.undo):
            setattr(obj, name, value)
        self.undo.clear()
        return False


def embedding_forward(orig, ctx, idx, weight):
    """Traced embedding: the host-side bounds check is left out (the gather itself is recorded)."""
    if not (isinstance(idx, TracedArray) or isinstance(weight, TracedArray)):
        return orig(ctx, idx, weight)
    ctx.saved = (idx, weight.shape)
    return weight[idx]


def cross_entropy_forward(orig, ctx, logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    """blutensor's cross_entropy with the count of valid targets kept on the device."""
    if not isinstance(logits, TracedArray) or reduction not in ("mean", "sum", "none") or \
            target.shape != logits.shape[:-1]:
        return orig(ctx, logits, target, ignore_index, reduction, label_smoothing)
    xp = TracedNumpy(logits.tr)
    C = logits.shape[-1]
    z = logits.reshape(-1, C)
    t = target.reshape(-1).astype(np.int64)
    valid = t != ignore_index
    tt = xp.where(valid, t, 0)
    m = z.max(axis=1, keepdims=True)
    lse = m[:, 0] + xp.log(xp.exp(z - m).sum(axis=1))
    picked = xp.take_along_axis(z, tt[:, None], axis=1)[:, 0]
    loss = lse - picked
    if label_smoothing:
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - z.mean(axis=1))
    loss = xp.where(valid, loss, 0).astype(logits.dtype)
    count = valid.sum()
    ctx.saved = (z, lse, tt, valid, count, reduction, logits.shape, label_smoothing)
    if reduction == "none":
        return loss.reshape(target.shape)
    total = loss.sum()
    if reduction == "sum":
        return total
    cf = xp.maximum(count, 1).astype(logits.dtype)
    return xp.where(count > 0, (total / cf).astype(logits.dtype), logits.dtype.type(np.nan))


def cross_entropy_backward(orig, ctx, g):
    z, lse, tt, valid, count, reduction, shape, ls = ctx.saved
    if not isinstance(z, TracedArray):
        return orig(ctx, g)
    xp = TracedNumpy(z.tr)
    p = xp.exp(z - lse[:, None])
    C = z.shape[1]
    if ls:
        p = p - ls / C
    p = p - (1 - ls) * (xp.arange(C)[None, :] == tt[:, None])
    if reduction == "none":
        scale = g.reshape(-1)[:, None]
    elif reduction == "sum":
        scale = g
    else:
        scale = g / xp.maximum(count, 1).astype(z.dtype)
    p = p * valid[:, None] * scale
    return p.astype(z.dtype, copy=False).reshape(shape), None


# ---- optimizer ----


def _bump(st: dict) -> None:
    st["step"] += 1


def _adamw_scalars(group: dict, st: dict):
    """The host scalars of one AdamW update, as blutensor's adamw_update computes them."""
    lr, (b1, b2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
    step = st["step"]
    dt = np.float32
    bc1 = 1 - b1 ** step
    bc2_sqrt = math.sqrt(1 - b2 ** step)
    step_size = lr / bc1
    return (dt(1 - lr * wd), dt(1 - b1), dt(b2), dt(1 - b2), dt(bc2_sqrt), dt(eps), dt(-step_size))


def _adamw_step_rule(tr, orig):
    from blutensor.autograd.grad_mode import no_grad
    from blutensor.creation import zeros_like

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        with no_grad():
            for gi, g in enumerate(self.param_groups):
                for p in g["params"]:
                    if p.grad is None:
                        continue
                    if p.dtype.name != "float32":
                        raise TraceUnsupported(f"AdamW on a {p.dtype.name} parameter")
                    st = self.state.get(p)
                    if st is None:
                        st = self.state[p] = {"step": 0, "exp_avg": zeros_like(p), "exp_avg_sq": zeros_like(p)}
                    st["step"] += 1
                    tr.g.effects.append(partial(_bump, st))
                    c = tr.host_scalars(("adamw", id(self), gi, st["step"]), partial(_adamw_scalars, g, st))
                    x = _traced(tr, p)
                    m = _traced(tr, st["exp_avg"])
                    v = _traced(tr, st["exp_avg_sq"])
                    gr = _traced(tr, p.grad)
                    if gr.dtype != m.dtype:
                        raise TraceUnsupported("AdamW with gradients of another dtype than the state")
                    x *= c[0]
                    m += c[1] * (gr - m)
                    v *= c[2]
                    v += c[3] * gr * gr
                    denom = np.sqrt(v) / c[4] + c[5]
                    x += (c[6] * m) / denom  # addcdiv_(m, denom, value=-step_size)
                    p._version.v += 1
        return loss

    step.__wrapped__ = orig
    return step


def _sgd_scalars(group: dict):
    """lr, weight decay, momentum, 1 - dampening of an SGD group, read live every call."""
    return (float(group["lr"]), float(group["weight_decay"]), float(group["momentum"]),
            float(1 - group["dampening"]))


def _sgd_step_rule(tr, orig):
    """blutensor's SGD.step with its hyperparameters as per-call host scalars (Python floats, so
    NumPy promotes them exactly as it does the eager step's Python numbers)."""
    from blutensor.autograd.grad_mode import no_grad

    from blucompiler.trace import CompileError

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        with no_grad():
            for gi, g in enumerate(self.param_groups):
                mom, nest = g["momentum"], g["nesterov"]
                for p in g["params"]:
                    if p.grad is None:
                        continue
                    if mom and self.state.get(p, {}).get("momentum_buffer") is None:
                        raise CompileError("SGD's first momentum step creates its buffers (a different "
                                           "program than later steps): run one step eagerly first", retry=True)
                    c = tr.host_scalars(("sgd", id(self), gi), partial(_sgd_scalars, g), weak=True)
                    x = _traced(tr, p)
                    d = _traced(tr, p.grad)
                    if g["weight_decay"]:
                        d = d + c[1] * x
                    if mom:
                        buf = _traced(tr, self.state[p]["momentum_buffer"])
                        buf *= c[2]
                        buf += c[3] * d
                        d = d + c[2] * buf if nest else buf
                    x -= c[0] * d
                    p._version.v += 1
        return loss

    step.__wrapped__ = orig
    return step


def _clip_rule(orig):
    """clip_grad_norm_ without the host read: the scale min(1, max_norm / (norm + 1e-6)) stays on the
    device and multiplies every gradient (by exactly 1 when no clipping is needed, as eager skips)."""

    def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        from blutensor._tensor import Tensor

        params = [p for p in ([parameters] if isinstance(parameters, Tensor) else parameters) if p.grad is not None]
        if (not params or float(norm_type) != 2.0 or error_if_nonfinite
                or not all(isinstance(p.grad._data, TracedArray) and p.grad.dtype.name == "float32" for p in params)):
            return orig(parameters, max_norm, norm_type, error_if_nonfinite)
        norms = [np.sqrt((p.grad._data ** 2).sum()) for p in params]
        stacked = np.stack(norms)
        total = np.sqrt((stacked * stacked).sum())
        c = max_norm / (total.astype(np.float64) + 1e-6)
        coef = np.where(c < 1.0, c, 1.0).astype(np.float32)  # NaN norm: no scaling, as eager
        for p in params:
            g = p.grad._data
            g *= coef
            p.grad._version.v += 1
        return Tensor._from_data(total, None, params[0].grad.device)

    return clip_grad_norm_


def _zero_grad_rule(tr, orig):
    def zero_grad(self, set_to_none: bool = True):
        if set_to_none:
            return orig(self, True)
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    a = _traced(tr, p.grad)
                    a.fill(0)
        return None

    return zero_grad


def _traced(tr, t) -> TracedArray:
    return t._data if isinstance(t._data, TracedArray) else tr.lift(t)
