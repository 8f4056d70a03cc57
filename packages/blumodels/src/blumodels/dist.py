"""Parallel glue for the Trainer: one process group (dtms, optional), DDP wrapping or the ``[parallel]`` mesh
(FSDP / HSDP / TP / CP through dtms' ``mesh`` plugin and the model family's plan), scalar averages.

A single process needs nothing from here (``Dist.single()``); ``train.world_size > 1`` requires dtms
(``pip install blumodels[dist]``) and a launcher (``blurun``, ``mpirun``/``mpiexec``, ``srun``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from blumodels.config import ConfigError


class Dist:
    """Rank, world size and the collectives the Trainer uses (identity when world size is 1)."""

    def __init__(self, rank: int = 0, world: int = 1, pg: Any = None, local_rank: int = 0):
        self.rank, self.world, self.pg, self.local_rank = rank, world, pg, local_rank
        self.par: Any = None  # dtms.parallel.Parallelized of a [parallel] run with FSDP, TP or CP

    @classmethod
    def single(cls) -> Dist:
        return cls()

    @classmethod
    def from_config(cls, world_size: int) -> Dist:
        """The running job's group; its size must equal ``train.world_size``."""
        if world_size == 1:
            return cls.single()
        try:
            import dtms
        except ImportError:
            raise ConfigError("train.world_size > 1 needs dtms: pip install 'blumodels[dist]'") from None
        if not dtms.is_initialized():
            try:
                dtms.init_process_group()
            except dtms.LaunchError as e:  # e.g. torchrun-style variables on CPU without an MPI world
                raise ConfigError(f"train.world_size={world_size}: {e}") from None
        world = dtms.get_world_size()
        if world != world_size:
            raise ConfigError(f"train.world_size={world_size} but this job runs {world} process(es); start it "
                              f"with {world_size} ranks (e.g. mpiexec -n {world_size} blutrain train ...)")
        return cls(dtms.get_rank(), world, dtms.get_default_group(), dtms.get_local_rank())

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, device: str) -> str:
        """'cuda' -> 'cuda:<local rank>' in a multi-process job."""
        return f"cuda:{self.local_rank}" if self.world > 1 and device == "cuda" else device

    def wrap(self, model: Any, cfg: Any = None) -> Any:
        """The module used for forward/backward: the ``[parallel]`` mesh when it shards (FSDP, TP or CP),
        else DDP over the group, or the model itself."""
        if cfg is not None and cfg.parallel.sharded:
            return self._parallelize(model, cfg)
        if self.world == 1:
            return model
        from dtms.parallel.ddp import DistributedDataParallel

        return DistributedDataParallel(model, self.pg)

    def _parallelize(self, model: Any, cfg: Any) -> Any:
        """Apply dtms' registered ``mesh`` strategy (TP, then CP, then FSDP or DDP) with the plan of the model's
        family plugin (``parallel_plan(model)``, kept beside the model: GPT-2's, Llama's)."""
        from blutensor.ext import PluginError, get_host
        from dtms.parallel import MeshError, ParallelDims

        from blumodels.families import family
        from blumodels.gpt2_parallelize import decay_key

        make_plan = getattr(family(cfg.model.family), "parallel_plan", None)
        if make_plan is None:
            raise ConfigError(f"[parallel]: model.family = {cfg.model.family!r} has no parallel plan")

        p = cfg.parallel
        sz = p.sizes(self.world)
        dims = ParallelDims(dp=sz["dp"] * sz["fsdp"], cp=p.cp, tp=p.tp)
        try:
            strategy = get_host().registry("parallel").get("mesh")
        except PluginError as e:
            raise ConfigError(f"[parallel] needs dtms' 'mesh' parallel strategy plugin: {e}") from None
        try:
            self.par = strategy.apply(model, dims, group=self.pg, fsdp=p.fsdp > 1, async_tp_chunks=max(p.tp_async, 1),
                                      cp_rotator=p.cp_rotator, plan=make_plan(model), seq_len=cfg.train.seq_len,
                                      param_key=decay_key, dp_replicate=sz["dp"] if p.fsdp > 1 else 1)
        except MeshError as e:
            raise ConfigError(f"[parallel]: {e}") from None
        return self.par.model

    @property
    def data_rank(self) -> int:
        """Index of this rank among those that read different batch rows (dp x fsdp)."""
        return self.par.mesh.dp_i if self.par is not None else self.rank

    @property
    def data_world(self) -> int:
        return self.par.mesh.dims.dp if self.par is not None else self.world

    @property
    def seq_shard(self) -> tuple[int, int] | None:
        """(cp index, cp size) for context parallelism's load-balanced sequence shard, else None."""
        if self.par is None or self.par.mesh.dims.cp == 1:
            return None
        return self.par.mesh.cp_i, self.par.mesh.dims.cp

    def param_source(self, model: Any) -> Any:
        """What AdamW's param groups come from: the mesh's local shards, or the model."""
        return self.par if self.par is not None else model

    def local_parameters(self, model: Any, module: Any) -> dict:
        """This rank's parameters by name (FSDP: its flat shards; TP: its slices)."""
        if self.par is not None and self.par.fsdp:
            return dict(module.named_parameters())
        return dict(model.named_parameters())

    def clip_grad_norm_(self, params: list, max_norm: float) -> float:
        """Clip by the global gradient norm of the unsharded model (the mesh's norm when sharded)."""
        if self.par is not None:
            return self.par.clip_grad_norm_(max_norm)
        import blutensor as bt

        return float(bt.optim.clip_grad_norm_(params, max_norm).item())

    def grad_norm(self, params: list) -> float:
        """The global L2 norm of the gradients without clipping (of the unsharded model when sharded)."""
        if self.par is not None:
            return self.par.clip_grad_norm_(float("inf"))
        import math

        return math.sqrt(sum(float((p.grad.detach().to("cpu").numpy().astype(np.float64) ** 2).sum())
                             for p in params if p.grad is not None))

    def no_sync(self, module: Any, skip: bool):
        """DDP's no_sync() for accumulation micro-steps (``skip`` True), else a null context (FSDP accumulates
        the reduce-scattered gradients into its shards on every micro-step)."""
        if skip and self.world > 1 and hasattr(module, "no_sync"):
            return module.no_sync()
        return contextlib.nullcontext()

    def mean(self, values: list[float], device: str = "cpu") -> list[float]:
        """Average of each value over ranks (float64 on the host, or on the GPU for NCCL)."""
        if self.world == 1:
            return list(values)
        arr = np.asarray(values, dtype=np.float64)
        if device.startswith("cuda") and self.pg.backend == "nccl":
            import cupy as cp

            d = cp.asarray(arr)
            self.pg.all_reduce(d, op="avg")
            return [float(v) for v in d.get()]
        self.pg.all_reduce(arr, op="avg")
        return [float(v) for v in arr]

    def min_int(self, value: int, device: str = "cpu") -> int:
        """Minimum of an integer over ranks."""
        if self.world == 1:
            return value
        arr = np.asarray([value], dtype=np.float64)
        if device.startswith("cuda") and self.pg.backend == "nccl":
            import cupy as cp

            d = cp.asarray(arr)
            self.pg.all_reduce(d, op="min")
            return int(d.get()[0])
        self.pg.all_reduce(arr, op="min")
        return int(arr[0])

    def barrier(self) -> None:
        if self.world > 1:
            self.pg.barrier()
