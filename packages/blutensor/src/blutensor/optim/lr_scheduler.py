"""Learning-rate schedules under PyTorch's names and formulas: LambdaLR, StepLR, MultiStepLR,
ExponentialLR, CosineAnnealingLR, CosineAnnealingWarmRestarts, LinearLR, ConstantLR, PolynomialLR,
OneCycleLR, SequentialLR, ReduceLROnPlateau (metric-driven), and the GPT-2 recipe (``warmup_cosine`` /
``WarmupCosineLR``).

Every schedule is a closed form of the step count (``last_epoch``) and each group's ``initial_lr``, so a
scheduler restored from ``state_dict()`` continues exactly where it stopped and SequentialLR hands over at
a milestone without drift. The lrs agree with PyTorch's recursive forms as long as nothing else changes
the groups' lr in between (blutensor has no ChainedScheduler to multiply two schedules together).
"""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Callable, Sequence

from blutensor.errors import ArgumentError, DTypeError


def warmup_cosine(step: int, max_lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """LR at ``step`` (0-based): linear warmup to max_lr, cosine decay to min_lr at total_steps."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    ratio = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)


def _num(owner: str, name: str, v, low: float | None = None, high: float | None = None,
         integer: bool = False, low_open: bool = False):
    ok = not isinstance(v, bool) and isinstance(v, numbers.Integral if integer else numbers.Real) and v == v
    if ok and low is not None:
        ok = v > low if low_open else v >= low
    if ok and high is not None:
        ok = v <= high
    if not ok:
        rng = "" if low is None else f" ({'>' if low_open else '>='} {low}" + ("" if high is None else
                                                                                f", <= {high}") + ")"
        kind = "an int" if integer else "a number"
        raise ArgumentError(f"{owner}: {name} must be {kind}{rng}, got {v!r:.40}")
    return v


class LRScheduler:
    """Sets each param group's ``lr`` to ``lr_at(last_epoch, initial_lr, group_index)`` on every
    ``step()``; construction performs the first step (epoch 0), as in PyTorch."""

    def __init__(self, optimizer, last_epoch: int = -1):
        if not hasattr(optimizer, "param_groups"):
            raise DTypeError(f"{type(self).__name__}: expected an optimizer (with param_groups), got "
                             f"{type(optimizer).__name__}")
        _num(type(self).__name__, "last_epoch", last_epoch, -1, integer=True)
        self.optimizer = optimizer
        if last_epoch == -1:
            for g in optimizer.param_groups:
                g.setdefault("initial_lr", g["lr"])
        else:
            for i, g in enumerate(optimizer.param_groups):
                if "initial_lr" not in g:
                    raise KeyError(f"{type(self).__name__}: param 'initial_lr' is not specified in param_groups[{i}] "
                                   f"when resuming with last_epoch={last_epoch}")
        self.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
        self.last_epoch = last_epoch
        self._last_lr: list[float] = []
        self.step()

    @property
    def last_step(self) -> int:
        """Alias of ``last_epoch`` (the count of ``step()`` calls since epoch 0)."""
        return self.last_epoch

    @last_step.setter
    def last_step(self, v: int) -> None:
        self.last_epoch = v

    def lr_at(self, epoch: int, base_lr: float, group: int = 0) -> float:
        raise NotImplementedError(f"{type(self).__name__} does not define lr_at")

    def get_lr(self) -> list[float]:
        return [self.lr_at(self.last_epoch, b, i) for i, b in enumerate(self.base_lrs)]

    def _apply(self) -> None:
        """Hook after the lrs are set (OneCycleLR sets the momentum too)."""

    def step(self, epoch: int | None = None) -> None:
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        for g, lr in zip(self.optimizer.param_groups, self.get_lr()):
            g["lr"] = lr
        self._apply()
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        """The lrs the last ``step()`` set."""
        return list(self._last_lr)

    _skip = ("optimizer",)

    def state_dict(self) -> dict:
        """Plain values only (no optimizer, no functions), so it can go through ``blutensor.save``."""
        return {k: v for k, v in self.__dict__.items() if k not in self._skip and not callable(v)}

    def load_state_dict(self, state_dict: dict) -> None:
        if not isinstance(state_dict, dict) or ("last_epoch" not in state_dict and "last_step" not in state_dict):
            got = sorted(map(str, state_dict)) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ArgumentError(f"{type(self).__name__}.load_state_dict: expected the dict from state_dict() (with "
                                f"'last_epoch'), got {got}")
        if "last_step" in state_dict and "last_epoch" not in state_dict:
            state_dict = {**state_dict, "last_epoch": state_dict["last_step"]}  # written by earlier versions
            state_dict.pop("last_step")
        self.__dict__.update({k: (list(v) if k in ("base_lrs", "_last_lr") else v) for k, v in state_dict.items()})


def _per_group(owner: str, name: str, v, n: int) -> list:
    if isinstance(v, list | tuple):
        if len(v) != n:
            raise ArgumentError(f"{owner}: expected {n} values of {name} (one per param group), got {len(v)}")
        return list(v)
    return [v] * n


class LambdaLR(LRScheduler):
    """lr = initial_lr * lr_lambda(epoch) (one function, or one per param group)."""

    def __init__(self, optimizer, lr_lambda: Callable | Sequence[Callable], last_epoch: int = -1):
        n = len(optimizer.param_groups) if hasattr(optimizer, "param_groups") else 1
        fns = _per_group("LambdaLR", "lr_lambda", lr_lambda, n)
        for f in fns:
            if not callable(f):
                raise DTypeError(f"LambdaLR: lr_lambda must be callable, got {type(f).__name__}")
        self.lr_lambdas = fns
        super().__init__(optimizer, last_epoch)

    _skip = ("optimizer", "lr_lambdas")

    def lr_at(self, epoch: int, base_lr: float, group: int = 0) -> float:
        return base_lr * self.lr_lambdas[group](epoch)


class StepLR(LRScheduler):
    """lr = initial_lr * gamma ** (epoch // step_size)."""

    def __init__(self, optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1):
        self.step_size = _num("StepLR", "step_size", step_size, 0, integer=True, low_open=True)
        self.gamma = _num("StepLR", "gamma", gamma)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, epoch: int, base_lr: float, group: int = 0) -> float:
        return base_lr * self.gamma ** (epoch // self.step_size)


class MultiStepLR(LRScheduler):
    """lr = initial_lr * gamma ** (number of milestones <= epoch)."""

    def __init__(self, optimizer, milestones: Sequence[int], gamma: float = 0.1, last_epoch: int = -1):
        ms = list(milestones)
        for m in ms:
            _num("MultiStepLR", "milestones", m, integer=True)
        self.milestones, self.gamma = sorted(ms), _num("MultiStepLR", "gamma", gamma)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, epoch: int, base_lr: float, group: int = 0) -> float:
        return base_lr * self.gamma ** bisect.bisect_right(self.milestones, epoch)


class ExponentialLR(LRScheduler):
    """lr = initial_lr * gamma ** epoch."""

    def __init__(self, optimizer, gamma: float, last_epoch: int = -1):
        self.gamma = _num("ExponentialLR", "gamma", gamma)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, epoch: int, base_lr: float, group: int = 0) -> float:
        return base_lr * self.gamma ** epoch


