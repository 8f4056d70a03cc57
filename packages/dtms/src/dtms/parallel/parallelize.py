"""``parallelize``: apply DP / FSDP / TP / CP to a model from outside it, on a ``ParallelDims`` mesh."""

from __future__ import annotations

from dataclasses import dataclass

import blutensor as bt
from blutensor.nn import Module

from dtms import world
from dtms.parallel.context_parallel import ContextParallel, apply_context_parallel, shard_sequence
from dtms.parallel.ddp import DDP
from dtms.parallel.fsdp import FSDP
from dtms.parallel.mesh import Mesh, MeshError, ParallelDims
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
        import numpy as np

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
        xp = bt.backend.xp_of(grads[0].device)
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

    def close(self) -> None:
        for h in (self.tp, self.cp):
            if h is not None:
                h.close()


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


def parallelize(model: Module, dims: ParallelDims, *, group: ProcessGroup | None = None, fsdp: bool = False,
                async_tp_chunks: int = 1, cp_rotator: str = "p2p", bucket_cap_mb: float = 25.0,
                tp_plan: dict | None = None, seq_len: int | None = None) -> Parallelized:
    """Shard ``model`` over ``dims``; invalid meshes are rejected before any communication."""
    base = group or world.get_default_group()
    cfg = getattr(model, "config", None)
    checks = {}
    if cfg is not None:
        checks = dict(n_head=cfg.n_head, d_model=cfg.d_model,
                      vocab_size=getattr(cfg, "padded_vocab_size", None) if dims.tp > 1 else None)
    if seq_len is not None:
        checks["seq_len"] = seq_len
    if fsdp and (dims.tp > 1 or dims.cp > 1):
        raise MeshError("FSDP composes with data parallelism only here (tp=cp=1)")
    dims.validate(base.size(), **checks)  # before any collective
    mesh = Mesh(dims, base, **checks)
    verify_params_across_ranks(base, list(model.named_parameters()), "parallelize")
    with bt.no_grad():  # identical full weights before sharding
        for p in model.parameters():
            base.broadcast(p._data, src=0)
    tp = apply_tensor_parallel(model, mesh.tp, tp_plan, async_tp_chunks) if dims.tp > 1 else None
    cp = None
    if dims.cp > 1:
        pos_w = getattr(getattr(model, "wpe", None), "weight", None)
        cp = apply_context_parallel(mesh.cp, cp_rotator, pos_w)
    if fsdp:
        wrapped = FSDP(model, mesh.dp)
    elif mesh.dp_cp.size() > 1:
        wrapped = DDP(model, process_group=mesh.dp_cp, bucket_cap_mb=bucket_cap_mb)
    else:
        wrapped = model
    return Parallelized(wrapped, mesh, tp, cp, fsdp)
