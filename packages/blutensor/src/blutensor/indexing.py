"""``scatter`` under PyTorch's name and signature (a Tensor ``src`` or a number ``value``).

The other index ops along a dim (gather, scatter_add, index_select, index_add, take_along_dim) are op-table
rows whose functions and Tensor methods (with in-place ``_`` forms) are generated (``blutensor.functional``)."""

from __future__ import annotations

import numbers

from blutensor.errors import DTypeError
from blutensor.ops.dispatch import apply
from blutensor.ops.surface import index_tensor as _index
from blutensor.ops.surface import int_arg


def _dim(op: str, dim) -> int:
    return int_arg(op, "dim", dim)


def _src(op, input, src):
    from blutensor._tensor import Tensor, _scalar

    if isinstance(src, Tensor):
        return src
    if isinstance(src, numbers.Real):
        return _scalar(src)
    raise DTypeError(f"{op}: src must be a Tensor or a number, got {type(src).__name__}")


def scatter(input, dim: int, index, src=None, value=None):  # noqa: A002
    """A copy of ``input`` with ``src`` (a Tensor, or ``value``) written at ``index`` along ``dim``."""
    if src is None:
        src = value
    if src is None:
        raise DTypeError("scatter: give src (a Tensor or a number) or value")
    return apply("scatter", input, _index("scatter", index), _src("scatter", input, src), dim=_dim("scatter", dim))