class CosineAnnealingLR(LRScheduler):
    """lr = eta_min + (initial_lr - eta_min) * (1 + cos(pi * epoch / T_max)) / 2."""

    def __init__(self, optimizer, T_max: int, eta_min: float = 0.0, last_epoch: int = -1):  # noqa: N803
        self.T_max = _num("CosineAnnealingLR", "T_max", T_max, 0, low_open=True)
        self.eta_min = _num("CosineAnnealingLR", "eta_min", eta_min)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, epoch: int, base_lr: float, group: int = 0) -> float:
        return self.eta_min + (base_lr - self.eta_min) * (1 + math.cos(math.pi * epoch / self.T_max)) / 2


class LinearLR(LRScheduler):
    """The factor goes linearly from start_factor to end_factor over total_iters steps, then stays."""

    def __init__(self, optimizer, start_factor: float = 1.0 / 3, end_factor: float = 1.0, total_iters: int = 5,
                 last_epoch: int = -1):
        self.start_factor = _num("LinearLR", "start_factor", start_factor, 0, 1, low_open=True)
        self.end_factor = _num("LinearLR", "end_factor", end_factor, 0, 1)
        self.total_iters = _num("LinearLR", "total_iters", total_iters, 0, integer=True, low_open=True)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, epoch: int, base_lr: float, group: int = 0) -> float:
        frac = min(self.total_iters, epoch) / self.total_iters
        return base_lr * (self.start_factor + (self.end_factor - self.start_factor) * frac)


