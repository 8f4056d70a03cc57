"""Sorting, selection, scans and sampling: sort, topk, cumsum, cumprod, cummax, cummin, multinomial (PyTorch's
names, signatures and result types: (values, indices) pairs, ``dtype=`` casts, several ops per call).
``argsort`` and ``logcumsumexp`` are op-table rows, generated into ``blutensor.functional``.

Values come from ``take_along_dim`` with the sorting indices, so their gradient flows back to the chosen
elements; the index ops themselves have no gradient.
"""

from __future__ import annotations

from collections import namedtuple

from blutensor.errors import ArgumentError, DTypeError, ShapeError
from blutensor.ops.dispatch import apply
from blutensor.ops.surface import int_arg as _int

#: (values, indices) results, as PyTorch's torch.return_types
SortResult = namedtuple("sort", ["values", "indices"])
TopKResult = namedtuple("topk", ["values", "indices"])
CumResult = namedtuple("cummax", ["values", "indices"])


def _tensor(op: str, a) -> None:
    if not hasattr(a, "_data"):
        raise DTypeError(f"{op}: expected a Tensor, got {type(a).__name__}")




def _take(a, idx, dim):
    if a.ndim == 0:
        return apply("take_along_dim", a.reshape(1), idx.reshape(1), dim=0).reshape(())
    return apply("take_along_dim", a, idx, dim=dim)


def sort(a, dim: int = -1, descending: bool = False, stable: bool = False) -> SortResult:
    """(values, indices) of ``a`` sorted along ``dim`` (ascending unless ``descending``)."""
    from blutensor.functional import argsort  # generated from the op table's row

    idx = argsort(a, dim, descending, stable)
    return SortResult(_take(a, idx, dim), idx)


def topk(a, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> TopKResult:  # noqa: A002
    """The ``k`` largest (or smallest) elements along ``dim`` and their indices, largest first."""
    _tensor("topk", a)
    idx = apply("topk_indices", a, k=_int("topk", "k", k), dim=_int("topk", "dim", dim), largest=bool(largest))
    return TopKResult(_take(a, idx, dim), idx)


def cumsum(a, dim: int, dtype=None):
    _tensor("cumsum", a)
    if dtype is not None:
        from blutensor.dtypes import as_dtype

        a = a.to(as_dtype(dtype))
    return apply("cumsum", a, dim=_int("cumsum", "dim", dim))


def cumprod(a, dim: int, dtype=None):
    _tensor("cumprod", a)
    if dtype is not None:
        from blutensor.dtypes import as_dtype

        a = a.to(as_dtype(dtype))
    return apply("cumprod", a, dim=_int("cumprod", "dim", dim))


def cummax(a, dim: int) -> CumResult:
    """Running maximum along ``dim`` and the index where it was reached (the last such index)."""
    _tensor("cummax", a)
    idx = apply("cumext_indices", a, dim=_int("cummax", "dim", dim), greater=True)
    return CumResult(_take(a, idx, dim), idx)


def cummin(a, dim: int) -> CumResult:
    _tensor("cummin", a)
    idx = apply("cumext_indices", a, dim=_int("cummin", "dim", dim), greater=False)
    return CumResult(_take(a, idx, dim), idx)


def multinomial(input, num_samples: int, replacement: bool = False, *, generator=None):  # noqa: A002
    """``num_samples`` category indices per row of the (unnormalised) weights ``input`` (1-D or 2-D), drawn
    from the Philox generator: with replacement by inverse CDF, without by the exponential-race trick (the
    k smallest E_i / w_i are a weighted sample without replacement)."""
    import numpy as np

    from blutensor._tensor import Tensor
    from blutensor.creation import _generator, _on
    from blutensor.dtypes import int64
    from blutensor.ops._util import xp_of

    _tensor("multinomial", input)
    if not input.dtype.is_floating_point:
        raise DTypeError(f"multinomial: weights must be floating point, got {input._desc()}")
    if input.ndim not in (1, 2):
        raise ShapeError(f"multinomial: weights must be 1-D or 2-D, got shape {tuple(input.shape)}")
    n = _int("multinomial", "num_samples", num_samples)
    w = input.detach().float() if input.dtype.name in ("bfloat16", "float16") else input.detach()
    arr = w._data.reshape(-1, w.shape[-1]).astype(np.float64)
    xp = xp_of(arr)
    C = arr.shape[1]
    if n <= 0:
        raise ArgumentError(f"multinomial: num_samples must be positive, got {n}")
    if not replacement and n > C:
        raise ArgumentError(f"multinomial: cannot draw {n} samples without replacement from {C} categories")
    if bool((~xp.isfinite(arr)).any()) or bool((arr < 0).any()):
        raise ArgumentError("multinomial: weights must be finite and non-negative")
    tot = arr.sum(axis=1, keepdims=True)
    if bool((tot <= 0).any()):
        raise ArgumentError("multinomial: every row of weights must have a positive sum")
    if not replacement and bool(((arr > 0).sum(axis=1) < n).any()):
        raise ArgumentError(f"multinomial: fewer than {n} categories with non-zero weight in a row (without "
                            f"replacement)")
    gen = _generator(generator)
    with _on(input.device, xp):
        u = gen.uniform((arr.shape[0], n if replacement else C), xp, np.float64)
        if replacement:
            cdf = xp.cumsum(arr / tot, axis=1)
            cdf[:, -1] = 1.0
            # the first category whose cdf exceeds u (never a zero-weight one: its cdf equals its predecessor's)
            out = xp.minimum((u[:, :, None] >= cdf[:, None, :]).sum(axis=2), C - 1)
        else:
            with np.errstate(divide="ignore"):
                key = -xp.log1p(-u) / arr
            out = xp.argsort(key, axis=1, kind="stable")[:, :n]
        out = out.astype(np.int64)
    if input.ndim == 1:
        out = out.reshape(-1)
    return Tensor._from_data(out, int64, input.device)
