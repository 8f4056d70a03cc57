"""Differentiable communication ops (blutensor ``autograd.Function``s) used by TP, FSDP and CP."""

from __future__ import annotations

from blutensor import Tensor
from blutensor.autograd import Function

from dtms.process_group import ProcessGroup


def _copy(t: Tensor):
    return t._data.copy() if hasattr(t._data, "copy") else t._data


def _wrap(arr, like: Tensor) -> Tensor:
    return Tensor._from_data(arr, like.dtype, like.device)


class CommStats:
    """Counts collectives issued by the ops below (tests read them)."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n


STATS = CommStats()


class CopyToGroup(Function):
    """Megatron's f: identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g: Tensor):
        arr = _copy(g)
        ctx.group.all_reduce(arr, op="sum")
        STATS.add("tp_all_reduce_bwd")
        return _wrap(arr, g), None


class ReduceFromGroup(Function):
    """Megatron's g: all-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup):
        arr = _copy(x)
        group.all_reduce(arr, op="sum")
        STATS.add("tp_all_reduce_fwd")
        return _wrap(arr, x)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g, None


class AllReduceGrad(Function):
    """Identity forward; average the gradient over ``group`` backward (replicated inputs)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup, op: str = "avg"):
        ctx.group, ctx.op = group, op
        return x

    @staticmethod
    def backward(ctx, g: Tensor):
        arr = _copy(g)
        ctx.group.all_reduce(arr, op=ctx.op)
        return _wrap(arr, g), None, None
