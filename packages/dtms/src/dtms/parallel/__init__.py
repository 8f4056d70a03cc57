"""Parallel strategies applied to a model from outside it: DDP, FSDP, TP, CP and their meshes."""

from dtms.parallel.context_parallel import ROTATORS, apply_context_parallel, local_positions, shard_sequence
from dtms.parallel.ddp import DDP, DDPStats, DistributedDataParallel
from dtms.parallel.fsdp import FSDP, FullyShardedDataParallel
from dtms.parallel.mesh import Mesh, MeshError, ParallelDims
from dtms.parallel.parallelize import Parallelized, parallelize
from dtms.parallel.plan import ParallelPlan
from dtms.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    apply_tensor_parallel,
)

__all__ = ["DDP", "FSDP", "ROTATORS", "ColumnParallelLinear", "DDPStats", "DistributedDataParallel",
           "FullyShardedDataParallel", "Mesh", "MeshError", "ParallelDims", "ParallelPlan", "Parallelized",
           "RowParallelLinear",
           "apply_context_parallel", "apply_tensor_parallel", "local_positions", "parallelize", "shard_sequence"]
