"""The backward engine: topological traversal in reverse creation order, gradient summation,
tensor hooks, leaf accumulation and "gradient ready" hooks, graph release.

Accumulation in the kernel: where a leaf already owns a float32 ``.grad`` buffer (the static gradients of a
training step, gradient accumulation over micro-steps) and nothing needs its gradient as a separate array (no
tensor hook on the leaf, no ``bt.grad`` capture), the engine hands that buffer to the backward formula of each
op whose kernel declares ``GRAD_INTO`` (``ctx.grad_into[i]``); the formula adds its gradient straight into it
(a GEMM with beta = 1, a reduction that adds its result) and returns :data:`ACCUMULATED` for that input, so no
gradient array is allocated and no separate add runs. A node whose kernel's ``forwards_grad_into(ctx)`` says so
(the CUDA float32 -> bfloat16 weight cast of autocast) passes its master's buffer on to its consumers: the bf16
weight's gradient lands in the float32 ``.grad`` unrounded. The leaf's "gradient ready" hooks still fire once,
after its last contribution. Likewise a kernel that declares ``GRAD_SUM`` sees, in ``ctx.grad_pending[i]``, the
gradient the engine already holds for an op-node input (the residual stream's, at a pre-LayerNorm block's
``layer_norm``), adds it into its own result in the same pass and returns :class:`Summed`: the engine replaces
what it held instead of running a separate add. Sums per leaf are the same; only the order of the adds into the
buffer may differ from accumulating one summed gradient (on the CPU the built-in formulas add exactly what the
engine would).
"""

from __future__ import annotations

import heapq

import numpy as np

from blutensor.autograd.grad_mode import STATE
from blutensor.autograd.node import ACCUMULATED, AccumulateGrad, Node, Summed
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
    written: set = set()  # ids of AccumulateGrad sinks a kernel accumulated into
    fan_in = deps.copy()  # gradients each node receives (a tied leaf: several)
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
                    if grad is None and id(node) in written:
                        _ready(node.tensor)
                    else:
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
            into = pend = None
            if grad is not None and capture is None and getattr(node.kernel, "GRAD_INTO", False):
                into = _targets(node, fan_in)
                node.ctx.grad_into = into
            if grad is not None and getattr(node.kernel, "GRAD_SUM", False):
                pend = _pending_for(node, pending, capture)
                node.ctx.grad_pending = pend
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
            if node.ctx is not None:
                if into is not None:
                    node.ctx.grad_into = None
                if pend is not None:
                    node.ctx.grad_pending = None
            for i, (nxt, g) in enumerate(zip(node.next, in_grads)):
                if nxt is None:
                    continue
                if g is ACCUMULATED:
                    if into is None or into[i] is None:
                        raise AutogradError(f"backward of '{node.op}' returned ACCUMULATED for input {i}, which "
                                            f"was offered no gradient buffer")
                    written.add(id(_sink(nxt)))
                elif type(g) is Summed:
                    if pend is None or pend[i] is None or pending.get(nxt) is not pend[i]:
                        raise AutogradError(f"backward of '{node.op}' returned Summed for input {i}, which had "
                                            f"no pending gradient offered")
                    pending[nxt] = g.grad
                elif g is not None:
                    _add(pending, nxt, g)
                deps[nxt] -= 1
                if deps[nxt] == 0:
                    heapq.heappush(ready, (-nxt.seq, id(nxt), nxt))
    finally:
        STATE.enabled = prev


def _leaf_buffer(acc):
    """The float32 ``.grad`` array of the leaf behind AccumulateGrad ``acc`` that a kernel may add into, or None."""
    t = acc.tensor
    gt = t.grad
    if gt is None or t._hooks:
        return None
    d = gt._data
    if d.dtype != np.float32 or tuple(d.shape) != tuple(t._data.shape) or not d.flags.c_contiguous:
        return None
    return d


def _sink(nxt):
    """The AccumulateGrad a gradient offered through ``nxt`` ends in (``nxt`` itself or a forwarding cast's)."""
    return nxt if isinstance(nxt, AccumulateGrad) else nxt.next[0]


def _targets(node, fan_in: dict):
    """Per input of ``node``: the leaf gradient buffer its backward may accumulate into, or None; None if none.

    A host (NumPy) leaf that receives several gradients (a tied weight) is not offered: the engine sums them
    first and adds once, so CPU results stay bit-identical to accumulating outside the kernels; on a device each
    contribution is added into the buffer in turn (the sum is the same, the order of its adds differs)."""
    out = None
    for i, nxt in enumerate(node.next):
        buf = None
        if isinstance(nxt, AccumulateGrad):
            buf = _leaf_buffer(nxt)
            if buf is not None and fan_in.get(nxt, 1) > 1 and type(buf) is np.ndarray:
                buf = None
        elif (nxt is not None and nxt.hooks is None and nxt.retained is None and len(nxt.next) == 1
              and isinstance(nxt.next[0], AccumulateGrad) and not nxt.freed
              and (fwd := getattr(nxt.kernel, "forwards_grad_into", None)) is not None and fwd(nxt.ctx)):
            buf = _leaf_buffer(nxt.next[0])
        if buf is not None:
            if out is None:
                out = [None] * len(node.next)
            out[i] = buf
    return None if out is None else tuple(out)


def _pending_for(node, pending: dict, capture):
    """Per input of ``node``: the gradient already pending for it (op nodes only, not leaves or captured nodes),
    for a GRAD_SUM kernel to add into its result; None if there is none."""
    out = None
    for i, nxt in enumerate(node.next):
        if nxt is None or isinstance(nxt, AccumulateGrad) or (capture is not None and nxt in capture):
            continue
        cur = pending.get(nxt)
        if cur is not None and cur.dtype != np.uint16:
            if out is None:
                out = [None] * len(node.next)
            out[i] = cur
    return None if out is None else tuple(out)


def _ready(t) -> None:
    """A leaf whose whole gradient was accumulated by kernels: its "gradient ready" hooks."""
    for h in t._post_hooks or ():
        h(t)


def _add(pending: dict, node, g) -> None:
    cur = pending.get(node)
    pending[node] = g if cur is None else _sum(cur, g)


def _sum(a, b):
    """a + b for gradient arrays; bfloat16 kept as raw uint16 bits (CUDA) is added in float32."""
    if a.dtype != np.uint16:
        return a + b
    from blutensor.backends import bf16_add
    from blutensor.ops._util import xp_of

    return bf16_add(a, b, xp_of(a))


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


__all__ = ["ACCUMULATED", "Node", "add_backward_observer", "backward_observers", "remove_backward_observer",
           "run_backward"]
