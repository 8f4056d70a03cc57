"""FSDP (ZeRO-3): parameters, gradients and optimizer state sharded over the data-parallel group.

Each unit (a transformer block by default) keeps only its 1/W shard of a flat parameter buffer.
Its forward all-gathers the full parameters just before use, runs without recording a graph and
frees them; its backward all-gathers again, recomputes the unit's forward with the graph, back-
propagates, reduce-scatters (averages) the flat gradient into the shard and frees everything. The
next unit's gather is issued asynchronously (prefetch) while the current one computes. Parameters
outside the units (embeddings, final LayerNorm, a tied LM head) are sharded too, one flat shard per top-level
module: a dispatch observer sees each op that uses one of them, gathers that module's shard for the op
only, and in backward gathers it again, recomputes the op with the graph and reduce-scatters its gradients
at once, so no full root parameter or gradient lives through the step.
"""

from __future__ import annotations

import fnmatch
import math

import blutensor as bt
from blutensor import Tensor, ext
from blutensor.autograd import Function
from blutensor.nn import Module, Parameter

from dtms import world
from dtms.parallel.comm_ops import STATS, TIMELINE
from dtms.parallel.verify import verify_params_across_ranks
from dtms.process_group import ProcessGroup


class FlatShard:
    """A list of parameters flattened into one buffer of which this rank owns 1/W (padded)."""

    def __init__(self, params: list, group: ProcessGroup, replicate: ProcessGroup | None = None):
        self.params, self.group = params, group
        self.replicate = replicate if replicate is not None and replicate.size() > 1 else None
        self.shapes = [tuple(p.shape) for p in params]
        self.numels = [p.numel() for p in params]
        total = sum(self.numels)
        W = group.size()
        self.shard_size = max(1, math.ceil(total / W))
        self.padded = self.shard_size * W
        p0 = params[0]
        self.xp = bt.ext.array_module_for(p0.device)
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

    def local_segments(self):
        """(lo, hi, param) ranges of this rank's shard that hold each parameter's elements."""
        r = self.group.rank()
        a, b = r * self.shard_size, (r + 1) * self.shard_size
        off = 0
        for p, n in zip(self.params, self.numels):
            lo, hi = max(off, a), min(off + n, b)
            yield max(lo - a, 0), max(hi - a, 0), p
            off += n

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
        """Drop the full parameters (only the shard stays). Each keeps its shape as a read-only view of one
        element (no storage of its size), so shape checks before an op still see the parameter's shape."""
        one = self.xp.zeros(1, dtype=self.shard._data.dtype)
        for p, s in zip(self.params, self.shapes):
            p._data = self.xp.broadcast_to(one, s)
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
        if self.replicate is not None:  # hybrid sharding: the replicas' shards averaged (equal-sized groups)
            self.replicate.all_reduce(out, op="avg")
            STATS.add("fsdp_replicate_all_reduce")
        if self.shard.grad is None:
            self.shard.grad = Tensor._from_data(out, self.shard.dtype, self.shard.device)
        else:
            self.shard.grad._data += out


class Flats:
    """The flat shards of one unit (one per parameter kind, e.g. decayed / not decayed), used together."""

    def __init__(self, params: list, group: ProcessGroup, key=None, replicate: ProcessGroup | None = None):
        kinds: dict = {}
        for p in params:
            kinds.setdefault(key(p) if key is not None else None, []).append(p)
        self.keys = list(kinds)
        self.parts = [FlatShard(ps, group, replicate) for ps in kinds.values()]
        for k, f in zip(self.keys, self.parts):
            f.shard.fsdp_key = k  # which parameter kind this shard holds (FSDP.param_groups)
        self.params = [p for f in self.parts for p in f.params]
        self.group = group
        self.label = ""  # "unit<i>" or "root_<module>" (TIMELINE events)

    def gather_async(self) -> None:
        if any(f._prefetch is None for f in self.parts):
            TIMELINE.mark("fsdp_gather_post", unit=self.label)
        for f in self.parts:
            f.gather_async()

    def gather(self) -> None:
        self.gather_async()
        for f in self.parts:
            f.gather()
        TIMELINE.mark("fsdp_gather_wait", unit=self.label)

    def release(self) -> None:
        for f in self.parts:
            f.release()

    def reduce_grads(self) -> None:
        for f in self.parts:
            f.reduce_grads()

    @property
    def shards(self) -> list:
        return [f.shard for f in self.parts]


