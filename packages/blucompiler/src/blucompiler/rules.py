"""Trace rules: how blutensor's kernels run on traced arrays, installed through ``blutensor.ext``.

* an array provider for :class:`TracedArray` (``blutensor.ext.register_array_provider``): op kernels see
  :class:`TracedNumpy` as the array module of traced arrays (array constructors become nodes), and their
  contractions, scatter-adds and error functions (which branch on the concrete array type) record a node;
* ``embedding`` and ``cross_entropy`` forwards contain host syncs (bounds checks, the count of non-ignored
  targets): their traced forms (``blutensor.ext.override_op_rule``) compute the same values without leaving
  the device; cross_entropy's backward is blutensor's own rule, which takes the device-side count;
* ``AdamW.step`` keeps its Python state (step counter, learning rate) on the host: its traced form
  turns the scalars into per-call host inputs and replays the counter increment before each call;
* ``Optimizer.zero_grad(set_to_none=False)`` fills traced zeros.

Each rule computes exactly what the eager code computes, in the same order; the compiled==eager
tests hold them to it.
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from functools import partial

import blutensor as bt
import numpy as np
from blutensor import ext

from blucompiler.trace import TracedArray, TracedNumpy, TraceUnsupported


class TraceArrays:
    """The array provider of one tracer: traced arrays' module and the three type-branching helpers."""

    def __init__(self, tracer, tnp: TracedNumpy):
        self.tr, self.tnp = tracer, tnp

    def module(self, a):
        # exactly a TracedArray (a per-call host scalar computes with NumPy, as its Python number would)
        return self.tnp if type(a) is TracedArray else np

    def gemm(self, a, b):
        return self.tr.matmul(a, b)

    def scatter_add(self, out, index, values):
        return self.tr.scatter_add(out, index, values)

    def erf(self, x):
        return self.tr.ew("erf", x)


class Rules:
    """Context manager installing the trace rules for one tracer."""

    def __init__(self, tracer):
        self.tr = tracer
        self.tnp = TracedNumpy(tracer)
        self.undo: list = []
        self.stack = ExitStack()

    def _set(self, obj, name, value):
        self.undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def __enter__(self):
        tr = self.tr
        provider = TraceArrays(tr, self.tnp)
        ext.register_array_provider(TracedArray, provider)
        self.stack.callback(ext.unregister_array_provider, TracedArray, provider)
        emb, ce = ext.op_rule("embedding"), ext.op_rule("cross_entropy")
        self.stack.enter_context(ext.override_op_rule("embedding", partial(embedding_forward, emb.forward)))
        self.stack.enter_context(ext.override_op_rule("cross_entropy", partial(cross_entropy_forward, ce.forward)))
        optim = bt.optim
        self._set(optim.AdamW, "step", _adamw_step_rule(tr, optim.AdamW.step))
        self._set(optim.Optimizer, "zero_grad", _zero_grad_rule(tr, optim.Optimizer.zero_grad))
        self._set(optim.SGD, "step", _sgd_step_rule(tr, optim.SGD.step))
        self._set(optim, "clip_grad_norm_", _clip_rule(optim.clip_grad_norm_))
        return self

    def __exit__(self, *exc):
        for obj, name, value in reversed(self.undo):
            setattr(obj, name, value)
        self.undo.clear()
        self.stack.close()
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
    no_grad, zeros_like = bt.no_grad, bt.zeros_like

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
    from blucompiler.trace import CompileError

    no_grad = bt.no_grad

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
        Tensor = bt.Tensor
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