class ConstantLR(LRScheduler):
    """lr = initial_lr * factor for the first total_iters steps, then initial_lr."""

    def __init__(self, optimizer, factor: float = 1.0 / 3, total_iters: int = 5, last_epoch: int = -1):
        self.factor = _num("ConstantLR", "factor", factor, 0, 1)
        self.total_iters = _num("ConstantLR", "total_iters", total_iters, 0, integer=True)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, epoch: int, base_lr: float, group: int = 0) -> float:
        return base_lr * (self.factor if epoch < self.total_iters else 1.0)


class PolynomialLR(LRScheduler):
    """lr = initial_lr * (1 - min(epoch, total_iters) / total_iters) ** power."""

    def __init__(self, optimizer, total_iters: int = 5, power: float = 1.0, last_epoch: int = -1):
        self.total_iters = _num("PolynomialLR", "total_iters", total_iters, 0, integer=True, low_open=True)
        self.power = _num("PolynomialLR", "power", power)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, epoch: int, base_lr: float, group: int = 0) -> float:
        return base_lr * (1.0 - min(self.total_iters, epoch) / self.total_iters) ** self.power


class OneCycleLR(LRScheduler):
    """The 1cycle policy (Smith & Topin): warm up from max_lr/div_factor to max_lr over pct_start of the
    steps, anneal to initial_lr/final_div_factor ('cos' or 'linear'), with the momentum (SGD) or beta1
    (Adam/AdamW) cycled inversely between max_momentum and base_momentum. PyTorch's parameters."""

    def __init__(self, optimizer, max_lr, total_steps: int | None = None, epochs: int | None = None,
                 steps_per_epoch: int | None = None, pct_start: float = 0.3, anneal_strategy: str = "cos",
                 cycle_momentum: bool = True, base_momentum=0.85, max_momentum=0.95, div_factor: float = 25.0,
                 final_div_factor: float = 1e4, three_phase: bool = False, last_epoch: int = -1):
        if not hasattr(optimizer, "param_groups"):
            raise DTypeError(f"OneCycleLR: expected an optimizer (with param_groups), got {type(optimizer).__name__}")
        if total_steps is not None:
            self.total_steps = _num("OneCycleLR", "total_steps", total_steps, 0, integer=True, low_open=True)
        elif epochs is not None and steps_per_epoch is not None:
            _num("OneCycleLR", "epochs", epochs, 0, integer=True, low_open=True)
            _num("OneCycleLR", "steps_per_epoch", steps_per_epoch, 0, integer=True, low_open=True)
            self.total_steps = epochs * steps_per_epoch
        else:
            raise ArgumentError("OneCycleLR: you must define either total_steps OR (epochs AND steps_per_epoch)")
        _num("OneCycleLR", "pct_start", pct_start, 0, 1)
        if anneal_strategy not in ("cos", "linear"):
            raise ArgumentError(f"OneCycleLR: anneal_strategy must be one of 'cos' or 'linear', got "
                                f"{anneal_strategy!r}")
        self.anneal_strategy, self.cycle_momentum, self.three_phase = anneal_strategy, cycle_momentum, three_phase
        t = self.total_steps
        if three_phase:
            self._phases = [(float(pct_start * t) - 1, "initial_lr", "max_lr", "max_momentum", "base_momentum"),
                            (float(2 * pct_start * t) - 2, "max_lr", "initial_lr", "base_momentum", "max_momentum"),
                            (t - 1, "initial_lr", "min_lr", "max_momentum", "max_momentum")]
        else:
            self._phases = [(float(pct_start * t) - 1, "initial_lr", "max_lr", "max_momentum", "base_momentum"),
                            (t - 1, "max_lr", "min_lr", "base_momentum", "max_momentum")]
        groups = optimizer.param_groups
        n = len(groups)
        max_lrs = _per_group("OneCycleLR", "max_lr", max_lr, n)
        if last_epoch == -1:
            for g, lr in zip(groups, max_lrs):
                g["initial_lr"] = lr / div_factor
                g["max_lr"] = lr
                g["min_lr"] = g["initial_lr"] / final_div_factor
        if cycle_momentum:
            if "momentum" not in groups[0] and "betas" not in groups[0]:
                raise ArgumentError("OneCycleLR: optimizer must support momentum or beta1 with cycle_momentum "
                                    "enabled")
            self._use_beta1 = "betas" in groups[0]
            if last_epoch == -1:
                for g, lo, hi in zip(groups, _per_group("OneCycleLR", "base_momentum", base_momentum, n),
                                     _per_group("OneCycleLR", "max_momentum", max_momentum, n)):
                    if self._use_beta1:
                        g["betas"] = (hi, *g["betas"][1:])
                    else:
                        g["momentum"] = hi
                    g["max_momentum"], g["base_momentum"] = hi, lo
        super().__init__(optimizer, last_epoch)

    def _anneal(self, start: float, end: float, pct: float) -> float:
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def _phase(self, step: int, g: dict, lr: bool) -> float:
        start = 0.0
        for i, (end, lr0, lr1, m0, m1) in enumerate(self._phases):
            if step <= end or i == len(self._phases) - 1:
                pct = (step - start) / (end - start)
                return self._anneal(g[lr0], g[lr1], pct) if lr else self._anneal(g[m0], g[m1], pct)
            start = end
        raise AssertionError("unreachable")

    def get_lr(self) -> list[float]:
        if self.last_epoch > self.total_steps:
            raise ArgumentError(f"OneCycleLR: tried to step {self.last_epoch} times; the specified number of total "
                                f"steps is {self.total_steps}")
        return [self._phase(self.last_epoch, g, True) for g in self.optimizer.param_groups]

    def _apply(self) -> None:
        if not self.cycle_momentum:
            return
        for g in self.optimizer.param_groups:
            m = self._phase(self.last_epoch, g, False)
            if self._use_beta1:
                g["betas"] = (m, *g["betas"][1:])
            else:
                g["momentum"] = m