class _UnitFn(Function):
    @staticmethod
    def forward(ctx, x: Tensor, shard: Tensor, unit: FSDPUnit, rest: tuple = ()):
        # rest: the unit's other inputs (e.g. rotary tables), passed through as they are; no gradient reaches them
        ctx.unit, ctx.x, ctx.rng, ctx.amp = unit, x.detach(), bt.get_rng_state(), bt.amp.state()
        ctx.rest = tuple(r.detach() if isinstance(r, Tensor) else r for r in rest)
        unit.flat.gather()
        if unit.next is not None:
            unit.next.flat.gather_async()  # prefetch: overlaps this unit's compute
        try:
            TIMELINE.mark("fsdp_compute_begin", unit=unit.flat.label, phase="fwd")
            y = unit.module(ctx.x, *ctx.rest)
            TIMELINE.mark("fsdp_compute_end", unit=unit.flat.label, phase="fwd")
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
            TIMELINE.mark("fsdp_compute_begin", unit=unit.flat.label, phase="bwd")
            with bt.enable_grad():
                with bt.amp.restore(ctx.amp):  # the recompute in the forward's precision (bf16 autocast)
                    xi = ctx.x.detach().requires_grad_(True)
                    y = unit.module(xi, *ctx.rest)
                y.backward(g)
            TIMELINE.mark("fsdp_compute_end", unit=unit.flat.label, phase="bwd")
            unit.flat.reduce_grads()
        finally:
            bt.set_rng_state(now)
            unit.flat.release()
        return xi.grad, None, None, None


class _RootOpFn(Function):
    """One op on a root parameter: forward with the module's shard gathered (no graph kept); backward gathers
    again, recomputes the op with the graph, back-propagates, reduce-scatters the gradients into the shard."""

    @staticmethod
    def forward(ctx, shard, fsdp, flat, op, attrs, slots, inputs, run, *args):
        ctx.fsdp, ctx.flat, ctx.op, ctx.attrs, ctx.slots = fsdp, flat, op, attrs, slots
        ctx.inputs = tuple(x.detach() if isinstance(x, Tensor) and not sl else x for x, sl in zip(inputs, slots))
        ctx.params = tuple(x if sl else None for x, sl in zip(inputs, slots))
        return fsdp._gathered(flat, run)

    @staticmethod
    def backward(ctx, g):
        from blutensor.ext import apply

        n_fixed = 8
        needs = ctx.needs[n_fixed:]
        grads = [None] * len(ctx.inputs)

        def recompute():
            with bt.enable_grad():
                xs = [x.detach().requires_grad_(True) if nd else x for x, nd in zip(ctx.inputs, needs)]
                full = [p if p is not None else x for p, x in zip(ctx.params, xs)]
                y = apply(ctx.op, *full, **ctx.attrs)
                y.backward(g)
            for i, (x, nd) in enumerate(zip(xs, needs)):
                if nd:
                    grads[i] = x.grad
            ctx.flat.reduce_grads()  # this use's gradients, at once (a tied weight gets one per use)

        ctx.fsdp._gathered(ctx.flat, recompute)
        return (None,) * n_fixed + tuple(grads)


class FSDPUnit(Module):
    """A wrapped submodule whose parameters exist only as 1/W flat shards between uses."""

    def __init__(self, module: Module, group: ProcessGroup, key=None, replicate: ProcessGroup | None = None):
        super().__init__()
        object.__setattr__(self, "module", module)  # not registered: its full params are transient
        object.__setattr__(self, "flat", Flats(list(module.parameters()), group, key, replicate))
        object.__setattr__(self, "next", None)
        object.__setattr__(self, "prev", None)
        for i, sh in enumerate(self.flat.shards):
            self.register_parameter("flat_shard" if i == 0 else f"flat_shard{i}", sh)

    @property
    def flat_shard(self) -> Parameter:
        return self.flat.shards[0]

    def forward(self, x, *rest):
        if not bt.is_grad_enabled():
            self.flat.gather()
            try:
                return self.module(x, *rest)
            finally:
                self.flat.release()
        return _UnitFn.apply(x, self.flat_shard, self, rest)


