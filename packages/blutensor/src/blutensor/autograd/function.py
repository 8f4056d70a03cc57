"""``Function``: user-defined differentiable ops with Tensor-level forward/backward (PyTorch's API).

Distributed strategies use it for ops whose forward or backward communicates (tensor-parallel
all-reduces, FSDP gathers, ring attention), where the op table's array-level kernels do not fit.
"""

from __future__ import annotations

from blutensor.autograd.grad_mode import STATE, no_grad
from blutensor.autograd.node import Ctx, Node
from blutensor.errors import AutogradError


class FunctionCtx(Ctx):
    """What ``forward`` saves for ``backward``: ``save_for_backward`` and free attributes."""

    def save_for_backward(self, *tensors) -> None:
        self.saved = tensors

    @property
    def saved_tensors(self):
        return self.saved

    @property
    def needs_input_grad(self):
        return self.needs


class _FunctionKernel:
    """Adapts a Function's Tensor-level backward to the engine's array-level interface."""

    __slots__ = ("fn", "devices")

    def __init__(self, fn, devices):
        self.fn, self.devices = fn, devices

    @property
    def GRAD_INTO(self) -> bool:  # noqa: N802 - the kernel flag, declared by the Function subclass
        return bool(getattr(self.fn, "GRAD_INTO", False))

    @property
    def GRAD_SUM(self) -> bool:  # noqa: N802
        return bool(getattr(self.fn, "GRAD_SUM", False))

    def backward(self, ctx, g):
        from blutensor._tensor import Tensor

        gt = Tensor._from_data(g, None, self.devices[0])
        out = self.fn.backward(ctx, gt)
        if not isinstance(out, tuple):
            out = (out,)
        if len(out) != len(self.devices):
            raise AutogradError(f"{self.fn.__name__}.backward returned {len(out)} gradients for "
                                f"{len(self.devices)} inputs")
        return tuple(o._data if isinstance(o, Tensor) else o for o in out)


class Function:
    """Subclass with static ``forward(ctx, *args) -> Tensor`` and ``backward(ctx, grad) -> grads``
    (one per forward argument, None where there is none); call with ``MyFn.apply(*args)``.

    A subclass that sets ``GRAD_INTO = True`` may find ``ctx.grad_into`` set in backward (see
    blutensor.autograd.engine): per input, a leaf's float32 gradient buffer to add that input's gradient into,
    returning ``blutensor.autograd.ACCUMULATED`` for it instead of a gradient. With ``GRAD_SUM = True``,
    ``ctx.grad_pending[i]`` may hold the gradient already pending for input ``i``; a backward that adds it into its
    own result returns ``blutensor.autograd.Summed(result)`` for that input."""

    GRAD_INTO = False
    GRAD_SUM = False

    @staticmethod
    def forward(ctx, *args):
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError

    @classmethod
    def apply(cls, *args):
        from blutensor._tensor import Tensor

        record = STATE.enabled and any(isinstance(a, Tensor) and a.requires_grad for a in args)
        ctx = FunctionCtx()
        ctx.needs = tuple(isinstance(a, Tensor) and a.requires_grad for a in args)
        with no_grad():
            out = cls.forward(ctx, *args)
        if not isinstance(out, Tensor):
            raise AutogradError(f"{cls.__name__}.forward must return one Tensor, got {type(out).__name__}")
        if any(out is a for a in args):
            out = out.detach()
        if record:
            devs = [a.device if isinstance(a, Tensor) else out.device for a in args]
            out.grad_fn = Node(cls.__name__, _FunctionKernel(cls, devs), ctx, args, [])
            out.requires_grad = True
        return out
