"""Datasets (PyTorch's ``torch.utils.data`` names): Dataset, IterableDataset, TensorDataset, Subset,
ConcatDataset, random_split."""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Iterator, Sequence
from typing import Any

from blutensor.errors import ArgumentError, DTypeError, ShapeError


class Dataset:
    """A map-style dataset: ``__getitem__(index)`` and, for samplers that need it, ``__len__``."""

    def __getitem__(self, index) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement __getitem__")

    def __add__(self, other: Dataset) -> ConcatDataset:
        return ConcatDataset([self, other])


class IterableDataset(Dataset):
    """A stream of samples: ``__iter__``. The DataLoader batches it in order (no sampler, no shuffle)."""

    def __iter__(self) -> Iterator:
        raise NotImplementedError(f"{type(self).__name__} must implement __iter__")

    def __getitem__(self, index):
        raise TypeError(f"{type(self).__name__} is an IterableDataset: iterate it, it has no __getitem__")


class TensorDataset(Dataset):
    """Sample i is ``tuple(t[i] for t in tensors)``; every tensor has the same first dimension."""

    def __init__(self, *tensors):
        from blutensor._tensor import Tensor

        for i, t in enumerate(tensors):
            if not isinstance(t, Tensor):
                raise DTypeError(f"TensorDataset: tensors[{i}] is a {type(t).__name__}, not a Tensor")
            if t.ndim == 0:
                raise ShapeError(f"TensorDataset: tensors[{i}] is 0-d; every tensor needs a first (sample) dimension")
        if tensors and any(t.shape[0] != tensors[0].shape[0] for t in tensors):
            raise ShapeError("TensorDataset: size mismatch between tensors: first dimensions "
                             f"{[t.shape[0] for t in tensors]}")
        self.tensors = tuple(tensors)

    def __getitem__(self, index):
        return tuple(t[index] for t in self.tensors)

    def __len__(self) -> int:
        return self.tensors[0].shape[0] if self.tensors else 0


class Subset(Dataset):
    """The samples of ``dataset`` at ``indices``, in that order."""

    def __init__(self, dataset: Dataset, indices: Sequence[int]):
        self.dataset = dataset
        self.indices = list(indices)

    def __getitem__(self, idx):
        if isinstance(idx, list):
            return self.dataset[[self.indices[i] for i in idx]]
        return self.dataset[self.indices[idx]]

    def __len__(self) -> int:
        return len(self.indices)


class ConcatDataset(Dataset):
    """Map-style datasets one after another."""

    def __init__(self, datasets):
        self.datasets = list(datasets)
        if not self.datasets:
            raise ArgumentError("ConcatDataset: datasets should not be an empty iterable")
        for i, d in enumerate(self.datasets):
            if isinstance(d, IterableDataset):
                raise DTypeError(f"ConcatDataset: datasets[{i}] is an IterableDataset; only map-style datasets "
                                 f"can be concatenated")
        self.cumulative_sizes = []
        total = 0
        for d in self.datasets:
            total += len(d)
            self.cumulative_sizes.append(total)

    def __len__(self) -> int:
        return self.cumulative_sizes[-1]

    def __getitem__(self, idx: int):
        n = len(self)
        if idx < 0:
            if -idx > n:
                raise IndexError(f"ConcatDataset: index {idx} out of range for length {n}")
            idx += n
        if idx >= n:
            raise IndexError(f"ConcatDataset: index {idx} out of range for length {n}")
        i = bisect.bisect_right(self.cumulative_sizes, idx)
        return self.datasets[i][idx - (self.cumulative_sizes[i - 1] if i else 0)]


def random_split(dataset: Dataset, lengths: Sequence, generator=None) -> list[Subset]:
    """Split into non-overlapping Subsets of the given lengths, or of fractions of ``len(dataset)`` (the
    remainder handed out one by one from the first, as PyTorch does); the order is drawn from ``generator``
    (default: the global one)."""
    from blutensor.random import randperm

    n = len(dataset)
    lengths = list(lengths)
    for i, v in enumerate(lengths):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or v < 0:
            raise ArgumentError(f"random_split: lengths[{i}] must be a non-negative int or fraction, got {v!r}")
    if lengths and math.isclose(sum(lengths), 1) and sum(lengths) <= 1 and any(
            not isinstance(v, numbers.Integral) for v in lengths):
        sizes = [int(math.floor(n * f)) for f in lengths]
        for i in range(n - sum(sizes)):
            sizes[i % len(sizes)] += 1
        lengths = sizes
    elif any(not isinstance(v, numbers.Integral) for v in lengths):
        raise ArgumentError(f"random_split: fractional lengths must sum to 1, got {lengths}")
    if sum(lengths) != n:
        raise ArgumentError(f"random_split: sum of input lengths ({sum(lengths)}) does not equal the length of the "
                            f"dataset ({n})")
    perm = randperm(n, generator=generator).tolist()
    out, start = [], 0
    for length in lengths:
        out.append(Subset(dataset, perm[start:start + length]))
        start += length
    return out
