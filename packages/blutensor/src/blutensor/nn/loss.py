"""Loss modules under PyTorch's names: each holds its options (and class weights as a buffer) and calls
the matching ``nn.functional`` loss."""

from __future__ import annotations

from blutensor.nn import functional as F
from blutensor.nn import loss_functions as L
from blutensor.nn.module import Module


class _Loss(Module):
    def __init__(self, reduction: str = "mean", extra: tuple = ()):
        super().__init__()
        L._reduction(type(self).__name__, reduction, extra)
        self.reduction = reduction

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}" if self.reduction != "mean" else ""


class _WeightedLoss(_Loss):
    def __init__(self, weight=None, reduction: str = "mean"):
        super().__init__(reduction)
        if weight is not None:
            L._tensor(type(self).__name__, "weight", weight)
        self.register_buffer("weight", weight)


class MSELoss(_Loss):
    def forward(self, input, target):
        return L.mse_loss(input, target, self.reduction)


class L1Loss(_Loss):
    def forward(self, input, target):
        return L.l1_loss(input, target, self.reduction)


class SmoothL1Loss(_Loss):
    def __init__(self, reduction: str = "mean", beta: float = 1.0):
        super().__init__(reduction)
        self.beta = beta

    def forward(self, input, target):
        return L.smooth_l1_loss(input, target, self.reduction, self.beta)


class HuberLoss(_Loss):
    def __init__(self, reduction: str = "mean", delta: float = 1.0):
        super().__init__(reduction)
        self.delta = delta

    def forward(self, input, target):
        return L.huber_loss(input, target, self.reduction, self.delta)


class BCELoss(_WeightedLoss):
    def forward(self, input, target):
        return L.binary_cross_entropy(input, target, self.weight, self.reduction)


class BCEWithLogitsLoss(_WeightedLoss):
    def __init__(self, weight=None, reduction: str = "mean", pos_weight=None):
        super().__init__(weight, reduction)
        if pos_weight is not None:
            L._tensor("BCEWithLogitsLoss", "pos_weight", pos_weight)
        self.register_buffer("pos_weight", pos_weight)

    def forward(self, input, target):
        return L.binary_cross_entropy_with_logits(input, target, self.weight, self.reduction, self.pos_weight)


class NLLLoss(_WeightedLoss):
    def __init__(self, weight=None, ignore_index: int = -100, reduction: str = "mean"):
        super().__init__(weight, reduction)
        self.ignore_index = ignore_index

    def forward(self, input, target):
        return L.nll_loss(input, target, self.weight, self.ignore_index, self.reduction)


class CrossEntropyLoss(_WeightedLoss):
    """Cross entropy of logits (classes in dim 1, or dim 0 for 1-D input) against class indices or class
    probabilities; ``weight``, ``ignore_index``, ``label_smoothing``, ``reduction`` as in PyTorch. Without a
    weight it is ``F.cross_entropy`` (the fused kernel)."""

    def __init__(self, weight=None, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0):
        super().__init__(weight, reduction)
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing
        if not 0.0 <= label_smoothing <= 1.0:
            from blutensor.errors import ArgumentError

            raise ArgumentError(f"CrossEntropyLoss: label_smoothing must be in [0, 1], got {label_smoothing}")

    def forward(self, input, target):
        if self.weight is None:
            return F.cross_entropy(input, target, ignore_index=self.ignore_index, reduction=self.reduction,
                                   label_smoothing=self.label_smoothing)
        return L.weighted_cross_entropy(input, target, self.weight, self.ignore_index, self.reduction,
                                        self.label_smoothing)


class KLDivLoss(_Loss):
    def __init__(self, reduction: str = "mean", log_target: bool = False):
        super().__init__(reduction, ("batchmean",))
        self.log_target = log_target

    def forward(self, input, target):
        return L.kl_div(input, target, self.reduction, self.log_target)
