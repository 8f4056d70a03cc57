"""Training utilities: activation checkpointing and the optimizer step fused into backward."""

from blutensor.utils.checkpoint import checkpoint, checkpoint_modules
from blutensor.utils.optim_in_backward import OptimizerInBackward

__all__ = ["OptimizerInBackward", "checkpoint", "checkpoint_modules"]
