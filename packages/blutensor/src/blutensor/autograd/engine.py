"""The backward engine: topological traversal in reverse creation order, gradient summation,
tensor hooks, leaf accumulation and "gradient ready" hooks, graph release."""

from __future__ import annotations

import heapq

import numpy as np

from blutensor.autograd.grad_mode import STATE
from blutensor.autograd.node import AccumulateGrad, Node
from blutensor.errors import AutogradError, ShapeError

#: profiler/tracer callbacks: ``observer(node, grad, run) -> grads`` wraps every node's backward
#: formula (``run()`` computes it); empty list = no cost beyond one truthiness test per node
backward_observers: list = []


def add_backward_observer(fn) -> None:
    """Wrap every subsequent backward formula with ``fn(node, grad, run)`` (profilers, tracers).

    ``node`` is the autograd :class:`Node` (``node.op``, ``node.kernel``), ``grad`` the raw gradient
    array flowing into it; ``fn`` must return ``run()``'s result (a tuple, one entry per input)."""
    backward_observers.append(fn)


def remove_backward_observer(fn) -> None:
    """Stop calling ``fn`` (no error when it is not installed)."""
    if fn in backward_observers:
        backward_observers.remove(fn)


def _observed(i: int, node, grad):
    if i == len(backward_observers):
        return node.apply(grad)
    return backward_observers[i](node, grad, lambda: _observed(i + 1, node, grad))


def _dependencies(roots) -> dict:
    deps: dict = {}
    stack = [r for r in roots if r is not None]
    seen = set(id(r) for r in stack)
    for r in stack:
        deps.setdefault(r, 0)
    while stack:
        node = stack.pop()
        for nxt in node.next:
            if nxt is None:
                continue
            deps[nxt] = deps.get(nxt, 0) + 1
            if id(nxt) not in seen:
                seen.add(id(nxt))
                stack.append(nxt)
    return deps


def run_backward(tensors, grads, retain_graph: bool = False, capture: dict | None = None) -> None:
    """Backpropagate ``grads`` from ``tensors`` through the recorded graph.

    ``capture`` ({node: None}, for :func:`blutensor.grad`): store the gradient arriving at each of these
    nodes in the dict instead of accumulating into any leaf's ``.grad``."""
    from blutensor._tensor import Tensor

    roots = []
    pending: dict = {}
    for t, g in zip(tensors, grads):
        if not t.requires_grad:
            raise AutogradError(
                f"backward() called on {t._desc()} which does not require grad and has no grad_fn "
                f"(was it created under no_grad, or detached?)"
            )
        node = t.grad_fn if t.grad_fn is not None else t._acc_node()
        roots.append(node)
        _add(pending, node, g)

    deps = _dependencies(roots)
    ready = [(-n.seq, id(n), n) for n in roots if deps.get(n, 0) == 0]
    heapq.heapify(ready)
    done = set()
    prev = STATE.enabled
    STATE.enabled = False  # backward formulas record nothing
    try:
        while ready:
            _, _, node = heapq.heappop(ready)
            if id(node) in done:
                continue
            done.add(id(node))
            grad = pending.pop(node, None)
            if isinstance(node, AccumulateGrad):
                if capture is None:
                    _accumulate(node.tensor, grad, Tensor)
                elif node in capture and grad is not None:
                    t = node.tensor
                    for h in t._hooks or ():
                        r = h(Tensor._from_data(grad, t.dtype, t.device))
                        if r is not None:
                            grad = r._data
                    capture[node] = grad
                continue
            if node.hooks:
                for h in node.hooks:
                    r = h(Tensor._wrap_grad(grad, node))
                    if r is not None:
                        grad = r._data
            if capture is not None and node in capture:
                capture[node] = grad
            if node.retained is not None:
                t = node.retained()
                if t is not None:
                    _set_grad(t, grad, Tensor)
            if grad is None and not getattr(node.kernel, "RUN_WITHOUT_GRAD", False):
                in_grads = (None,) * len(node.next)
            elif grad is None:  # one result of a multi-result op: the gradient of another is kept in its ctx
                in_grads = node.apply(None)
            elif backward_observers:
                in_grads = _observed(0, node, grad)
            else:
                in_grads = node.apply(grad)
            if not retain_graph:
                node.release()
            for nxt, g in zip(node.next, in_grads):
                if nxt is None:
                    continue
                if g is not None:
                    _add(pending, nxt, g)
                deps[nxt] -= 1
                if deps[nxt] == 0:
                    heapq.heappush(ready, (-nxt.seq, id(nxt), nxt))
    finally:
        STATE.enabled = prev


def _add(pending: dict, node, g) -> None:
    cur = pending.get(node)
    pending[node] = g if cur is None else _sum(cur, g)


def _sum(a, b):
    """a + b for gradient arrays; bfloat16 kept as raw uint16 bits (CUDA) is added in float32."""
    if a.dtype != np.uint16:
        return a + b
    from blutensor.backend import bf16_bits_to_f32, f32_to_bf16_bits
    from blutensor.ops._util import xp_of

    xp = xp_of(a)
    return f32_to_bf16_bits(bf16_bits_to_f32(a, xp) + bf16_bits_to_f32(b, xp), xp)


def _set_grad(t, g, Tensor) -> None:
    if t.grad is None:
        t.grad = Tensor._from_data(g.copy() if g.base is not None else g, t.dtype, t.device)
    else:
        t.grad._data = _sum(t.grad._data, g)


def _accumulate(t, g, Tensor) -> None:
    if g is None:
        return
    if tuple(g.shape) != tuple(t._data.shape):
        raise ShapeError(f"gradient of shape {tuple(g.shape)} does not match leaf {t._desc()}")
    for h in t._hooks or ():
        r = h(Tensor._from_data(g, t.dtype, t.device))
        if r is not None:
            g = r._data
    if t.grad is None:
        # own the buffer: a gradient may alias an input of the backward formula
        t.grad = Tensor._from_data(g.copy(), t.dtype, t.device)
    elif g.dtype == np.uint16:
        t.grad._data[...] = _sum(t.grad._data, g)
    else:
        t.grad._data += g
    for h in t._post_hooks or ():
        h(t)


__all__ = ["Node", "add_backward_observer", "backward_observers", "remove_backward_observer", "run_backward"]
