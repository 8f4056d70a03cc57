"""Optimizer base: param groups, per-parameter state, zero_grad, state_dict round trip."""

from __future__ import annotations

import numbers

from blutensor.errors import ArgumentError, BluTensorError, DTypeError, ShapeError


def check_hyper(opt: str, name: str, value, low: float = 0.0, high: float | None = None) -> None:
    """Raise ArgumentError unless ``value`` is a number in [low, high) (a Tensor value is left unchecked)."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return  # a tensor learning rate (CUDA graphs): its value is not read here
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentError(f"{opt}: invalid hyperparameters: {name}={value!r} must be a number")
    if value < low or (high is not None and value >= high) or value != value:
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ArgumentError(f"{opt}: invalid hyperparameters: {name}={value!r} must be {bound}")


def _param_list(opt: str, params, where: str) -> list:
    """``params`` as a list of leaf tensors; errors name the optimizer and the position at fault."""
    from blutensor._tensor import Tensor

    if isinstance(params, Tensor):
        raise DTypeError(f"{opt}: {where} must be an iterable of Tensors, got a single {params._desc()} "
                         f"(wrap it in a list)")
    if hasattr(params, "parameters") and hasattr(params, "forward"):
        raise DTypeError(f"{opt}: {where} is a {type(params).__name__} module; pass its .parameters()")
    try:
        out = list(params)
    except TypeError:
        raise DTypeError(f"{opt}: {where} must be an iterable of Tensors or dicts, got "
                         f"{type(params).__name__}") from None
    for i, p in enumerate(out):
        if not isinstance(p, Tensor):
            raise DTypeError(f"{opt}: {where}[{i}] is a {type(p).__name__}, not a Tensor")
        if p.grad_fn is not None:
            raise ArgumentError(f"{opt}: {where}[{i}] {p._desc()} is not a leaf tensor (it has a grad_fn); "
                                f"optimize the leaves it was computed from")
    return out


def check_grads(opt: str, groups) -> None:
    """Raise before any update if a parameter's .grad does not match it in shape or device."""
    for g in groups:
        for p in g["params"]:
            gr = p.grad
            if gr is not None and (gr.shape != p.shape or gr.device != p.device):
                raise ShapeError(f"{opt}.step: parameter {p._desc()} has a gradient {gr._desc()} of another "
                                 f"shape or device")


class Optimizer:
    """Holds ``param_groups`` (dicts with 'params' and hyperparameters) and ``state`` per parameter."""

    defaults: dict = {}

    def __init__(self, params, defaults: dict):
        self.defaults = dict(defaults)
        name = type(self).__name__
        from blutensor._tensor import Tensor

        if isinstance(params, Tensor) or (hasattr(params, "parameters") and hasattr(params, "forward")):
            _param_list(name, params, "params")  # raises the descriptive error
        try:
            params = list(params)
        except TypeError:
            raise DTypeError(f"{name}: params must be an iterable of Tensors or dicts, got "
                             f"{type(params).__name__}") from None
        if not params:
            raise BluTensorError(f"{name} got an empty parameter list")
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        self.param_groups: list[dict] = []
        self.state: dict = {}
        for gi, g in enumerate(groups):
            self._add_group(g, gi, groups is params)

    def add_param_group(self, param_group: dict) -> None:
        """Append a group (a dict with 'params' and any hyperparameters; the rest from the defaults), e.g.
        to unfreeze layers while training."""
        self._add_group(param_group, len(self.param_groups), True)

    def _add_group(self, g, gi: int, explicit: bool) -> None:
        name = type(self).__name__
        if not isinstance(g, dict) or "params" not in g:
            raise ArgumentError(f"{name}: param group {gi} must be a dict with a 'params' key, got "
                                f"{type(g).__name__}" + (f" with keys {sorted(g)}" if isinstance(g, dict) else ""))
        where = f"param group {gi} 'params'" if explicit else "params"
        g = {**self.defaults, **g, "params": _param_list(name, g["params"], where)}
        seen = {id(p) for h in self.param_groups for p in h["params"]}
        for p in g["params"]:
            if id(p) in seen:
                raise BluTensorError(f"{name}: a parameter appears in more than one group")
            if not p.requires_grad:
                raise BluTensorError(f"{name}: parameter {p._desc()} does not require grad")
            seen.add(id(p))
        self._check_group(g)
        self.param_groups.append(g)

    def _check_group(self, group: dict) -> None:
        """Subclasses raise ArgumentError for a bad hyperparameter of a group (defaults merged in)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad._data.fill(0)

    def _ordered(self):
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict:
        """{'state': {index: {name: Tensor|number}}, 'param_groups': [hyperparameters + indices]}."""
        order = {id(p): i for i, p in enumerate(self._ordered())}
        state = {order[id(p)]: dict(s) for p, s in ((p, self.state[p]) for p in self._ordered() if p in self.state)}
        groups = []
        for g in self.param_groups:
            h = {k: v for k, v in g.items() if k != "params"}
            h["params"] = [order[id(p)] for p in g["params"]]
            groups.append(h)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict) -> None:
        params = self._ordered()
        if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
            got = f"keys {sorted(map(str, sd))}" if isinstance(sd, dict) else type(sd).__name__
            raise ArgumentError(f"{type(self).__name__}.load_state_dict: expected a dict with 'state' and "
                                f"'param_groups' (from Optimizer.state_dict()), got {got}")
        if len(sd["param_groups"]) != len(self.param_groups):
            raise BluTensorError(f"optimizer state has {len(sd['param_groups'])} groups, optimizer has "
                                 f"{len(self.param_groups)}")
        for g, h in zip(self.param_groups, sd["param_groups"]):
            if len(h["params"]) != len(g["params"]):
                raise BluTensorError("optimizer state groups do not match the parameters' group sizes")
            g.update({k: v for k, v in h.items() if k != "params"})
        self.state = {}
        from blutensor._tensor import Tensor

        for i, s in sd["state"].items():
            if not 0 <= int(i) < len(params):
                raise ArgumentError(f"{type(self).__name__}.load_state_dict: state for parameter index {i}, but "
                                    f"the optimizer has {len(params)} parameters")
            p = params[int(i)]
            st = {}
            for k, v in s.items():
                if isinstance(v, Tensor):
                    if tuple(v.shape) != tuple(p.shape) and v.ndim > 0:
                        raise BluTensorError(f"optimizer state '{k}' of parameter {i} has shape {tuple(v.shape)}, "
                                             f"parameter has {tuple(p.shape)}")
                    v = v.detach().to(p.device)
                    v = Tensor._from_data(v._data.copy(), v.dtype, v.device)
                st[k] = v
            self.state[p] = st

    def step(self):
        raise NotImplementedError
