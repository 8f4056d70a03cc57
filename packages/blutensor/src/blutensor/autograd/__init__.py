"""Reverse-mode autograd: grad mode, graph nodes and the backward engine."""

from blutensor.autograd.engine import run_backward
from blutensor.autograd.function import Function, FunctionCtx
from blutensor.autograd.grad_mode import (
    enable_grad,
    inference_mode,
    is_grad_enabled,
    is_inference_mode_enabled,
    no_grad,
    set_grad_enabled,
)
from blutensor.autograd.node import ACCUMULATED, AccumulateGrad, Ctx, Node, Summed


def grad(outputs, inputs, grad_outputs=None, retain_graph: bool = False):
    """Gradients of ``outputs`` w.r.t. ``inputs`` (leaves or intermediate tensors), returned as a tuple;
    no tensor's ``.grad`` is touched. An input the outputs do not depend on gets None."""
    from blutensor._tensor import Tensor

    outputs = [outputs] if isinstance(outputs, Tensor) or not hasattr(outputs, "__iter__") else list(outputs)
    inputs = [inputs] if isinstance(inputs, Tensor) or not hasattr(inputs, "__iter__") else list(inputs)
    if grad_outputs is None:
        grad_outputs = [None] * len(outputs)
    elif isinstance(grad_outputs, Tensor):
        grad_outputs = [grad_outputs]
    for name, ts in (("outputs", outputs), ("inputs", inputs)):
        for i, t in enumerate(ts):
            if not isinstance(t, Tensor):
                from blutensor.errors import DTypeError

                raise DTypeError(f"grad: {name}[{i}] is a {type(t).__name__}, not a Tensor")
    nodes = []
    for t in inputs:
        if not t.requires_grad:
            from blutensor.errors import AutogradError

            raise AutogradError(f"grad: input {t._desc()} does not require grad")
        nodes.append(t.grad_fn if t.grad_fn is not None else t._acc_node())
    capture = dict.fromkeys(nodes)
    gs = [Tensor._default_grad(o, g) for o, g in zip(outputs, grad_outputs)]
    run_backward(outputs, gs, retain_graph=retain_graph, capture=capture)
    out = []
    for t, n in zip(inputs, nodes):
        g = capture[n]
        out.append(None if g is None else Tensor._from_data(g.copy() if g.base is not None else g, t.dtype,
                                                           t.device))
    return tuple(out)


__all__ = ["ACCUMULATED", "AccumulateGrad", "Ctx", "Function", "FunctionCtx", "Node", "enable_grad", "grad",
           "is_grad_enabled",
           "no_grad", "run_backward", "set_grad_enabled",
           "inference_mode", "is_inference_mode_enabled", "Summed"]
