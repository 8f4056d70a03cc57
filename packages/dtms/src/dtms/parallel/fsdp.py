"""FSDP (ZeRO-3): parameters, gradients and optimizer state sharded over the data-parallel group.

Each unit (a transformer block by default) keeps only its 1/W shard of a flat parameter buffer.
Its forward all-gathers the full parameters just before use, runs without recording a graph and
frees them; its backward all-gathers again, recomputes the unit's forward with the graph, back-
propagates, reduce-scatters (averages) the flat gradient into the shard and frees everything. The
next unit's gather is issued asynchronously (prefetch) while the current one computes. Parameters
outside the units (embeddings, final LayerNorm) form a root shard gathered for the whole step.
"""

from __future__ import annotations

import fnmatch
import math

import blutensor as bt
from blutensor import Tensor
from blutensor.autograd import Function
from blutensor.nn import Module, Parameter

from dtms import world
from dtms.parallel.comm_ops import STATS
from dtms.parallel.verify import verify_params_across_ranks
from dtms.process_group import ProcessGroup


class FlatShard:
    """A list of parameters flattened into one buffer of which this rank owns 1/W (padded)."""

    def __init__(self, params: list, group: ProcessGroup):
        self.params, self.group = params, group
        self.shapes = [tuple(p.shape) for p in params]
        self.numels = [p.numel() for p in params]
        total = sum(self.numels)
        W = group.size()
        self.shard_size = max(1, math.ceil(total / W))
        self.padded = self.shard_size * W
        p0 = params[0]
        self.xp = bt.backend.xp_of(p0.device)
        flat = self.xp.zeros(self.padded, dtype=p0._data.dtype)
        off = 0
        for p, n in zip(params, self.numels):
            flat[off:off + n] = p._data.reshape(-1)
            off += n
        r = group.rank()
        self.shard = Parameter(Tensor._from_data(flat[r * self.shard_size:(r + 1) * self.shard_size].copy(),
                                                 p0.dtype, p0.device))
        self._prefetch = None
        self.release()

    def gather_async(self) -> None:
        if self._prefetch is None:
            full = self.xp.empty(self.padded, dtype=self.shard._data.dtype)
            work = self.group.all_gather(full, self.shard._data, async_op=True)
            STATS.add("fsdp_all_gather")
            self._prefetch = (full, work)

    def gather(self):
        """Full flat parameters (waiting for a prefetch when one is in flight) bound into the params."""
        self.gather_async()
        full, work = self._prefetch
        self._prefetch = None
        work.wait()
        off = 0
        for p, n, s in zip(self.params, self.numels, self.shapes):
            p._data = full[off:off + n].reshape(s)
            off += n
        return full

    def release(self) -> None:
        """Drop the full parameters (only the shard stays)."""
        empty = self.xp.empty(0, dtype=self.shard._data.dtype)
        for p in self.params:
            p._data = empty
            p.grad = None

    def reduce_grads(self) -> None:
        """Flatten the full gradients, reduce-scatter (average) them into ``shard.grad``."""
        flat = self.xp.zeros(self.padded, dtype=self.shard._data.dtype)
        off = 0
        for p, n in zip(self.params, self.numels):
            if p.grad is not None:
                flat[off:off + n] = p.grad._data.reshape(-1)
            off += n
        out = self.xp.empty(self.shard_size, dtype=flat.dtype)
        self.group.reduce_scatter(out, flat, op="avg")
        STATS.add("fsdp_reduce_scatter")
        if self.shard.grad is None:
            self.shard.grad = Tensor._from_data(out, self.shard.dtype, self.shard.device)
        else:
            self.shard.grad._data += out


class _UnitFn(Function):
    @staticmethod
    def forward(ctx, x: Tensor, shard: Tensor, unit: FSDPUnit):
        ctx.unit, ctx.x, ctx.rng = unit, x.detach(), bt.get_rng_state()
        unit.flat.gather()
        if unit.next is not None:
            unit.next.flat.gather_async()  # prefetch: overlaps this unit's compute
        try:
            y = unit.module(ctx.x)
        finally:
            unit.flat.release()
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        unit = ctx.unit
        unit.flat.gather()
        if unit.prev is not None:
            unit.prev.flat.gather_async()  # backward runs units in reverse: prefetch the previous one
        now = bt.get_rng_state()
        bt.set_rng_state(ctx.rng)  # dropout masks replay exactly
        try:
            with bt.enable_grad():
                xi = ctx.x.detach().requires_grad_(True)
                y = unit.module(xi)
                y.backward(g)
            unit.flat.reduce_grads()
        finally:
            bt.set_rng_state(now)
            unit.flat.release()
        return xi.grad, None, None


