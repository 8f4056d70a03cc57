"""Optimizers (SGD, Adam, AdamW), gradient clipping and learning-rate schedules."""

from blutensor.optim import lr_scheduler
from blutensor.optim.adam import Adam
from blutensor.optim.adamw import AdamW
from blutensor.optim.clip import clip_grad_norm_, clip_grad_value_, get_total_norm
from blutensor.optim.optimizer import Optimizer
from blutensor.optim.sgd import SGD

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "clip_grad_norm_", "clip_grad_value_", "get_total_norm",
           "lr_scheduler"]
