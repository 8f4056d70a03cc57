"""``ParallelDims``: the dp x cp x tp mesh, validated before any communication, and its groups.

Rank layout (tp innermost, so tensor-parallel peers are neighbours, e.g. on one NVLink island):
``rank = (dp_i * cp + cp_i) * tp + tp_i``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtms import world
from dtms.process_group import ProcessGroup


class MeshError(ValueError):
    """An invalid parallel layout, reported before any collective runs."""


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the data-, context- and tensor-parallel dimensions."""

    dp: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp

    def validate(self, world_size: int, n_head: int | None = None, seq_len: int | None = None,
                 vocab_size: int | None = None, d_model: int | None = None, n_kv_heads: int | None = None,
                 ffn_hidden: int | None = None) -> None:
        """Raise MeshError naming what does not fit (no communication happens here). ``d_model`` checks a
        4*d_model MLP; ``ffn_hidden`` another MLP width (e.g. SwiGLU's); ``n_kv_heads`` grouped-query heads."""
        for name in ("dp", "cp", "tp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise MeshError(f"parallel dims: {name}={v!r} must be a positive integer")
        if self.world_size != world_size:
            raise MeshError(f"parallel dims dp={self.dp} x cp={self.cp} x tp={self.tp} = {self.world_size} "
                            f"!= world size {world_size}")
        if n_head is not None and n_head % self.tp:
            raise MeshError(f"tensor parallel: n_head={n_head} is not divisible by tp={self.tp}")
        if d_model is not None and (4 * d_model) % self.tp:
            raise MeshError(f"tensor parallel: MLP width 4*d_model={4 * d_model} is not divisible by tp={self.tp}")
        if n_kv_heads is not None and n_kv_heads % self.tp:
            raise MeshError(f"tensor parallel: n_kv_heads={n_kv_heads} (key/value heads) is not divisible by "
                            f"tp={self.tp}")
        if ffn_hidden is not None and ffn_hidden % self.tp:
            raise MeshError(f"tensor parallel: MLP width {ffn_hidden} is not divisible by tp={self.tp}")
        if vocab_size is not None and vocab_size % self.tp:
            raise MeshError(f"tensor parallel: vocabulary {vocab_size} is not divisible by tp={self.tp}")
        if seq_len is not None and seq_len % (2 * self.cp):
            raise MeshError(f"context parallel: sequence length {seq_len} is not divisible by 2*cp={2 * self.cp}")

    def coords(self, rank: int) -> tuple[int, int, int]:
        tp_i = rank % self.tp
        cp_i = (rank // self.tp) % self.cp
        dp_i = rank // (self.tp * self.cp)
        return dp_i, cp_i, tp_i

    def rank_of(self, dp_i: int, cp_i: int, tp_i: int) -> int:
        return (dp_i * self.cp + cp_i) * self.tp + tp_i


class Mesh:
    """Process groups of one rank along each dimension (created collectively on every rank)."""

    def __init__(self, dims: ParallelDims, group: ProcessGroup | None = None, **shape_checks):
        self.dims = dims
        base = group or world.get_default_group()
        dims.validate(base.size(), **shape_checks)
        self.rank = base.rank()
        self.dp_i, self.cp_i, self.tp_i = dims.coords(self.rank)
        self.base = base
        d = dims
        A, C, T = range(d.dp), range(d.cp), range(d.tp)
        self.tp = self._make(base, [[d.rank_of(a, c, t) for t in T] for a in A for c in C])
        self.cp = self._make(base, [[d.rank_of(a, c, t) for c in C] for a in A for t in T])
        self.dp = self._make(base, [[d.rank_of(a, c, t) for a in A] for c in C for t in T])
        # gradients of replicated parameters are averaged over every rank that saw other tokens
        self.dp_cp = self._make(base, [[d.rank_of(a, c, t) for a in range(d.dp) for c in range(d.cp)]
                                       for t in range(d.tp)])

    def _make(self, base: ProcessGroup, groups: list[list[int]]) -> ProcessGroup:
        mine = None
        for ranks in groups:  # every rank calls new_group for every group, in the same order
            g = base.new_group(ranks) if len(ranks) < base.size() else base
            if self.rank in ranks:
                mine = g
        assert mine is not None
        return mine

    def hsdp(self, replicate: int) -> tuple[ProcessGroup, ProcessGroup]:
        """(shard group, replicate group) of hybrid sharding: the dp dimension split into ``replicate``
        replicas (outer) of ``dp // replicate`` shard ranks (inner, torchtitan's dp_replicate x dp_shard).
        FSDP shards over the shard ranks x cp of one replica and all-reduces the reduced shards over the
        replicas. Created collectively on every rank."""
        d = self.dims
        if replicate < 1 or d.dp % replicate:
            raise MeshError(f"hybrid sharding: {replicate} replicas do not divide dp={d.dp}")
        S = d.dp // replicate
        shard = self._make(self.base, [[d.rank_of(a * S + s, c, t) for s in range(S) for c in range(d.cp)]
                                       for a in range(replicate) for t in range(d.tp)])
        rep = self._make(self.base, [[d.rank_of(a * S + s, c, t) for a in range(replicate)]
                                     for s in range(S) for c in range(d.cp) for t in range(d.tp)])
        return shard, rep
