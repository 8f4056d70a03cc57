"""``default_collate`` / ``default_convert``: a list of samples -> one batch, PyTorch's rules."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from blutensor.errors import DTypeError, ShapeError


def default_convert(data: Any) -> Any:
    """What a DataLoader with ``batch_size=None`` yields: NumPy arrays become Tensors, containers are
    converted element by element, everything else is left as it is."""
    from blutensor.creation import tensor

    if isinstance(data, np.ndarray) and data.dtype.kind in "biuf":
        return tensor(data)
    if isinstance(data, Mapping):
        return type(data)({k: default_convert(v) for k, v in data.items()}) if type(data) is not dict else {
            k: default_convert(v) for k, v in data.items()}
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(default_convert(d) for d in data))
    if isinstance(data, list | tuple):
        return [default_convert(d) for d in data]  # tuples become lists, as in PyTorch
    return data


def default_collate(batch: Sequence) -> Any:
    """Stack a list of samples: Tensors -> ``stack`` (new leading batch dim), NumPy arrays -> a stacked
    Tensor, Python floats -> float64 Tensor, ints -> int64, bools -> bool, str -> the list, dicts -> a dict
    of collated values, tuples/lists -> a list collated position by position (namedtuples keep their type)."""
    from blutensor._tensor import Tensor
    from blutensor.creation import tensor
    from blutensor.functional import stack

    if not len(batch):
        raise ShapeError("default_collate: got an empty batch")
    elem = batch[0]
    kind = type(elem)
    if isinstance(elem, Tensor):
        shapes = {tuple(b.shape) if isinstance(b, Tensor) else None for b in batch}
        if len(shapes) != 1 or None in shapes:
            raise ShapeError(f"default_collate: stack expects each sample tensor to be equal size, got shapes "
                             f"{sorted(map(str, shapes))}")
        return stack(list(batch), 0)
    if isinstance(elem, np.ndarray | np.generic) and not isinstance(elem, np.str_ | np.bytes_):
        if np.asarray(elem).dtype.kind not in "biuf":
            raise DTypeError(f"default_collate: NumPy samples of dtype {np.asarray(elem).dtype} cannot be batched "
                             f"(numbers or bools only)")
        return tensor(np.stack([np.asarray(b) for b in batch]))
    if isinstance(elem, bool):
        return tensor(list(batch))
    if isinstance(elem, numbers.Integral):
        return tensor(list(batch), dtype="int64")
    if isinstance(elem, numbers.Real):
        return tensor(list(batch), dtype="float64")
    if isinstance(elem, str | bytes):
        return list(batch)
    if isinstance(elem, Mapping):
        out = {k: default_collate([d[k] for d in batch]) for k in elem}
        if kind is dict:
            return out
        try:
            return kind(out)
        except TypeError:
            return out
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):
        return kind(*(default_collate(s) for s in zip(*batch)))
    if isinstance(elem, Sequence):
        n = len(elem)
        if any(len(b) != n for b in batch):
            raise ShapeError("default_collate: each element in the batch should be of equal size, got lengths "
                             f"{sorted({len(b) for b in batch})}")
        return [default_collate(list(s)) for s in zip(*batch)]  # a list for tuples too, as PyTorch
    raise DTypeError(f"default_collate: samples must be Tensors, NumPy arrays, numbers, str, dicts or sequences "
                     f"of them; got {kind.__module__}.{kind.__qualname__} (pass a collate_fn for it)")
