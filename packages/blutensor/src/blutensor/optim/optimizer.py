"""Optimizer base: param groups, per-parameter state, zero_grad, state_dict round trip."""

from __future__ import annotations

from blutensor.errors import BluTensorError


class Optimizer:
    """Holds ``param_groups`` (dicts with 'params' and hyperparameters) and ``state`` per parameter."""

    defaults: dict = {}

    def __init__(self, params, defaults: dict):
        self.defaults = dict(defaults)
        params = list(params)
        if not params:
            raise BluTensorError(f"{type(self).__name__} got an empty parameter list")
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        self.param_groups: list[dict] = []
        self.state: dict = {}
        seen = set()
        for g in groups:
            g = {**self.defaults, **g, "params": list(g["params"])}
            for p in g["params"]:
                if id(p) in seen:
                    raise BluTensorError(f"{type(self).__name__}: a parameter appears in more than one group")
                if not p.requires_grad:
                    raise BluTensorError(f"{type(self).__name__}: parameter {p._desc()} does not require grad")
                seen.add(id(p))
            self.param_groups.append(g)

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