class SequentialLR(LRScheduler):
    """``schedulers[i]`` runs from ``milestones[i-1]`` (its own epoch counted from 0 there)."""

    def __init__(self, optimizer, schedulers: Sequence[LRScheduler], milestones: Sequence[int],
                 last_epoch: int = -1):
        scheds = list(schedulers)
        if not scheds:
            raise ArgumentError("SequentialLR: expects at least one scheduler")
        for i, s in enumerate(scheds):
            if not isinstance(s, LRScheduler) or isinstance(s, SequentialLR | OneCycleLR):
                raise DTypeError(f"SequentialLR: schedulers[{i}] is a {type(s).__name__}; closed-form schedulers "
                                 f"(not SequentialLR or OneCycleLR) can be sequenced")
            if s.optimizer is not optimizer:
                raise ArgumentError(f"SequentialLR: schedulers[{i}] has a different optimizer than the SequentialLR")
        ms = list(milestones)
        if len(ms) != len(scheds) - 1:
            raise ArgumentError(f"SequentialLR: expected {len(scheds) - 1} milestones for {len(scheds)} schedulers, "
                                f"got {len(ms)}")
        for m in ms:
            _num("SequentialLR", "milestones", m, integer=True)
        if ms != sorted(ms):
            raise ArgumentError(f"SequentialLR: milestones must be increasing, got {ms}")
        self._schedulers, self._milestones = scheds, ms
        for g, b in zip(optimizer.param_groups, scheds[0].base_lrs):
            g["lr"] = b
        super().__init__(optimizer, last_epoch)

    _skip = ("optimizer", "_schedulers")

    def lr_at(self, epoch: int, base_lr: float, group: int = 0) -> float:
        i = bisect.bisect_right(self._milestones, epoch)
        start = self._milestones[i - 1] if i else 0
        s = self._schedulers[i]
        s.last_epoch = epoch - start
        return s.lr_at(epoch - start, s.base_lrs[group], group)

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        for s in self._schedulers:
            s._last_lr = list(self._last_lr)

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        subs = state_dict.get("_schedulers", [])
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "_schedulers"})
        for s, sd in zip(self._schedulers, subs):
            s.load_state_dict(sd)


class CosineAnnealingWarmRestarts(LRScheduler):
    """SGDR: cosine from initial_lr to eta_min over T_0 steps, restarting, each period T_mult times longer."""

    def __init__(self, optimizer, T_0: int, T_mult: int = 1, eta_min: float = 0.0, last_epoch: int = -1):  # noqa: N803
        self.T_0 = _num("CosineAnnealingWarmRestarts", "T_0", T_0, 0, integer=True, low_open=True)
        self.T_mult = _num("CosineAnnealingWarmRestarts", "T_mult", T_mult, 1, integer=True)
        self.eta_min = _num("CosineAnnealingWarmRestarts", "eta_min", eta_min)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, epoch: int, base_lr: float, group: int = 0) -> float:
        t_cur, t_i = epoch, self.T_0
        while t_cur >= t_i:
            t_cur -= t_i
            t_i *= self.T_mult
        return self.eta_min + (base_lr - self.eta_min) * (1 + math.cos(math.pi * t_cur / t_i)) / 2


