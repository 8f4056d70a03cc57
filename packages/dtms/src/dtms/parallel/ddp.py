"""Distributed data parallel (docs/design.md, section 7).

Identical start weights (broadcast from rank 0); parameters grouped into buckets (25 MB by
default) in gradient-ready order; each parameter's "gradient ready" hook copies its gradient into
its bucket, and buckets are all-reduced (average) asynchronously and strictly in order as they
fill; no communication during accumulation micro-steps (``no_sync()``); averaged gradients are
scattered back once the last bucket has been launched. On GPUs the NCCL backend runs each
all-reduce on its own communication stream ordered by CUDA events, so the host never waits.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import blutensor as bt
from blutensor.nn import Module

from dtms import world
from dtms.parallel.comm_ops import TIMELINE
from dtms.parallel.verify import verify_params_across_ranks
from dtms.process_group import ProcessGroup


@dataclass
class Bucket:
    """A flat buffer holding the gradients of a run of parameters (in gradient-ready order)."""

    index: int
    params: list
    offsets: list[int]
    buffer: object  # NumPy/CuPy flat array
    pending: int = 0
    work: object = None
    launched: bool = False


@dataclass
class DDPStats:
    """Counts that tests and logs read: collectives launched and their order."""

    allreduces: int = 0
    launch_order: list[int] = field(default_factory=list)
    broadcasts: int = 0


class DistributedDataParallel(Module):
    """Wrap ``module`` so that ``backward()`` leaves gradients averaged over the process group."""

    def __init__(self, module: Module, process_group: ProcessGroup | None = None, bucket_cap_mb: float = 25.0,
                 broadcast_buffers: bool = True):
        super().__init__()
        self.module = module
        object.__setattr__(self, "pg", process_group or world.get_default_group())
        if not isinstance(self.pg, ProcessGroup):
            raise TypeError(f"DistributedDataParallel: process_group must be a dtms ProcessGroup, got "
                            f"{type(self.pg).__name__}")
        if not bucket_cap_mb > 0 or bucket_cap_mb == float("inf"):
            raise ValueError(f"DistributedDataParallel: bucket_cap_mb must be a positive finite number, "
                             f"got {bucket_cap_mb}")
        object.__setattr__(self, "bucket_cap", int(bucket_cap_mb * 1024 * 1024))
        object.__setattr__(self, "stats", DDPStats())
        object.__setattr__(self, "require_backward_grad_sync", True)
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("DistributedDataParallel: the module has no parameters that require grad")
        devs = {str(p.device) for p in params}
        if len(devs) != 1:
            raise ValueError(f"DistributedDataParallel: parameters live on several devices {sorted(devs)}")
        object.__setattr__(self, "_params", params)
        verify_params_across_ranks(self.pg, [(n, p) for n, p in module.named_parameters() if p.requires_grad],
                                   "DistributedDataParallel")  # before the first broadcast could hang
        self._broadcast_state(broadcast_buffers)
        # initial gradient-ready order: reverse registration order (backward visits the last layer first);
        # rebuilt once from the order actually observed in the first synchronised backward
        self._build_buckets(list(reversed(params)))
        object.__setattr__(self, "_observed", [])
        object.__setattr__(self, "_rebuilt", False)
        object.__setattr__(self, "_handles", [p.register_post_accumulate_grad_hook(self._grad_ready)
                                              for p in params])

    # ---- setup ----
    @bt.no_grad()
    def _broadcast_state(self, buffers: bool) -> None:
        tensors = list(self._params) + (list(self.module.buffers()) if buffers else [])
        for t in tensors:
            self.pg.broadcast(t._data, src=0)
            self.stats.broadcasts += 1

    def _build_buckets(self, order: list) -> None:
        buckets, cur, size = [], [], 0
        for p in order:
            nbytes = p.numel() * p.element_size()
            if cur and size + nbytes > self.bucket_cap:
                buckets.append(cur)
                cur, size = [], 0
            cur.append(p)
            size += nbytes
        if cur:
            buckets.append(cur)
        out, where = [], {}
        for i, ps in enumerate(buckets):
            offs, n = [], 0
            for p in ps:
                offs.append(n)
                where[id(p)] = (i, n)
                n += p.numel()
            xp = bt.ext.array_module_for(ps[0].device)
            buf = xp.zeros(n, dtype=ps[0]._data.dtype)
            out.append(Bucket(i, ps, offs, buf, pending=len(ps)))
        object.__setattr__(self, "buckets", out)
        object.__setattr__(self, "_where", where)
        object.__setattr__(self, "_next", 0)

    # ---- accumulation control ----
    @contextlib.contextmanager
    def no_sync(self):
        """Micro-steps inside accumulate gradients locally with no communication."""
        prev = self.require_backward_grad_sync
        object.__setattr__(self, "require_backward_grad_sync", False)
        try:
            yield
        finally:
            object.__setattr__(self, "require_backward_grad_sync", prev)

    def forward(self, *args, **kwargs):
        if self.require_backward_grad_sync:
            self._reset_buckets()
        return self.module(*args, **kwargs)

    def _reset_buckets(self) -> None:
        if 0 < self._next < len(self.buckets) or any(b.pending < len(b.params) for b in self.buckets
                                                       if not b.launched):
            missing = [f"{tuple(p.shape)}" for b in self.buckets if not b.launched for p in b.params
                       if p.grad is None]
            raise RuntimeError(
                "DistributedDataParallel: the previous synchronised backward did not produce gradients for every "
                f"parameter, so its buckets were never reduced (parameters without grad: {missing[:8]}); "
                "every parameter must take part in the loss")
        for b in self.buckets:
            b.pending, b.work, b.launched = len(b.params), None, False
        object.__setattr__(self, "_next", 0)
        self._observed.clear()

    # ---- the gradient-ready hook ----
    def _grad_ready(self, p) -> None:
        if not self.require_backward_grad_sync:
            return
        bi, off = self._where[id(p)]
        b = self.buckets[bi]
        if b.launched:
            return  # a parameter reached twice in one backward: already reduced
        b.buffer[off:off + p.numel()] = p.grad._data.reshape(-1)
        TIMELINE.mark("ddp_grad_ready", bucket=bi)
        b.pending -= 1
        self._observed.append(p)
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            nb = self.buckets[self._next]
            nb.work = self.pg.all_reduce(nb.buffer, op="avg", async_op=True)
            TIMELINE.mark("ddp_bucket_post", bucket=nb.index)
            nb.launched = True
            self.stats.allreduces += 1
            self.stats.launch_order.append(nb.index)
            object.__setattr__(self, "_next", self._next + 1)
        if self._next == len(self.buckets):
            self._finalize()

    # ---- finalize: wait for the buckets, scatter the averages back ----
    def _finalize(self) -> None:
        for b in self.buckets:
            b.work.wait()
            TIMELINE.mark("ddp_bucket_wait", bucket=b.index)
            for p, off in zip(b.params, b.offsets):
                p.grad._data[...] = b.buffer[off:off + p.numel()].reshape(p.shape)
        if not self._rebuilt:
            object.__setattr__(self, "_rebuilt", True)
            order = list(self._observed)
            if [id(p) for p in order] != [id(p) for b in self.buckets for p in b.params]:
                self._build_buckets(order)
        object.__setattr__(self, "_next", len(self.buckets))

    # ---- passthrough ----
    def state_dict(self, prefix: str = ""):
        return self.module.state_dict(prefix)

    def load_state_dict(self, state, strict: bool = True):
        return self.module.load_state_dict(state, strict)


DDP = DistributedDataParallel
