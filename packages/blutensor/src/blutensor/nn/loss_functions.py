"""Loss functions of ``nn.functional`` beyond cross_entropy, composed from differentiable ops (so their
gradients come from autograd): mse_loss, l1_loss, smooth_l1_loss, huber_loss, binary_cross_entropy,
binary_cross_entropy_with_logits, nll_loss, kl_div, and cross_entropy with per-class ``weight``.
Formulas, reductions and edge cases (ignore_index, log clamped at -100, 'batchmean') are PyTorch's."""

from __future__ import annotations

import numbers
import warnings

from blutensor.errors import ArgumentError, DTypeError, ShapeError


def _tensor(op: str, name: str, t, floating: bool = True):
    from blutensor._tensor import Tensor

    if not isinstance(t, Tensor):
        raise DTypeError(f"{op}: {name} must be a Tensor, got {type(t).__name__}")
    if floating and not t.dtype.is_floating_point:
        raise DTypeError(f"{op}: {name} must be a floating-point Tensor, got {t._desc()}")
    return t


def _reduction(op: str, reduction: str, extra: tuple = ()) -> None:
    if reduction not in ("mean", "sum", "none", *extra):
        allowed = ", ".join(repr(r) for r in ("none", "mean", "sum", *extra))
        raise ArgumentError(f"{op}: reduction must be one of {allowed}, got {reduction!r}")


def _reduce(x, reduction: str):
    if reduction == "mean":
        return x.mean()
    if reduction == "sum":
        return x.sum()
    return x


def _pair(op: str, input, target):
    _tensor(op, "input", input)
    _tensor(op, "target", target)
    if tuple(input.shape) != tuple(target.shape):
        warnings.warn(f"{op}: using a target size ({tuple(target.shape)}) that is different to the input size "
                      f"({tuple(input.shape)}); this will likely lead to incorrect results due to broadcasting. "
                      f"Please ensure they have the same size.", stacklevel=3)


def mse_loss(input, target, reduction: str = "mean"):
    """(input - target)^2, reduced."""
    _reduction("mse_loss", reduction)
    _pair("mse_loss", input, target)
    d = input - target
    return _reduce(d * d, reduction)


def l1_loss(input, target, reduction: str = "mean"):
    """|input - target|, reduced."""
    _reduction("l1_loss", reduction)
    _pair("l1_loss", input, target)
    return _reduce((input - target).abs(), reduction)


def smooth_l1_loss(input, target, reduction: str = "mean", beta: float = 1.0):
    """0.5 d^2 / beta where |d| < beta, else |d| - 0.5 beta (L1 when beta == 0)."""
    from blutensor.functional import where

    _reduction("smooth_l1_loss", reduction)
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not beta >= 0:
        raise ArgumentError(f"smooth_l1_loss: beta must be a non-negative number, got {beta!r:.40}")
    _pair("smooth_l1_loss", input, target)
    d = (input - target).abs()
    if beta == 0:
        return _reduce(d, reduction)
    return _reduce(where(d < beta, d * d * (0.5 / beta), d - 0.5 * beta), reduction)


def huber_loss(input, target, reduction: str = "mean", delta: float = 1.0):
    """0.5 d^2 where |d| < delta, else delta (|d| - 0.5 delta)."""
    from blutensor.functional import where

    _reduction("huber_loss", reduction)
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not delta > 0:
        raise ArgumentError(f"huber_loss: delta must be a positive number, got {delta!r:.40}")
    _pair("huber_loss", input, target)
    d = (input - target).abs()
    return _reduce(where(d < delta, d * d * 0.5, (d - 0.5 * delta) * delta), reduction)


def _log_clamped(x):
    """log(x) clamped at -100 (PyTorch's BCE), without evaluating log(0)."""
    from blutensor.functional import where

    pos = x > 0
    return where(pos, where(pos, x, 1.0).log(), -100.0).clamp(min=-100.0)


