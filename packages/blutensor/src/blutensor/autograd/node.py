"""Graph nodes: one per differentiable op result, and one accumulator per leaf tensor."""

from __future__ import annotations

import itertools

from blutensor.errors import AutogradError

_seq = itertools.count()


class Ctx:
    """Scratch space a kernel's forward fills for its backward (``ctx.saved`` etc.)."""

    __slots__ = ("saved", "attrs", "needs", "__dict__")
    out_dtype = None  # a kernel may name its result's blutensor dtype (cast to bf16: uint16 bits on CUDA)
    #: set by the engine before a GRAD_INTO kernel's backward: per input, the float32 gradient buffer of the leaf
    #: that input's gradient ends in (accumulate into it and return ``ACCUMULATED``), or None
    grad_into = None
    #: set by the engine before a GRAD_SUM kernel's backward: per input, the gradient already pending for it (a
    #: non-leaf), or None; the kernel may add it into its result and return that as ``Summed(result)``
    grad_pending = None

    def __init__(self):
        self.saved = ()
        self.attrs = None
        self.needs = ()


class _Accumulated:
    """The type of :data:`ACCUMULATED`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ACCUMULATED"


#: what a backward formula returns for an input whose gradient it added into ``ctx.grad_into[i]`` itself
ACCUMULATED = _Accumulated()


class Summed:
    """Returned by a backward formula for input ``i`` when its gradient already includes ``ctx.grad_pending[i]``
    (the gradient the engine holds for that input so far, e.g. a residual branch's): the engine replaces what it
    holds with ``grad`` instead of adding, so the formula's kernel does the sum (no separate add)."""

    __slots__ = ("grad",)

    def __init__(self, grad):
        self.grad = grad


class Node:
    """A recorded op: its kernel, context, inputs' producers and saved-tensor versions."""

    # hooks / retained / freed / meta are rarely set: class-level defaults keep creation cheap
    __slots__ = ("op", "kernel", "ctx", "next", "versions", "seq", "__weakref__", "__dict__")
    hooks = None
    retained = None
    freed = False
    meta = None

    def __init__(self, op: str, kernel, ctx: Ctx, inputs, versions):
        self.op = op
        self.kernel = kernel
        self.ctx = ctx
        # next[i] = node that receives the gradient of input i (None if it needs none)
        nxt = []
        for t in inputs:
            if getattr(t, "requires_grad", False):
                g = t.grad_fn
                if g is None:
                    g = t._acc
                    if g is None:
                        g = t._acc = AccumulateGrad(t)
                nxt.append(g)
            else:
                nxt.append(None)
        self.next = tuple(nxt)
        self.versions = versions
        self.seq = next(_seq)

    def check_saved(self) -> None:
        for counter, expected, which, shape in self.versions:
            if counter.v != expected:
                what = f"its output of shape {tuple(shape)}" if which < 0 else f"input {which} of shape {tuple(shape)}"
                raise AutogradError(
                    f"one of the tensors saved by '{self.op}' for backward ({what}) was modified in place "
                    f"after it was saved: its version is {counter.v}, expected {expected}. Clone it before "
                    f"modifying it, or do the in-place change after backward."
                )

    def apply(self, grad):
        if self.freed:
            raise AutogradError(
                f"trying to backward through the graph a second time (op '{self.op}'): its saved tensors "
                f"were freed after the first backward; pass retain_graph=True to the first backward()"
            )
        self.check_saved()
        grads = self.kernel.backward(self.ctx, grad)
        if not isinstance(grads, tuple):
            grads = (grads,)
        return grads

    def release(self) -> None:
        self.ctx = None
        self.freed = True

    def __repr__(self) -> str:
        return f"<{self.op}Backward #{self.seq}>"


#: AccumulateGrad sequence numbers start above every op node's: the engine runs a leaf's accumulation (and its
#: "gradient ready" hooks) as soon as its last gradient has arrived, at every backward. A leaf keeps one
#: AccumulateGrad for its life, so ordering it by the creation of its first use would defer it, from the second
#: backward on, past every op node created since (PyTorch gives AccumulateGrad the highest priority likewise).
#: Among leaves ready at once, the later-created runs first: the same order on every rank (DDP buckets).
ACC_SEQ_BASE = 1 << 62


class AccumulateGrad:
    """Sink for a leaf tensor's gradient: runs its hooks, accumulates into ``.grad``,
    then fires its "gradient ready" (post-accumulate) hooks."""

    __slots__ = ("tensor", "seq", "next", "__weakref__")
    op = "AccumulateGrad"
    freed = False

    def __init__(self, tensor):
        self.tensor = tensor
        self.seq = ACC_SEQ_BASE + next(_seq)
        self.next = ()

    def __repr__(self) -> str:
        return f"<AccumulateGrad of {tuple(self.tensor.shape)}>"


def _grad_target(t):
    if t is None or not getattr(t, "requires_grad", False):
        return None
    if t.grad_fn is not None:
        return t.grad_fn
    acc = t._acc
    if acc is None:
        acc = t._acc = AccumulateGrad(t)
    return acc
