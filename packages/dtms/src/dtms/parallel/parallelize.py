"""``parallelize``: apply DP / FSDP / TP / CP to a model from outside it, on a ``ParallelDims`` mesh."""

from __future__ import annotations

from dataclasses import dataclass

import blutensor as bt
import numpy as np
from blutensor.nn import Module

from dtms import world
from dtms.parallel.context_parallel import ContextParallel, apply_context_parallel, shard_sequence
from dtms.parallel.ddp import DDP
from dtms.parallel.fsdp import FSDP
from dtms.parallel.mesh import Mesh, MeshError, ParallelDims
from dtms.parallel.plan import ParallelPlan
from dtms.parallel.tensor_parallel import TensorParallel, apply_tensor_parallel
from dtms.parallel.verify import verify_params_across_ranks
from dtms.process_group import ProcessGroup


@dataclass
class Parallelized:
    """The wrapped model and what a training loop needs from the mesh."""

    model: Module
    mesh: Mesh
    tp: TensorParallel | None = None
    cp: ContextParallel | None = None
    fsdp: bool = False
    base: Module | None = None  # the model before wrapping (its parameter names are the checkpoint's)
    tp_layout: dict | None = None  # parameter name -> (axis, chunks) for tensor-parallel-split parameters

    def shard_batch(self, x):
        """This rank's part of a (B_local, T) batch along the sequence (identity without CP)."""
        if self.mesh.dims.cp == 1:
            return x
        return shard_sequence(x, self.mesh.cp_i, self.mesh.dims.cp, dim=1)

    def local_batch(self, x):
        """This rank's part of a global (B, T) batch: rows of its data-parallel index, then its sequence shard."""
        B = x.shape[0]
        dp, i = self.mesh.dims.dp, self.mesh.dp_i
        if B % dp:
            raise ValueError(f"global batch {B} is not divisible by dp={dp}")
        b = B // dp
        return self.shard_batch(x[i * b:(i + 1) * b])

    def global_loss(self, loss: float) -> float:
        """Mean of a per-rank mean loss over the ranks that saw different tokens (dp x cp)."""

        buf = np.array([loss], dtype=np.float64)
        g = self.mesh.dp_cp
        if g.size() > 1:
            if bt.cuda.is_available() and hasattr(g, "comm"):
                import cupy

                d = cupy.asarray(buf)
                g.all_reduce(d, op="avg")
                return float(d[0])
            g.all_reduce(buf, op="avg")
        return float(buf[0])

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip every gradient by the global L2 norm of the whole (unsharded) model; returns that norm."""
        if self.fsdp:
            return self.model.clip_grad_norm_(max_norm)
        if self.mesh.dims.tp == 1:
            return float(bt.optim.clip_grad_norm_(self.model.parameters(), max_norm).item())
        # tensor parallel: a sharded gradient contributes its square sum from every TP rank, a replicated one
        # (LayerNorms, row-parallel biases, position embedding) once; after DDP all dp/cp ranks agree
        sharded = _sharded_param_ids(self.model, self.tp)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        xp = bt.ext.array_module_for(grads[0].device)
        part = xp.zeros(2, dtype=xp.float64)  # [sharded, replicated] square sums
        for p in self.model.parameters():
            if p.grad is not None:
                part[0 if id(p) in sharded else 1] += float((p.grad._data.astype(xp.float64) ** 2).sum())
        buf = xp.asarray(part[:1])
        self.mesh.tp.all_reduce(buf, op="sum")
        norm = float(buf[0] + part[1]) ** 0.5
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g._data *= g._data.dtype.type(coef)
        return norm

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups (decay on 2-D weights, none on biases/LayerNorms) over this rank's parameters."""
        if self.fsdp:
            return self.model.param_groups(weight_decay)
        ps = list(self.base.parameters())
        return [{"params": [p for p in ps if p.ndim >= 2], "weight_decay": weight_decay},
                {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}]

    # ---- checkpoints: the full (unsharded) state by the single-process parameter names
    def _local_named(self) -> dict:
        return dict(self.base.named_parameters()) if not self.fsdp else {}

    def full_state(self, optimizer) -> tuple[dict, dict, dict]:
        """(params, moments, steps): every parameter's full array and AdamW moments (``{"exp_avg": {name:
        array}, ...}``) and step count by name, gathered over the mesh; a collective on every rank."""
        moments: dict[str, dict] = {"exp_avg": {}, "exp_avg_sq": {}}
        steps: dict[str, int] = {}
        if self.fsdp:
            params = self.model.full_parameters()
            flats = self.model.flats()
            have = [f for f in flats if f.shard in optimizer.state]
            if have and len(have) != len(flats):
                raise RuntimeError("FSDP checkpoint: the optimizer holds state for some shards only")
            if have:
                for k in moments:
                    moments[k] = self.model.gather_shard_state({id(f.shard): optimizer.state[f.shard][k]._data
                                                                for f in flats})
                for f in flats:
                    for p in f.params:
                        steps[self.model.param_names[id(p)]] = int(optimizer.state[f.shard]["step"])
        else:
            named = self._local_named()
            params = {n: p._data for n, p in named.items()}
            for n, p in named.items():
                st = optimizer.state.get(p)
                if st is not None:
                    steps[n] = int(st["step"])
                    for k in moments:
                        moments[k][n] = st[k]._data
        if self.tp_layout:
            params = {n: self._tp_gather(n, a) for n, a in params.items()}
            moments = {k: {n: self._tp_gather(n, a) for n, a in d.items()} for k, d in moments.items()}
        return params, moments, steps

    def _tp_gather(self, name: str, a):
        lay = self.tp_layout.get(name)
        if lay is None:
            return a
        axis, chunks = lay
        g = self.mesh.tp
        xp = bt.ext.array_module(a)
        out = xp.empty((g.size(),) + tuple(a.shape), dtype=a.dtype)
        g.all_gather(out, xp.ascontiguousarray(a))
        if axis == 1:
            return xp.concatenate(list(out), axis=1)
        parts = [xp.split(o, chunks, axis=0) for o in out]  # rank -> its rows of each stacked part
        return xp.concatenate([parts[r][c] for c in range(chunks) for r in range(g.size())], axis=0)

    def _tp_shard(self, name: str, a):
        lay = self.tp_layout.get(name) if self.tp_layout else None
        if lay is None:
            return a
        axis, chunks = lay
        n, r = self.mesh.dims.tp, self.mesh.tp_i
        if axis == 1:
            return np.split(a, n, axis=1)[r]
        return np.concatenate([np.split(p, n, axis=0)[r] for p in np.split(a, chunks, axis=0)], axis=0)

    def check_full_state(self, params: dict) -> None:
        """ValueError naming the first parameter that is missing or of another full shape."""
        mine = self._full_shapes()
        missing = sorted(set(mine) - set(params))
        if missing:
            raise ValueError(f"checkpoint lacks parameter(s) {missing[:5]}")
        for n, shape in mine.items():
            if tuple(params[n].shape) != shape:
                raise ValueError(f"checkpoint tensor {n} has shape {tuple(params[n].shape)}, the model's full "
                                 f"parameter has {shape}")

    def _full_shapes(self) -> dict:
        if self.fsdp:
            shapes = {self.model.param_names[id(p)]: s for f in self.model.flats()
                      for p, s in zip(f.params, f.shapes)}
        else:
            shapes = {n: tuple(p.shape) for n, p in self._local_named().items()}
        out = {}
        for n, s in shapes.items():
            lay = self.tp_layout.get(n) if self.tp_layout else None
            if lay is not None:
                s = tuple(d * self.mesh.dims.tp if i == lay[0] else d for i, d in enumerate(s))
            out[n] = s
        return out

    def load_full_state(self, optimizer, params: dict, moments: dict | None = None,
                        steps: dict | None = None) -> None:
        """Reshard full host arrays by name (as :meth:`full_state` returns them, from any layout) into this
        rank's parameters and AdamW state; no communication."""
        self.check_full_state(params)
        local = {n: self._tp_shard(n, np.asarray(a)) for n, a in params.items()}
        mom = {k: {n: self._tp_shard(n, np.asarray(a)) for n, a in d.items()} for k, d in (moments or {}).items()}
        steps = steps or {}
        if optimizer is not None:
            optimizer.state = {}
        if self.fsdp:
            fs = self.model
            shards = fs.shard_full_state(local)
            for f in fs.flats():
                f.shard._data[...] = f.xp.asarray(shards[id(f.shard)])
            if optimizer is not None and steps:
                per = {k: fs.shard_full_state(d) for k, d in mom.items()}
                for f in fs.flats():
                    st = {"step": max(int(steps.get(fs.param_names[id(p)], 0)) for p in f.params)}
                    for k in per:
                        st[k] = bt.tensor(per[k][id(f.shard)], device=f.shard.device)
                    optimizer.state[f.shard] = st
            return
        named = self._local_named()
        xp = None
        for n, p in named.items():
            xp = bt.ext.array_module_for(p.device)
            p._data[...] = xp.asarray(local[n]).astype(p._data.dtype, copy=False)
            if optimizer is not None and n in steps:
                st = {"step": int(steps[n])}
                for k, d in mom.items():
                    st[k] = bt.tensor(d[n], device=p.device)
                optimizer.state[p] = st

    def close(self) -> None:
        """Remove the dispatch observers TP, CP and FSDP installed (the model is unusable afterwards)."""
        for h in (self.tp, self.cp):
            if h is not None:
                h.close()
        if self.fsdp:
            self.model.close()


