"""DataLoader: batches from a Dataset through a sampler and a collate function, in this process."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable
from typing import Any

from blutensor.errors import ArgumentError, DTypeError
from blutensor.utils.data.collate import default_collate, default_convert
from blutensor.utils.data.dataset import Dataset, IterableDataset, TensorDataset
from blutensor.utils.data.sampler import BatchSampler, RandomSampler, Sampler, SequentialSampler


class DataLoader:
    """PyTorch's ``DataLoader`` with the main-process loader (``num_workers=0``).

    ``batch_size`` (None: samples one by one through ``default_convert``), ``shuffle`` (a RandomSampler
    drawing from ``generator``), ``sampler`` / ``batch_sampler``, ``drop_last``, ``collate_fn`` (default
    :func:`default_collate`). Worker processes and pinned memory are not available: ``num_workers > 0`` and
    ``pin_memory=True`` are refused by name rather than ignored."""

    def __init__(self, dataset: Dataset, batch_size: int | None = 1, shuffle: bool | None = None,
                 sampler: Sampler | Iterable | None = None, batch_sampler: Sampler | Iterable | None = None,
                 num_workers: int = 0, collate_fn: Callable | None = None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0, worker_init_fn: Callable | None = None,
                 generator=None, *, prefetch_factor: int | None = None, persistent_workers: bool = False):
        if isinstance(num_workers, bool) or not isinstance(num_workers, numbers.Integral) or num_workers < 0:
            raise ArgumentError(f"DataLoader: num_workers must be a non-negative int, got {num_workers!r}")
        if num_workers > 0 or persistent_workers or prefetch_factor is not None or worker_init_fn is not None:
            raise ArgumentError(f"DataLoader: worker processes are not supported (num_workers={num_workers}, "
                                f"persistent_workers={persistent_workers}, prefetch_factor={prefetch_factor}, "
                                f"worker_init_fn={worker_init_fn!r:.30}); blutensor loads in the main process: "
                                f"use num_workers=0")
        if pin_memory:
            raise ArgumentError("DataLoader: pin_memory=True is not supported; move batches with "
                                ".to(device) in the loop")
        if timeout:
            raise ArgumentError(f"DataLoader: timeout={timeout!r} only applies to worker processes; use 0")
        if batch_size is not None:
            if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size <= 0:
                raise ArgumentError(f"DataLoader: batch_size should be a positive integer or None, got "
                                    f"{type(batch_size).__name__} {batch_size!r:.40}")
        for name, v in (("drop_last", drop_last), ("shuffle", shuffle)):
            if v is not None and not isinstance(v, bool):
                raise DTypeError(f"DataLoader: {name} should be a bool, got {type(v).__name__} {v!r:.40}")
        if collate_fn is not None and not callable(collate_fn):
            raise DTypeError(f"DataLoader: collate_fn must be callable, got {type(collate_fn).__name__}")
        from blutensor.random import Generator

        if generator is not None and not isinstance(generator, Generator):
            raise DTypeError(f"DataLoader: generator must be a blutensor.Generator, got {type(generator).__name__}")
        self.dataset, self.num_workers, self.pin_memory, self.timeout = dataset, 0, False, 0
        self.generator, self.drop_last = generator, drop_last
        self._iterable = isinstance(dataset, IterableDataset)
        if self._iterable:
            if shuffle:
                raise ArgumentError("DataLoader: shuffle=True is not possible with an IterableDataset (shuffle the "
                                    "stream inside the dataset)")
            if sampler is not None or batch_sampler is not None:
                raise ArgumentError("DataLoader: an IterableDataset takes no sampler or batch_sampler")
        elif not hasattr(dataset, "__getitem__"):
            raise DTypeError(f"DataLoader: dataset must be a Dataset (with __getitem__) or an IterableDataset, got "
                             f"{type(dataset).__name__}")
        if sampler is not None and shuffle:
            raise ArgumentError("DataLoader: sampler option is mutually exclusive with shuffle")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ArgumentError("DataLoader: batch_sampler option is mutually exclusive with batch_size, "
                                    "shuffle, sampler, and drop_last")
            batch_size, drop_last = None, False
        elif batch_size is None and drop_last:
            raise ArgumentError("DataLoader: batch_size=None option disables auto-batching and is mutually "
                                "exclusive with drop_last")
        if sampler is None and not self._iterable:
            sampler = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
        if batch_size is not None and batch_sampler is None and not self._iterable:
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)
        self.batch_size, self.sampler, self.batch_sampler = batch_size, sampler, batch_sampler
        self._auto_collation = batch_sampler is not None or (self._iterable and batch_size is not None)
        if collate_fn is None:
            collate_fn = default_collate if self._auto_collation else default_convert
        self.collate_fn = collate_fn

    def _fetch(self, indices: list) -> Any:
        ds = self.dataset
        if self.collate_fn is default_collate and type(ds) is TensorDataset and ds.tensors:
            from blutensor.creation import tensor

            idx = tensor(indices, dtype="int64", device=ds.tensors[0].device)
            return tuple(t[idx.to(t.device)] for t in ds.tensors)  # one gather per tensor == stacked samples
        return self.collate_fn([ds[i] for i in indices])

    def __iter__(self):
        if self._iterable:
            yield from self._iter_stream()
        elif self._auto_collation:
            for indices in self.batch_sampler:
                yield self._fetch(list(indices))
        else:
            for i in self.sampler:
                yield self.collate_fn(self.dataset[i])

    def _iter_stream(self):
        if self.batch_size is None:
            for sample in self.dataset:
                yield self.collate_fn(sample)
            return
        batch = []
        for sample in self.dataset:
            batch.append(sample)
            if len(batch) == self.batch_size:
                yield self.collate_fn(batch)
                batch = []
        if batch and not self.drop_last:
            yield self.collate_fn(batch)

    def __len__(self) -> int:
        if self._iterable:
            n = len(self.dataset)  # TypeError from the dataset itself when it has no length, as in PyTorch
            if self.batch_size is None:
                return n
            return n // self.batch_size if self.drop_last else -(-n // self.batch_size)
        return len(self.batch_sampler) if self._auto_collation else len(self.sampler)