def binary_cross_entropy(input, target, weight=None, reduction: str = "mean"):
    """-(t log x + (1 - t) log(1 - x)) with each log clamped at -100 (as PyTorch); input in [0, 1]."""
    _reduction("binary_cross_entropy", reduction)
    _tensor("binary_cross_entropy", "input", input)
    _tensor("binary_cross_entropy", "target", target)
    if tuple(input.shape) != tuple(target.shape):
        raise ShapeError(f"binary_cross_entropy: target size ({tuple(target.shape)}) must be the same as input "
                         f"size ({tuple(input.shape)})")
    if input.numel() and bool(((input < 0) | (input > 1)).any()):
        raise ArgumentError("binary_cross_entropy: all elements of input should be between 0 and 1 (pass logits "
                            "to binary_cross_entropy_with_logits)")
    loss = -(target * _log_clamped(input) + (1 - target) * _log_clamped(1 - input))
    if weight is not None:
        loss = loss * _tensor("binary_cross_entropy", "weight", weight)
    return _reduce(loss, reduction)


def binary_cross_entropy_with_logits(input, target, weight=None, reduction: str = "mean", pos_weight=None):
    """BCE of sigmoid(input) computed stably from the logits: (1 - t) x + w_p (log(1 + e^-|x|) + max(-x, 0))
    with w_p = 1 + (pos_weight - 1) t."""
    _reduction("binary_cross_entropy_with_logits", reduction)
    _tensor("binary_cross_entropy_with_logits", "input", input)
    _tensor("binary_cross_entropy_with_logits", "target", target)
    if tuple(input.shape) != tuple(target.shape):
        raise ShapeError(f"binary_cross_entropy_with_logits: target size ({tuple(target.shape)}) must be the same "
                         f"as input size ({tuple(input.shape)})")
    softplus_neg = (1 + (-input.abs()).exp()).log() + (-input).relu()  # log(1 + e^-x), overflow-free
    if pos_weight is not None:
        lw = (_tensor("binary_cross_entropy_with_logits", "pos_weight", pos_weight) - 1) * target + 1
        loss = (1 - target) * input + lw * softplus_neg
    else:
        loss = (1 - target) * input + softplus_neg
    if weight is not None:
        loss = loss * _tensor("binary_cross_entropy_with_logits", "weight", weight)
    return _reduce(loss, reduction)


def _class_mask(op: str, input, target, ignore_index: int):
    """(one-hot bool mask shaped like input, valid bool mask shaped like target); checks the layout
    (N, C, d...) / (N, d...) or (C,) / () and the class range."""
    from blutensor.creation import arange

    _tensor(op, "input", input)
    _tensor(op, "target", target, floating=False)
    if target.dtype.name == "bool":
        raise DTypeError(f"{op}: target must hold class indices (int), got {target._desc()}")
    if input.ndim == 0:
        raise ShapeError(f"{op}: input must have a class dimension, got a 0-d tensor")
    cdim = 0 if input.ndim == 1 else 1
    want = tuple(input.shape[:cdim]) + tuple(input.shape[cdim + 1:])
    if tuple(target.shape) != want:
        raise ShapeError(f"{op}: expected target of shape {want} for input of shape {tuple(input.shape)} (classes "
                         f"in dim {cdim}), got {tuple(target.shape)}")
    c = input.shape[cdim]
    if target.numel() and bool((((target < 0) | (target >= c)) & (target != ignore_index)).any()):
        raise ArgumentError(f"{op}: target holds a class index outside [0, {c}) (and not ignore_index="
                            f"{ignore_index})")
    classes = arange(c, device=input.device).view(*([c] + [1] * (input.ndim - cdim - 1)))
    valid = target != ignore_index
    onehot = (target.unsqueeze(cdim) == classes) & valid.unsqueeze(cdim)  # ignore_index may name a real class
    return onehot, valid, cdim, c




