"""Parameter: a leaf tensor that a Module registers and an optimizer updates."""

from __future__ import annotations

from blutensor._tensor import Tensor


class Parameter(Tensor):
    """A tensor that requires grad by default and is collected by ``Module.parameters()``."""

    def __init__(self, data: Tensor | None = None, requires_grad: bool = True):
        if data is None:
            from blutensor.creation import empty

            data = empty(0)
        if not isinstance(data, Tensor):
            from blutensor.errors import DTypeError

            raise DTypeError(f"Parameter: data must be a Tensor, got {type(data).__name__} (wrap it with "
                             f"blutensor.tensor())")
        if requires_grad and not data.dtype.is_floating_point:
            from blutensor.errors import AutogradError

            raise AutogradError(f"Parameter: only floating-point tensors can require grad, got {data._desc()} "
                                f"(pass requires_grad=False)")
        self._init(data._data, data.dtype, data.device)
        self.requires_grad = requires_grad

    def __repr__(self) -> str:
        return "Parameter containing:\n" + Tensor.__repr__(self)