class FSDPUnit(Module):
    """A wrapped submodule whose parameters exist only as a 1/W flat shard between uses."""

    def __init__(self, module: Module, group: ProcessGroup):
        super().__init__()
        object.__setattr__(self, "module", module)  # not registered: its full params are transient
        object.__setattr__(self, "flat", FlatShard(list(module.parameters()), group))
        object.__setattr__(self, "next", None)
        object.__setattr__(self, "prev", None)
        self.flat_shard = self.flat.shard

    def forward(self, x):
        if not bt.is_grad_enabled():
            self.flat.gather()
            try:
                return self.module(x)
            finally:
                self.flat.release()
        return _UnitFn.apply(x, self.flat_shard, self)


class FullyShardedDataParallel(Module):
    """Shard ``model`` (units: submodules matching ``unit_pattern``) over ``process_group``."""

    def __init__(self, model: Module, process_group: ProcessGroup | None = None,
                 unit_pattern: str = "blocks.*"):
        super().__init__()
        group = process_group or world.get_default_group()
        if not isinstance(group, ProcessGroup):
            raise TypeError(f"FullyShardedDataParallel: process_group must be a dtms ProcessGroup, got "
                            f"{type(group).__name__}")
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "model", model)
        verify_params_across_ranks(group, list(model.named_parameters()), "FullyShardedDataParallel")
        # identical start: rank 0's weights everywhere
        with bt.no_grad():
            for p in model.parameters():
                group.broadcast(p._data, src=0)
        units = []
        for name, mod in list(model.named_modules()):
            if name and fnmatch.fnmatchcase(name, unit_pattern) and name.count(".") == unit_pattern.count("."):
                parent, leaf = _parent(model, name)
                u = FSDPUnit(mod, group)
                setattr(parent, leaf, u)
                units.append(u)
        for a, b in zip(units, units[1:]):
            object.__setattr__(a, "next", b)
            object.__setattr__(b, "prev", a)
        object.__setattr__(self, "units", units)
        unit_ids = {id(u.flat_shard) for u in units}
        root = [p for p in model.parameters() if id(p) not in unit_ids]
        object.__setattr__(self, "root", FlatShard(root, group) if root else None)
        for i, u in enumerate(units):
            self.register_parameter(f"unit{i}_shard", u.flat_shard)
        if self.root is not None:
            self.register_parameter("root_shard", self.root.shard)
            object.__setattr__(self, "_pending", 0)
            for p in root:
                p.register_post_accumulate_grad_hook(self._root_grad_ready)

    def _root_grad_ready(self, p) -> None:
        object.__setattr__(self, "_pending", self._pending - 1)
        if self._pending == 0:
            self.root.reduce_grads()
            self.root.release()

    def forward(self, *args, **kwargs):
        if self.root is not None:
            self.root.gather()
            object.__setattr__(self, "_pending", len(self.root.params))
        if self.units:
            self.units[0].flat.gather_async()
        out = self.model(*args, **kwargs)
        if self.root is not None and not bt.is_grad_enabled():
            self.root.release()
        return out

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the global norm over all shards (an all-reduce of the squared local norms)."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        xp = bt.backend.xp_of(grads[0].device)
        sq = xp.asarray([float((g._data.astype(xp.float64) ** 2).sum()) for g in grads]).sum()
        buf = xp.asarray([sq], dtype=xp.float64)
        self.group.all_reduce(buf, op="sum")
        norm = float(buf[0]) ** 0.5
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g._data *= g._data.dtype.type(coef)
        return norm

    def state_bytes(self) -> int:
        """Bytes of this rank's parameter shards (optimizer moments add 2x this for AdamW)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def full_parameters(self) -> dict:
        """Gathered full parameters by name (checkpoints, tests); a collective on every rank."""
        out = {}
        names = {id(p): n for n, p in _named_leaf_params(self.model)}
        for flat in ([self.root] if self.root else []) + [u.flat for u in self.units]:
            flat.gather()
            for p in flat.params:
                out[names.get(id(p), str(id(p)))] = p._data.copy()
            flat.release()
        return out


def _named_leaf_params(model: Module):
    for mname, m in model.named_modules():
        for pn, p in m._parameters.items():
            if p is not None:
                yield (f"{mname}.{pn}" if mname else pn), p
        if isinstance(m, FSDPUnit):
            for n, p in m.module.named_parameters():
                yield f"{mname}.{n}", p


def _parent(model: Module, name: str):
    parts = name.split(".")
    m = model
    for p in parts[:-1]:
        m = getattr(m, p)
    return m, parts[-1]


FSDP = FullyShardedDataParallel
