"""Training utilities: activation checkpointing and the optimizer step fused into backward."""

from blutensor.utils.checkpoint import checkpoint
from blutensor.utils.optim_in_backward import OptimizerInBackward

__all__ = ["OptimizerInBackward", "checkpoint"]