def _sharded_param_ids(model: Module, tp: TensorParallel | None) -> set[int]:
    """Parameters that tensor parallelism split across the TP group (column/row linears, vocabulary)."""
    from dtms.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    ids = set()
    for m in model.modules():
        if isinstance(m, ColumnParallelLinear):
            ids.update(id(p) for p in (m.weight, m.bias) if p is not None)
        elif isinstance(m, RowParallelLinear):
            ids.add(id(m.weight))  # its bias is added after the all-reduce: replicated
    if tp is not None and tp.observer is not None:
        ids.add(id(tp.observer.weight))
    return ids


def _tp_layout(model: Module, tp: TensorParallel | None) -> dict:
    """Parameter name -> (split axis, stacked parts) of every tensor-parallel-split parameter."""
    from dtms.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    out = {}
    for mname, m in model.named_modules():
        pre = f"{mname}." if mname else ""
        if isinstance(m, ColumnParallelLinear):
            out[pre + "weight"] = (0, m.chunks)
            if m.bias is not None:
                out[pre + "bias"] = (0, m.chunks)
        elif isinstance(m, RowParallelLinear):
            out[pre + "weight"] = (1, 1)
    if tp is not None and tp.observer is not None:
        for n, p in model.named_parameters():
            if p is tp.observer.weight:
                out[n] = (0, 1)
    return out


