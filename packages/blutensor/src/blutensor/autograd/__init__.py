"""Reverse-mode autograd: grad mode, graph nodes and the backward engine."""

from blutensor.autograd.engine import run_backward
from blutensor.autograd.function import Function, FunctionCtx
from blutensor.autograd.grad_mode import enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from blutensor.autograd.node import AccumulateGrad, Ctx, Node


def grad(outputs, inputs, grad_outputs=None, retain_graph: bool = False):
    """Gradients of ``outputs`` w.r.t. ``inputs`` without touching ``.grad`` of other leaves."""
    from blutensor._tensor import Tensor

    outputs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    inputs = [inputs] if isinstance(inputs, Tensor) else list(inputs)
    saved = [(t, t.grad) for t in inputs]
    for t in inputs:
        t.grad = None
    if grad_outputs is None:
        grad_outputs = [None] * len(outputs)
    try:
        gs = [Tensor._default_grad(o, g) for o, g in zip(outputs, grad_outputs)]
        run_backward(outputs, gs, retain_graph=retain_graph)
        return tuple(t.grad for t in inputs)
    finally:
        for t, g in saved:
            t.grad = g


__all__ = ["AccumulateGrad", "Ctx", "Function", "FunctionCtx", "Node", "enable_grad", "grad", "is_grad_enabled",
           "no_grad", "run_backward", "set_grad_enabled"]