def _class_weight(op: str, weight, c: int, cdim: int, ndim: int, input):
    if weight is None:
        return None
    _tensor(op, "weight", weight)
    if tuple(weight.shape) != (c,):
        raise ShapeError(f"{op}: weight must have one entry per class ({c}), got shape {tuple(weight.shape)}")
    return weight.view(*([c] + [1] * (ndim - cdim - 1))).to(input.dtype)


def nll_loss(input, target, weight=None, ignore_index: int = -100, reduction: str = "mean"):
    """-input[target] per sample (input holds log-probabilities, classes in dim 1, or dim 0 for 1-D input);
    'mean' divides by the summed weights of the non-ignored targets."""
    from blutensor.functional import where

    _reduction("nll_loss", reduction)
    onehot, valid, cdim, c = _class_mask("nll_loss", input, target, ignore_index)
    w = _class_weight("nll_loss", weight, c, cdim, input.ndim, input)
    picked = where(onehot, input, 0.0).sum(cdim)
    if w is None:
        wt = valid.to(input.dtype)
    else:
        wt = where(onehot, w.expand_as(input), 0.0).sum(cdim)
    loss = -picked * wt
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / wt.sum()


def weighted_cross_entropy(input, target, weight=None, ignore_index: int = -100, reduction: str = "mean",
                           label_smoothing: float = 0.0):
    """PyTorch's cross_entropy with a per-class ``weight``: class-index targets (N, C, d...) or class
    probabilities (same shape as input), with label smoothing."""
    from blutensor.functional import log_softmax, where

    _reduction("cross_entropy", reduction)
    _tensor("cross_entropy", "input", input)
    if not isinstance(label_smoothing, numbers.Real) or not 0.0 <= label_smoothing <= 1.0:
        raise ArgumentError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing!r:.40}")
    cdim = 0 if input.ndim == 1 else 1
    logp = log_softmax(input, cdim)
    c = input.shape[cdim]
    eps = float(label_smoothing)
    if _tensor("cross_entropy", "target", target, floating=False).dtype.is_floating_point:
        if tuple(target.shape) != tuple(input.shape):
            raise ShapeError(f"cross_entropy: probability targets must have the input's shape "
                             f"{tuple(input.shape)}, got {tuple(target.shape)}")
        w = _class_weight("cross_entropy", weight, c, cdim, input.ndim, input)
        t = target * (1 - eps) + eps / c if eps else target
        term = logp * t if w is None else logp * t * w
        loss = -term.sum(cdim)
        if reduction == "mean":
            return loss.sum() / (loss.numel() if loss.numel() else float("nan"))
        return _reduce(loss, reduction)
    nll = nll_loss(logp, target, weight, ignore_index, reduction)
    if not eps:
        return nll
    onehot, valid, cdim, c = _class_mask("cross_entropy", input, target, ignore_index)
    w = _class_weight("cross_entropy", weight, c, cdim, input.ndim, input)
    smooth = -(logp if w is None else logp * w).sum(cdim)
    smooth = where(valid, smooth, 0.0)
    if reduction == "mean":
        denom = valid.to(input.dtype).sum() if w is None else where(onehot, w.expand_as(input), 0.0).sum()
        smooth = smooth.sum() / denom
    else:
        smooth = _reduce(smooth, reduction)
    return nll * (1 - eps) + smooth * (eps / c)


def kl_div(input, target, reduction: str = "mean", log_target: bool = False):
    """target * (log target - input) pointwise (0 where target == 0); input holds log-probabilities.
    'batchmean' divides the sum by the batch size (the mathematically correct KL); 'mean' by the element
    count, as PyTorch does."""
    from blutensor.functional import where

    _reduction("kl_div", reduction, ("batchmean",))
    _pair("kl_div", input, target)
    if log_target:
        loss = target.exp() * (target - input)
    else:
        pos = target > 0
        safe = where(pos, target, 1.0)
        loss = where(pos, target * (safe.log() - input), 0.0 * input)
    if reduction == "batchmean":
        return loss.sum() / (input.shape[0] if input.ndim else 1)
    return _reduce(loss, reduction)