def parallelize(model: Module, dims: ParallelDims, *, group: ProcessGroup | None = None, fsdp: bool = False,
                async_tp_chunks: int = 1, cp_rotator: str = "p2p", bucket_cap_mb: float = 25.0,
                plan: ParallelPlan | None = None, seq_len: int | None = None,
                param_key=None, dp_replicate: int = 1) -> Parallelized:
    """Shard ``model`` over ``dims`` in torchtitan's order: tensor parallel, context parallel, then FSDP
    (``fsdp=True``: parameters sharded over every rank that sees other tokens, dp x cp) or DDP.

    ``plan`` (the model package's :class:`ParallelPlan`) says which modules TP splits, which are FSDP
    units and which weight is the positional embedding; its ``shape_checks`` and ``seq_len`` are
    validated with the mesh before any communication. ``param_key`` (FSDP): parameters of different keys
    get different flat shards (``lambda p: p.ndim >= 2`` for AdamW's decay groups). ``dp_replicate``
    (FSDP): hybrid sharding (HSDP): the dp ranks form this many replicas, each sharding the parameters over
    its ``dp // dp_replicate`` ranks (x cp); gradient shards are reduce-scattered inside a replica, then
    averaged across replicas.
    """
    base = group or world.get_default_group()
    plan = (plan or ParallelPlan()).check()
    checks = dict(plan.shape_checks)
    if dims.tp == 1:
        checks.pop("vocab_size", None)
    if seq_len is not None:
        checks["seq_len"] = seq_len
    if dims.tp > 1 and not plan.tp:
        raise MeshError(f"tensor parallel (tp={dims.tp}) needs a plan naming the modules to split "
                        "(ParallelPlan.tp), e.g. blumodels.gpt2_parallelize.gpt2_plan(model)")
    if dims.cp > 1 and plan.position_weight is None and getattr(model, "wpe", None) is not None:
        raise MeshError("context parallel: the model has a positional embedding but the plan does not name it "
                        "(ParallelPlan.position_weight)")
    dims.validate(base.size(), **checks)  # before any collective
    if not isinstance(dp_replicate, int) or dp_replicate < 1 or dims.dp % dp_replicate:
        raise MeshError(f"hybrid sharding: dp_replicate={dp_replicate!r} must be a positive integer dividing "
                        f"dp={dims.dp}")
    if dp_replicate > 1 and not fsdp:
        raise MeshError(f"dp_replicate={dp_replicate} (hybrid sharding) needs fsdp=True")
    mesh = Mesh(dims, base, **checks)
    verify_params_across_ranks(base, list(model.named_parameters()), "parallelize")
    with bt.no_grad():  # identical full weights before sharding
        for p in model.parameters():
            base.broadcast(p._data, src=0)
    tp = apply_tensor_parallel(model, mesh.tp, plan.tp, async_tp_chunks) if dims.tp > 1 else None  # 1. TP
    layout = _tp_layout(model, tp) if tp is not None else {}
    cp = apply_context_parallel(mesh.cp, cp_rotator, plan.position_weight, plan.rotary) \
        if dims.cp > 1 else None  # 2. CP
    if fsdp:  # 3. FSDP over dp x cp (each rank of it sees other tokens), or DDP
        names = dict(model.named_parameters())
        sharded = {id(names[n]) for n in layout}
        shard_group, replicas = mesh.hsdp(dp_replicate) if dp_replicate > 1 else (mesh.dp_cp, None)
        wrapped = FSDP(model, shard_group, unit_pattern=plan.fsdp_units, param_key=param_key,
                       tp_group=mesh.tp if dims.tp > 1 else None, tp_sharded=sharded, replicate_group=replicas)
    elif mesh.dp_cp.size() > 1:
        wrapped = DDP(model, process_group=mesh.dp_cp, bucket_cap_mb=bucket_cap_mb)
    else:
        wrapped = model
    return Parallelized(wrapped, mesh, tp, cp, fsdp, model, layout)
