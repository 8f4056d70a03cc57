"""Shape and container modules: Identity, Flatten, Unflatten, ParameterList, ParameterDict."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from blutensor.errors import DTypeError, ShapeError
from blutensor.nn.module import Module
from blutensor.nn.parameter import Parameter


class Identity(Module):
    """Returns its input (any constructor arguments are ignored, as in PyTorch)."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, input):
        return input


class Flatten(Module):
    """Flattens dims ``start_dim`` .. ``end_dim`` (by default all but the batch dim)."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1):
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, input):
        return input.flatten(self.start_dim, self.end_dim)

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"


class Unflatten(Module):
    """Splits dim ``dim`` into ``unflattened_size`` (one entry may be -1)."""

    def __init__(self, dim: int, unflattened_size):
        super().__init__()
        sizes = tuple(unflattened_size)
        if not sizes or any(isinstance(s, bool) or not isinstance(s, int) for s in sizes):
            raise DTypeError(f"Unflatten: unflattened_size must be a non-empty tuple of ints, got {unflattened_size!r}")
        self.dim, self.unflattened_size = dim, sizes

    def forward(self, input):
        d = self.dim + input.ndim if self.dim < 0 else self.dim
        if not 0 <= d < input.ndim:
            raise ShapeError(f"Unflatten: dim {self.dim} is out of range for a {input.ndim}-d input")
        shape = tuple(input.shape)
        return input.reshape(*shape[:d], *self.unflattened_size, *shape[d + 1:])

    def extra_repr(self) -> str:
        return f"dim={self.dim}, unflattened_size={self.unflattened_size}"


def _as_param(owner: str, v) -> Parameter:
    from blutensor._tensor import Tensor

    if isinstance(v, Parameter):
        return v
    if isinstance(v, Tensor):
        return Parameter(v.detach(), requires_grad=v.dtype.is_floating_point)
    raise DTypeError(f"{owner}: expected a Parameter or Tensor, got {type(v).__name__}")


class ParameterList(Module):
    """A list of Parameters registered as '0', '1', ... (Tensors are wrapped as Parameters)."""

    def __init__(self, values: Iterable | None = None):
        super().__init__()
        for v in values or ():
            self.append(v)

    def append(self, value) -> ParameterList:
        self.register_parameter(str(len(self._parameters)), _as_param("ParameterList", value))
        return self

    def extend(self, values: Iterable) -> ParameterList:
        for v in values:
            self.append(v)
        return self

    def __getitem__(self, i):
        vals = list(self._parameters.values())
        return ParameterList(vals[i]) if isinstance(i, slice) else vals[i]

    def __setitem__(self, i: int, value) -> None:
        keys = list(self._parameters)
        self._parameters[keys[i]] = _as_param("ParameterList", value)

    def __len__(self) -> int:
        return len(self._parameters)

    def __iter__(self):
        return iter(self._parameters.values())

    def __iadd__(self, values: Iterable) -> ParameterList:
        return self.extend(values)

    def extra_repr(self) -> str:
        return f"{len(self)} parameters"


class ParameterDict(Module):
    """A dict of Parameters registered under their keys."""

    def __init__(self, parameters: Mapping | Iterable | None = None):
        super().__init__()
        if parameters is not None:
            self.update(parameters)

    def __getitem__(self, key: str) -> Parameter:
        return self._parameters[key]

    def __setitem__(self, key: str, value) -> None:
        if not isinstance(key, str):
            raise DTypeError(f"ParameterDict: keys must be str, got {type(key).__name__}")
        self.register_parameter(key, _as_param("ParameterDict", value))

    def __delitem__(self, key: str) -> None:
        del self._parameters[key]

    def __contains__(self, key) -> bool:
        return key in self._parameters

    def __len__(self) -> int:
        return len(self._parameters)

    def __iter__(self):
        return iter(self._parameters)

    def keys(self):
        return self._parameters.keys()

    def items(self):
        return self._parameters.items()

    def values(self):
        return self._parameters.values()

    def pop(self, key: str) -> Parameter:
        return self._parameters.pop(key)

    def update(self, parameters: Mapping | Iterable) -> None:
        items = parameters.items() if isinstance(parameters, Mapping) else parameters
        for k, v in items:
            self[k] = v
