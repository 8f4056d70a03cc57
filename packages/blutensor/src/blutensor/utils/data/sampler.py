"""Samplers: which indices a DataLoader reads, and in which batches."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Iterator, Sized

from blutensor.errors import ArgumentError, DTypeError


class Sampler:
    """Yields dataset indices (``__iter__``), optionally with a ``__len__``."""

    def __iter__(self) -> Iterator:
        raise NotImplementedError(f"{type(self).__name__} must implement __iter__")


class SequentialSampler(Sampler):
    """0, 1, ..., len(data_source) - 1."""

    def __init__(self, data_source: Sized):
        self.data_source = data_source

    def __iter__(self):
        return iter(range(len(self.data_source)))

    def __len__(self) -> int:
        return len(self.data_source)


def _positive_int(owner: str, name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0:
        raise ArgumentError(f"{owner}: {name} should be a positive integer, got {type(v).__name__} {v!r:.40}")
    return int(v)


class RandomSampler(Sampler):
    """A fresh permutation each epoch (or ``num_samples`` draws with replacement), from ``generator``;
    without one, each epoch seeds its own generator from the global one (so ``bt.manual_seed`` fixes the
    order)."""

    def __init__(self, data_source: Sized, replacement: bool = False, num_samples: int | None = None,
                 generator=None):
        if not isinstance(replacement, bool):
            raise DTypeError(f"RandomSampler: replacement should be a bool, got {type(replacement).__name__}")
        self.data_source, self.replacement, self.generator = data_source, replacement, generator
        self._num_samples = None if num_samples is None else _positive_int("RandomSampler", "num_samples",
                                                                           num_samples)

    @property
    def num_samples(self) -> int:
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def _gen(self):
        from blutensor.random import Generator, default_generator

        if self.generator is not None:
            return self.generator
        seed = int(default_generator.integers(0, 2 ** 62, (1,), __import__("numpy"))[0])
        return Generator(seed)

    def __iter__(self):
        from blutensor.creation import randint
        from blutensor.random import randperm

        n = len(self.data_source)
        gen = self._gen()
        if self.replacement:
            yield from randint(0, n, (self.num_samples,), generator=gen).tolist()
            return
        for _ in range(self.num_samples // n):
            yield from randperm(n, generator=gen).tolist()
        yield from randperm(n, generator=gen).tolist()[:self.num_samples % n]

    def __len__(self) -> int:
        return self.num_samples


class SubsetRandomSampler(Sampler):
    """The given indices in a random order each epoch."""

    def __init__(self, indices, generator=None):
        self.indices, self.generator = list(indices), generator

    def __iter__(self):
        from blutensor.random import randperm

        for i in randperm(len(self.indices), generator=self.generator).tolist():
            yield self.indices[i]

    def __len__(self) -> int:
        return len(self.indices)


class BatchSampler(Sampler):
    """Groups a sampler's indices into lists of ``batch_size`` (the last shorter one kept unless
    ``drop_last``)."""

    def __init__(self, sampler: Iterable, batch_size: int, drop_last: bool):
        self.batch_size = _positive_int("BatchSampler", "batch_size", batch_size)
        if not isinstance(drop_last, bool):
            raise DTypeError(f"BatchSampler: drop_last should be a bool, got {type(drop_last).__name__}")
        self.sampler, self.drop_last = sampler, drop_last

    def __iter__(self):
        batch = []
        for idx in self.sampler:
            batch.append(idx)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else (n + self.batch_size - 1) // self.batch_size