class FullyShardedDataParallel(Module):
    """Shard ``model`` (units: submodules matching ``unit_pattern``) over ``process_group``.

    ``param_key``: a function of a parameter; parameters of different keys go to different flat shards of
    a unit (e.g. ``lambda p: p.ndim >= 2`` keeps weight-decayed and undecayed parameters apart, so AdamW
    param groups stay exact: :meth:`param_groups`). ``tp_sharded``: ids of parameters that tensor
    parallelism split over ``tp_group`` (their squares are summed over it in :meth:`clip_grad_norm_`).
    ``replicate_group`` (hybrid sharding, HSDP): ranks holding the same shards in other replicas; each
    reduce-scattered gradient shard is then averaged over it (PyTorch's ``HYBRID_SHARD``).
    """

    def __init__(self, model: Module, process_group: ProcessGroup | None = None,
                 unit_pattern: str = "blocks.*", param_key=None, tp_group: ProcessGroup | None = None,
                 tp_sharded: set[int] | None = None, replicate_group: ProcessGroup | None = None):
        super().__init__()
        group = process_group or world.get_default_group()
        if not isinstance(group, ProcessGroup):
            raise TypeError(f"FullyShardedDataParallel: process_group must be a dtms ProcessGroup, got "
                            f"{type(group).__name__}")
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "tp_group", tp_group)
        object.__setattr__(self, "tp_sharded", set(tp_sharded or ()))
        verify_params_across_ranks(group, list(model.named_parameters()), "FullyShardedDataParallel")
        names = {id(p): n for n, p in model.named_parameters()}
        object.__setattr__(self, "param_names", names)
        # identical start: rank 0's weights everywhere
        with bt.no_grad():
            for p in model.parameters():
                group.broadcast(p._data, src=0)
        units = []
        for name, mod in list(model.named_modules()):
            if name and fnmatch.fnmatchcase(name, unit_pattern) and name.count(".") == unit_pattern.count("."):
                parent, leaf = _parent(model, name)
                u = FSDPUnit(mod, group, param_key, replicate_group)
                setattr(parent, leaf, u)
                units.append(u)
        for a, b in zip(units, units[1:]):
            object.__setattr__(a, "next", b)
            object.__setattr__(b, "prev", a)
        object.__setattr__(self, "units", units)
        unit_ids = {id(s) for u in units for s in u.flat.shards}
        by_module: dict[str, list] = {}
        for name, p in model.named_parameters():  # tied parameters appear once, under their first module
            if id(p) not in unit_ids:
                by_module.setdefault(name.split(".")[0], []).append(p)
        roots = [Flats(ps, group, param_key, replicate_group) for ps in by_module.values()]
        for name, f in zip(by_module, roots):
            f.label = f"root_{name}"
        for i, u in enumerate(units):
            u.flat.label = f"unit{i}"
        object.__setattr__(self, "roots", roots)
        object.__setattr__(self, "_root_of", {id(p): f for f in roots for p in f.params})
        for i, u in enumerate(units):
            for j, sh in enumerate(u.flat.shards):
                self.register_parameter(f"unit{i}_shard" + (f"{j}" if j else ""), sh)
        for name, f in zip(by_module, roots):
            for j, sh in enumerate(f.shards):
                self.register_parameter(f"root_{name}_shard" + (f"{j}" if j else ""), sh)
        object.__setattr__(self, "_busy", False)
        if roots:
            # first in the chain: TP/CP observers that read a root weight directly then see it gathered
            ext.add_op_observer(first=True, fn=self._root_op)

    def flats(self) -> list[FlatShard]:
        """Every flat shard (root modules first, then the units in order)."""
        groups = list(self.roots) + [u.flat for u in self.units]
        return [f for g in groups for f in g.parts]

    def _root_op(self, op, inputs, attrs, run):
        """Dispatch observer: an op reading a root parameter runs with that module's shard gathered."""
        if self._busy:
            return run()
        flat = next((self._root_of[id(x)] for x in inputs if isinstance(x, Tensor) and id(x) in self._root_of),
                    None)
        if flat is None:
            return run()
        if not bt.is_grad_enabled():
            return self._gathered(flat, run)
        slots = tuple(isinstance(x, Tensor) and id(x) in self._root_of for x in inputs)
        args = tuple(None if sl else x for x, sl in zip(inputs, slots))
        return _RootOpFn.apply(flat.shards[0], self, flat, op, attrs, slots, inputs, run, *args)

    def _gathered(self, flat, fn):
        flat.gather()
        object.__setattr__(self, "_busy", True)
        try:
            return fn()
        finally:
            object.__setattr__(self, "_busy", False)
            flat.release()

    def close(self) -> None:
        """Remove the root-parameter observer (the model is no longer used through this wrapper)."""
        if self._root_op in list(ext.op_observers()):
            ext.remove_op_observer(self._root_op)

    def param_groups(self, weight_decay: float, decay_key=True) -> list[dict]:
        """AdamW groups over the shards: ``weight_decay`` on those whose ``param_key`` is ``decay_key``."""
        shards = [f.shard for f in self.flats()]
        return [{"params": [s for s in shards if s.fsdp_key == decay_key], "weight_decay": weight_decay},
                {"params": [s for s in shards if s.fsdp_key != decay_key], "weight_decay": 0.0}]

    def forward(self, *args, **kwargs):
        if self.units:
            self.units[0].flat.gather_async()
        return self.model(*args, **kwargs)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the global norm of the unsharded model: squares of the local shards summed over the group
        (and, for tensor-parallel parameters, over the TP group as well); returns that norm."""
        xp = None
        part = [0.0, 0.0]  # [tp-sharded, replicated across tp]
        for f in self.flats():
            if f.shard.grad is None:
                continue
            g = f.shard.grad._data
            xp = bt.ext.array_module(g)
            for lo, hi, p in f.local_segments():
                if hi > lo:
                    part[0 if id(p) in self.tp_sharded else 1] += float((g[lo:hi].astype(xp.float64) ** 2).sum())
        if xp is None:
            return 0.0
        buf = xp.asarray(part, dtype=xp.float64)
        self.group.all_reduce(buf, op="sum")
        if self.tp_group is not None and self.tp_group.size() > 1:
            sh = buf[:1].copy()
            self.tp_group.all_reduce(sh, op="sum")
            buf[0] = sh[0]
        norm = float(buf.sum()) ** 0.5
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for f in self.flats():
                if f.shard.grad is not None:
                    f.shard.grad._data *= f.shard.grad._data.dtype.type(coef)
        return norm

    def state_bytes(self) -> int:
        """Bytes of this rank's parameter shards (optimizer moments add 2x this for AdamW)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def full_parameters(self) -> dict:
        """Gathered full parameters by name (checkpoints, tests); a collective on every rank."""
        out = {}
        for f in self.flats():
            f.gather()
            for p in f.params:
                out[self.param_names[id(p)]] = p._data.copy()
            f.release()
        return out

    def gather_shard_state(self, arrays: dict[int, object]) -> dict[str, object]:
        """Full per-parameter arrays (by name) from per-shard flat arrays keyed by ``id(shard)`` (e.g. an
        AdamW moment); a collective on every rank."""
        out = {}
        for f in self.flats():
            a = arrays[id(f.shard)]
            full = f.xp.empty(f.padded, dtype=a.dtype)
            f.group.all_gather(full, f.xp.ascontiguousarray(a))
            off = 0
            for p, n, s in zip(f.params, f.numels, f.shapes):
                out[self.param_names[id(p)]] = full[off:off + n].reshape(s).copy()
                off += n
        return out

    def shard_full_state(self, full: dict[str, object]) -> dict[int, object]:
        """This rank's flat shard of every unit from full per-parameter arrays by name (no communication)."""
        out = {}
        for f in self.flats():
            flat = f.xp.zeros(f.padded, dtype=f.shard._data.dtype)
            off = 0
            for p, n in zip(f.params, f.numels):
                flat[off:off + n] = f.xp.asarray(full[self.param_names[id(p)]]).reshape(-1)
                off += n
            r = f.group.rank()
            out[id(f.shard)] = flat[r * f.shard_size:(r + 1) * f.shard_size].copy()
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
