"""Training utilities: activation checkpointing, the optimizer step fused into backward, and ``data``
(datasets, samplers, DataLoader)."""

from blutensor.utils import data
from blutensor.utils.checkpoint import checkpoint, checkpoint_modules
from blutensor.utils.optim_in_backward import OptimizerInBackward

__all__ = ["OptimizerInBackward", "checkpoint", "checkpoint_modules", "data"]
