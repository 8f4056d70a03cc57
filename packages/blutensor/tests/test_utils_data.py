"""blutensor.utils.data against torch.utils.data: batches, collation (dtypes and nesting), samplers,
drop_last, shuffling from a Generator, random_split, IterableDataset, and the refused options."""

from __future__ import annotations

from collections import namedtuple

import blutensor as bt
import numpy as np
import pytest
import torch
import torch.utils.data as tud
from blutensor.utils import data as bud
from conftest import host

Point = namedtuple("Point", "x y")


class Samples(bud.Dataset):
    """Mixed samples: a dict with a tensor, an int, a float, a str and a namedtuple."""

    def __init__(self, lib):
        self.lib = lib

    def __len__(self):
        return 7

    def __getitem__(self, i):
        t = self.lib.arange(3, dtype=self.lib.float32) * i
        return {"t": t, "i": i, "f": i / 2, "s": f"s{i}", "p": Point(i, (i, -i))}


def _same(a, b):
    """Recursive equality of a blutensor batch and a torch batch: values, dtypes, container types."""
    if isinstance(b, torch.Tensor):
        assert isinstance(a, bt.Tensor) and a.dtype.name == str(b.dtype).split(".")[1], (a, b)
        np.testing.assert_array_equal(host(a), b.numpy())
    elif isinstance(b, dict):
        assert isinstance(a, dict) and list(a) == list(b)
        for k in b:
            _same(a[k], b[k])
    elif isinstance(b, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), (type(a), type(b))
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("batch_size,drop_last", [(3, False), (3, True), (1, False), (None, False)])
def test_batches_and_collation_match_torch(batch_size, drop_last):
    ours = list(bud.DataLoader(Samples(bt), batch_size=batch_size, drop_last=drop_last))
    theirs = list(tud.DataLoader(Samples(torch), batch_size=batch_size, drop_last=drop_last))
    assert len(ours) == len(theirs) == len(bud.DataLoader(Samples(bt), batch_size=batch_size, drop_last=drop_last))
    for a, b in zip(ours, theirs):
        _same(a, b)


def test_tensor_dataset_shuffle_is_reproducible_per_generator():
    x, y = bt.arange(10).view(10, 1) * 1.0, bt.arange(10)
    ds = bud.TensorDataset(x, y)
    assert len(ds) == 10 and host(ds[3][1]) == 3

    def epoch(seed):
        return [host(b[1]).tolist() for b in bud.DataLoader(ds, batch_size=4, shuffle=True,
                                                            generator=bt.Generator(seed))]

    a, b, c = epoch(1), epoch(1), epoch(2)
    assert a == b and a != c and sorted(sum(a, [])) == list(range(10)) and [len(v) for v in a] == [4, 4, 2]
    g = bt.Generator(5)
    dl = bud.DataLoader(ds, batch_size=10, shuffle=True, generator=g)
    e1, e2 = host(next(iter(dl))[1]).tolist(), host(next(iter(dl))[1]).tolist()
    assert e1 != e2  # the generator advances: a new order every epoch
    for xb, yb in bud.DataLoader(ds, batch_size=3, shuffle=True):  # tensors stay paired
        np.testing.assert_array_equal(host(xb)[:, 0], host(yb))


def test_samplers_subset_concat_and_random_split():
    ds = bud.TensorDataset(bt.arange(10))
    bs = bud.BatchSampler(bud.SequentialSampler(range(7)), 3, drop_last=False)
    assert list(bs) == list(tud.BatchSampler(tud.SequentialSampler(range(7)), 3, False)) and len(bs) == 3
    got = [host(b[0]).tolist() for b in bud.DataLoader(ds, batch_sampler=[[0, 9], [4]])]
    assert got == [[0, 9], [4]]
    got = [host(b[0]).tolist() for b in bud.DataLoader(ds, sampler=[5, 2, 7], batch_size=2)]
    assert got == [[5, 2], [7]]
    rs = list(bud.RandomSampler(range(5), replacement=True, num_samples=20, generator=bt.Generator(0)))
    assert len(rs) == 20 and set(rs) <= set(range(5))
    parts = bud.random_split(ds, [0.5, 0.3, 0.2], generator=bt.Generator(3))
    assert [len(p) for p in parts] == [5, 3, 2]
    idx = sorted(i for p in parts for i in p.indices)
    assert idx == list(range(10))
    cat = bud.ConcatDataset([ds, bud.Subset(ds, [1, 2])])
    assert len(cat) == 12 and host(cat[11][0]) == 2 and host(cat[-1][0]) == 2
    with pytest.raises(bt.ArgumentError, match="does not equal the length of the dataset"):
        bud.random_split(ds, [3, 3])


class Stream(bud.IterableDataset):
    def __iter__(self):
        return iter(range(7))


def test_iterable_dataset_batches_in_order():
    got = [host(b).tolist() for b in bud.DataLoader(Stream(), batch_size=3)]
    assert got == [b.tolist() for b in tud.DataLoader(_TorchStream(), batch_size=3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [host(b).tolist() for b in bud.DataLoader(Stream(), batch_size=3, drop_last=True)] == [[0, 1, 2],
                                                                                                  [3, 4, 5]]
    with pytest.raises(bt.ArgumentError, match="shuffle=True is not possible with an IterableDataset"):
        bud.DataLoader(Stream(), shuffle=True)


class _TorchStream(tud.IterableDataset):
    def __iter__(self):
        return iter(range(7))


def test_custom_collate_and_refused_options():
    ds = bud.TensorDataset(bt.arange(6))
    out = list(bud.DataLoader(ds, batch_size=4, collate_fn=lambda b: len(b)))
    assert out == [4, 2]
    with pytest.raises(bt.ArgumentError, match="worker processes are not supported"):
        bud.DataLoader(ds, num_workers=2)
    with pytest.raises(bt.ArgumentError, match="pin_memory=True is not supported"):
        bud.DataLoader(ds, pin_memory=True)
    with pytest.raises(bt.ArgumentError, match="batch_size should be a positive integer"):
        bud.DataLoader(ds, batch_size=0)
    with pytest.raises(bt.ArgumentError, match="mutually exclusive with shuffle"):
        bud.DataLoader(ds, sampler=[0], shuffle=True)
    with pytest.raises(bt.ShapeError, match="size mismatch between tensors"):
        bud.TensorDataset(bt.zeros(3), bt.zeros(4))
    with pytest.raises(bt.ShapeError, match="equal size"):
        bud.default_collate([bt.zeros(2), bt.zeros(3)])
    with pytest.raises(bt.DTypeError, match="pass a collate_fn"):
        bud.default_collate([object(), object()])


def test_tensor_dataset_batches_stay_on_their_device(device):
    x = bt.arange(12, device=device).view(6, 2)
    y = bt.arange(6, device=device) * 1.0
    batches = list(bud.DataLoader(bud.TensorDataset(x, y), batch_size=4, shuffle=True, generator=bt.Generator(0)))
    assert [b[0].shape for b in batches] == [(4, 2), (2, 2)]
    for xb, yb in batches:
        assert xb.device == yb.device == bt.device(device)
        np.testing.assert_array_equal(host(xb)[:, 0] // 2, host(yb))
