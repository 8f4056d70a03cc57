"""Index ops along a dim under PyTorch's names: gather, scatter, scatter_add, index_select, index_add,
take_along_dim (functions; the Tensor methods and their in-place ``_`` forms are bound in ``_tensor``)."""

from __future__ import annotations

import numbers

from blutensor.errors import DTypeError
from blutensor.ops.dispatch import apply


def _index(op: str, index, name: str = "index"):
    from blutensor._tensor import Tensor

    if not isinstance(index, Tensor) or index.dtype.is_floating_point or index.dtype.name == "bool":
        got = index._desc() if isinstance(index, Tensor) else type(index).__name__
        raise DTypeError(f"{op}: {name} must be an integer Tensor (int64), got {got}")
    return index


def _dim(op: str, dim) -> int:
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise DTypeError(f"{op}: dim must be an int, got {type(dim).__name__} {dim!r}")
    return int(dim)


def gather(input, dim: int, index):  # noqa: A002
    """out[i][j][k] = input[i][index[i][j][k]][k] for dim 1 (and likewise for the other dims)."""
    return apply("gather", input, _index("gather", index), dim=_dim("gather", dim))


def take_along_dim(input, indices, dim: int | None = None):  # noqa: A002
    """Values at ``indices`` along ``dim`` (broadcasting the other dims), or of the flattened input."""
    return apply("take_along_dim", input, _index("take_along_dim", indices, "indices"),
                 dim=None if dim is None else _dim("take_along_dim", dim))


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


def scatter_add(input, dim: int, index, src):  # noqa: A002
    """A copy of ``input`` with ``src`` added at ``index`` along ``dim`` (repeated indices accumulate)."""
    from blutensor._tensor import Tensor

    if not isinstance(src, Tensor):
        raise DTypeError(f"scatter_add: src must be a Tensor, got {type(src).__name__}")
    return apply("scatter_add", input, _index("scatter_add", index), src, dim=_dim("scatter_add", dim))


def index_select(input, dim: int, index):  # noqa: A002
    return apply("index_select", input, _index("index_select", index), dim=_dim("index_select", dim))


def index_add(input, dim: int, index, source, *, alpha=1):  # noqa: A002
    """A copy of ``input`` with ``alpha * source`` added at rows ``index`` of ``dim``."""
    from blutensor._tensor import Tensor

    if not isinstance(source, Tensor):
        raise DTypeError(f"index_add: source must be a Tensor, got {type(source).__name__}")
    return apply("index_add", input, _index("index_add", index), source, dim=_dim("index_add", dim), alpha=alpha)