class ReduceLROnPlateau:
    """Multiply each group's lr by ``factor`` when ``step(metric)`` has not improved for ``patience`` calls
    (PyTorch's rules: mode 'min'/'max', threshold 'rel'/'abs', cooldown, per-group min_lr, changes smaller
    than eps skipped)."""

    def __init__(self, optimizer, mode: str = "min", factor: float = 0.1, patience: int = 10,
                 threshold: float = 1e-4, threshold_mode: str = "rel", cooldown: int = 0, min_lr=0.0,
                 eps: float = 1e-8):
        if not hasattr(optimizer, "param_groups"):
            raise DTypeError(f"ReduceLROnPlateau: expected an optimizer (with param_groups), got "
                             f"{type(optimizer).__name__}")
        if mode not in ("min", "max"):
            raise ArgumentError(f"ReduceLROnPlateau: mode {mode!r} is unknown (use 'min' or 'max')")
        if threshold_mode not in ("rel", "abs"):
            raise ArgumentError(f"ReduceLROnPlateau: threshold mode {threshold_mode!r} is unknown (use 'rel' or 'abs')")
        _num("ReduceLROnPlateau", "factor", factor, 0, low_open=True)
        if factor >= 1.0:
            raise ArgumentError(f"ReduceLROnPlateau: factor should be < 1.0, got {factor}")
        self.optimizer = optimizer
        self.mode, self.factor, self.threshold, self.threshold_mode = mode, factor, threshold, threshold_mode
        self.patience = _num("ReduceLROnPlateau", "patience", patience, 0, integer=True)
        self.cooldown = _num("ReduceLROnPlateau", "cooldown", cooldown, 0, integer=True)
        self.min_lrs = _per_group("ReduceLROnPlateau", "min_lr", min_lr, len(optimizer.param_groups))
        self.eps = eps
        self.best = math.inf if mode == "min" else -math.inf
        self.num_bad_epochs = self.cooldown_counter = self.last_epoch = 0
        self._last_lr = [g["lr"] for g in optimizer.param_groups]

    def _better(self, a: float) -> bool:
        rel, t = self.threshold_mode == "rel", self.threshold
        if self.mode == "min":
            return a < (self.best * (1 - t) if rel else self.best - t)
        return a > (self.best * (1 + t) if rel else self.best + t)

    def step(self, metrics) -> None:
        current = float(metrics)
        if current != current:
            raise ArgumentError("ReduceLROnPlateau.step: the metric is NaN")
        self.last_epoch += 1
        if self._better(current):
            self.best, self.num_bad_epochs = current, 0
        else:
            self.num_bad_epochs += 1
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0
        if self.num_bad_epochs > self.patience:
            for g, lo in zip(self.optimizer.param_groups, self.min_lrs):
                old = float(g["lr"])
                new = max(old * self.factor, lo)
                if old - new > self.eps:
                    g["lr"] = new
            self.cooldown_counter, self.num_bad_epochs = self.cooldown, 0
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict: dict) -> None:
        if not isinstance(state_dict, dict) or "best" not in state_dict:
            raise ArgumentError("ReduceLROnPlateau.load_state_dict: expected the dict from state_dict()")
        self.__dict__.update(state_dict)


class WarmupCosineLR(LRScheduler):
    """Linear warmup over ``warmup_steps`` then cosine decay to ``min_lr`` at ``total_steps``."""

    def __init__(self, optimizer, warmup_steps: int, total_steps: int, min_lr: float, max_lr: float | None = None,
                 last_epoch: int = -1):
        self.warmup_steps, self.total_steps, self.min_lr, self.max_lr = warmup_steps, total_steps, min_lr, max_lr
        super().__init__(optimizer, last_epoch)

    def lr_at(self, epoch: int, base_lr: float, group: int = 0) -> float:
        return warmup_cosine(epoch, self.max_lr or base_lr, self.min_lr, self.warmup_steps, self.total_steps)


_LRScheduler = LRScheduler  # PyTorch's older name
