"""Parameter: a leaf tensor that a Module registers and an optimizer updates."""

from __future__ import annotations

from blutensor._tensor import Tensor


class Parameter(Tensor):
    """A tensor that requires grad by default and is collected by ``Module.parameters()``."""

    def __init__(self, data: Tensor | None = None, requires_grad: bool = True):
        if data is None:
            from blutensor.creation import empty

            data = empty(0)
        self._init(data._data, data.dtype, data.device)
        self.requires_grad = requires_grad

    def __repr__(self) -> str:
        return "Parameter containing:\n" + Tensor.__repr__(self)
