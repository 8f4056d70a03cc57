"""Learning-rate schedules: LambdaLR and linear warmup + cosine decay (the GPT-2 recipe)."""

from __future__ import annotations

import math


def warmup_cosine(step: int, max_lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """LR at ``step`` (0-based): linear warmup to max_lr, cosine decay to min_lr at total_steps."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    ratio = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)


class LRScheduler:
    """Sets every group's lr from ``lr_at(step)`` on each ``step()``."""

    def __init__(self, optimizer, last_step: int = -1):
        if not hasattr(optimizer, "param_groups"):
            from blutensor.errors import DTypeError

            raise DTypeError(f"{type(self).__name__}: expected an optimizer (with param_groups), got "
                             f"{type(optimizer).__name__}")
        self.optimizer = optimizer
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.last_step = last_step
        self.step()

    def lr_at(self, step: int, base_lr: float) -> float:
        raise NotImplementedError

    def step(self) -> None:
        self.last_step += 1
        for g, base in zip(self.optimizer.param_groups, self.base_lrs):
            g["lr"] = self.lr_at(self.last_step, base)

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_step": self.last_step, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, sd: dict) -> None:
        self.last_step = sd["last_step"] - 1
        self.base_lrs = list(sd["base_lrs"])
        self.step()


class LambdaLR(LRScheduler):
    def __init__(self, optimizer, lr_lambda, last_step: int = -1):
        self.lr_lambda = lr_lambda
        super().__init__(optimizer, last_step)

    def lr_at(self, step: int, base_lr: float) -> float:
        return base_lr * self.lr_lambda(step)


class WarmupCosineLR(LRScheduler):
    """Linear warmup over ``warmup_steps`` then cosine decay to ``min_lr`` at ``total_steps``."""

    def __init__(self, optimizer, warmup_steps: int, total_steps: int, min_lr: float, max_lr: float | None = None,
                 last_step: int = -1):
        self.warmup_steps, self.total_steps, self.min_lr, self.max_lr = warmup_steps, total_steps, min_lr, max_lr
        super().__init__(optimizer, last_step)

    def lr_at(self, step: int, base_lr: float) -> float:
        return warmup_cosine(step, self.max_lr or base_lr, self.min_lr, self.warmup_steps, self.total_steps)
