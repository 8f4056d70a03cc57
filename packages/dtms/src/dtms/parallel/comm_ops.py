"""Differentiable communication ops (blutensor ``autograd.Function``s) used by TP, FSDP and CP."""

from __future__ import annotations

import contextlib
import time

from blutensor import Tensor
from blutensor.autograd import Function

from dtms.process_group import ProcessGroup


def _copy(t: Tensor):
    return t._data.copy() if hasattr(t._data, "copy") else t._data


def _wrap(arr, like: Tensor) -> Tensor:
    return Tensor._from_data(arr, like.dtype, like.device)


def all_reduced(t: Tensor, group: ProcessGroup, op: str = "sum") -> Tensor:
    """A new tensor: ``t`` all-reduced over ``group``. bfloat16 is reduced in float32 and rounded once (MPI
    and NCCL would otherwise see raw 16-bit storage; one rounding keeps the sum of partials exact in fp32)."""
    import blutensor as bt

    if t.dtype is bt.bfloat16:
        with bt.no_grad():
            wide = t.detach().to(bt.float32)
            arr = wide._data.copy()
            group.all_reduce(arr, op=op)
            return Tensor._from_data(arr, bt.float32, t.device).to(bt.bfloat16)
    arr = _copy(t)
    group.all_reduce(arr, op=op)
    return _wrap(arr, t)


class CommStats:
    """Counts collectives issued by the ops below (tests read them)."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n


STATS = CommStats()


class Timeline:
    """When collectives are posted / waited for and when the compute they should hide behind runs.

    Off by default (one attribute test per event); ``with TIMELINE.recording(): ...`` collects
    ``(time, event, info)`` tuples in ``events``, e.g. ``("cp_post", {"step": 1})``. Used to check and to
    profile overlap: a collective posted only after the compute it should overlap ends is not overlapped.
    Events: ``cp_post``/``cp_wait``/``cp_compute_begin``/``cp_compute_end`` (ring attention, ``phase``
    fwd/bwd), ``fsdp_gather_post``/``fsdp_gather_wait``/``fsdp_compute_begin``/``fsdp_compute_end`` (units),
    ``tp_comm_post``/``tp_comm_wait``/``tp_gemm_begin``/``tp_gemm_end`` (async TP chunks).
    """

    def __init__(self) -> None:
        self.enabled = False
        self.events: list[tuple[float, str, dict]] = []

    def mark(self, event: str, **info) -> None:
        if self.enabled:
            self.events.append((time.perf_counter(), event, info))

    @contextlib.contextmanager
    def recording(self):
        self.events, self.enabled = [], True
        try:
            yield self.events
        finally:
            self.enabled = False


TIMELINE = Timeline()


class CopyToGroup(Function):
    """Megatron's f: identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g: Tensor):
        out = all_reduced(g, ctx.group, "sum")
        STATS.add("tp_all_reduce_bwd")
        return out, None


class ReduceFromGroup(Function):
    """Megatron's g: all-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup):
        out = all_reduced(x, group, "sum")
        STATS.add("tp_all_reduce_fwd")
        return out

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
        return all_reduced(g, ctx.group, ctx.op), None, None
