"""Parallel strategies applied to a model from outside it: DDP (and FSDP, TP, CP)."""

from dtms.parallel.ddp import DDP, DDPStats, DistributedDataParallel

__all__ = ["DDP", "DDPStats", "DistributedDataParallel"]
