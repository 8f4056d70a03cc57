"""Data-parallel glue for the Trainer: one process group (dtms, optional), DDP wrapping, scalar averages.

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
            dtms.init_process_group()
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

    def wrap(self, model: Any) -> Any:
        """The module used for forward/backward: DDP over the group, or the model itself."""
        if self.world == 1:
            return model
        from dtms.parallel.ddp import DistributedDataParallel

        return DistributedDataParallel(model, self.pg)

    def no_sync(self, module: Any, skip: bool):
        """DDP's no_sync() for accumulation micro-steps (``skip`` True), else a null context."""
        if skip and self.world > 1:
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
