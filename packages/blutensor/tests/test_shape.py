"""Shape ops: views share storage and version counter (view, reshape, transpose, permute, expand,
squeeze/unsqueeze, basic indexing), copies where needed (contiguous, advanced indexing, cat, stack,
split, chunk), and their gradients."""

from __future__ import annotations

import blutensor as bt
import numpy as np
import pytest
import torch
from conftest import check_forward, check_vs_torch, gradcheck, host, rng

X = rng(3).standard_normal((2, 3, 4))

VIEWS = {
    "view": (lambda a: a.view(6, 4), lambda a: a.view(6, 4)),
    "view_neg": (lambda a: a.view(-1), lambda a: a.view(-1)),
    "reshape": (lambda a: a.reshape(4, 6), lambda a: a.reshape(4, 6)),
    "transpose": (lambda a: a.transpose(0, 2), lambda a: a.transpose(0, 2)),
    "permute": (lambda a: a.permute(2, 0, 1), lambda a: a.permute(2, 0, 1)),
    "mT": (lambda a: a.mT, lambda a: a.mT),
    "expand": (lambda a: a[:, :1].expand(2, 5, 4), lambda a: a[:, :1].expand(2, 5, 4)),
    "unsqueeze": (lambda a: a.unsqueeze(1), lambda a: a.unsqueeze(1)),
    "squeeze": (lambda a: a[:, :1].squeeze(1), lambda a: a[:, :1].squeeze(1)),
    "slice": (lambda a: a[1:, ::2, 1:3], lambda a: a[1:, ::2, 1:3]),
    "int_index": (lambda a: a[1], lambda a: a[1]),
    "scalar_index": (lambda a: a[1, 2, 3], lambda a: a[1, 2, 3]),
    "none_ellipsis": (lambda a: a[None, ..., 2], lambda a: a[None, ..., 2]),
    "neg_index": (lambda a: a[-1, :, -2], lambda a: a[-1, :, -2]),
}

COPIES = {
    "adv_index": (lambda a: a[bt.tensor([1, 0, 1], device=a.device)], lambda a: a[torch.tensor([1, 0, 1])]),
    "adv_list": (lambda a: a[:, [0, 2, 2]], lambda a: a[:, [0, 2, 2]]),
    "adv_pair": (lambda a: a[[0, 1, 1], [2, 0, 2]], lambda a: a[[0, 1, 1], [2, 0, 2]]),
    "bool_mask": (lambda a: a[a > 0], lambda a: a[a > 0]),
    "contiguous": (lambda a: a.transpose(0, 1).contiguous(), lambda a: a.transpose(0, 1).contiguous()),
    "reshape_nc": (lambda a: a.transpose(0, 1).reshape(-1), lambda a: a.transpose(0, 1).reshape(-1)),
    "flatten": (lambda a: a.flatten(1), lambda a: a.flatten(1)),
    "clone": (lambda a: a.clone(), lambda a: a.clone()),
    "tril": (lambda a: bt.tril(a, 1), lambda a: torch.tril(a, 1)),
    "triu": (lambda a: bt.triu(a), lambda a: torch.triu(a)),
}

# NumPy float64 references of the same selections
NP_REFS = {
    "view": lambda a: a.reshape(6, 4),
    "view_neg": lambda a: a.reshape(-1),
    "reshape": lambda a: a.reshape(4, 6),
    "transpose": lambda a: a.swapaxes(0, 2),
    "permute": lambda a: a.transpose(2, 0, 1),
    "mT": lambda a: a.swapaxes(-1, -2),
    "expand": lambda a: np.broadcast_to(a[:, :1], (2, 5, 4)),
    "unsqueeze": lambda a: a[:, None],
    "squeeze": lambda a: a[:, 0],
    "slice": lambda a: a[1:, ::2, 1:3],
    "int_index": lambda a: a[1],
    "scalar_index": lambda a: a[1, 2, 3],
    "none_ellipsis": lambda a: a[None, ..., 2],
    "neg_index": lambda a: a[-1, :, -2],
    "adv_index": lambda a: a[[1, 0, 1]],
    "adv_list": lambda a: a[:, [0, 2, 2]],
    "adv_pair": lambda a: a[[0, 1, 1], [2, 0, 2]],
    "bool_mask": lambda a: a[a > 0],
    "contiguous": lambda a: a.swapaxes(0, 1),
    "reshape_nc": lambda a: a.swapaxes(0, 1).reshape(-1),
    "flatten": lambda a: a.reshape(2, -1),
    "clone": lambda a: a.copy(),
    "tril": lambda a: np.tril(a, 1),
    "triu": lambda a: np.triu(a),
}


@pytest.mark.parametrize("name", list(VIEWS))
def test_views_share_storage(name, device):
    fn, tfn = VIEWS[name]
    check_forward(fn, NP_REFS[name], [X], device)
    check_vs_torch(fn, tfn, [X], device)
    gradcheck(fn, [X], device)
    a = bt.tensor(X, device=device)
    v = fn(a)
    assert v._version is a._version, f"{name}: a view must share the version counter"
    before = host(v).copy()
    a.mul_(2.0)  # an in-place change of the base is visible through the view: no copy was made
    np.testing.assert_allclose(host(v), 2 * before)
    assert a._version.v == 1


@pytest.mark.parametrize("name", list(COPIES))
def test_copies(name, device):
    fn, tfn = COPIES[name]
    check_forward(fn, NP_REFS[name], [X], device)
    check_vs_torch(fn, tfn, [X], device)
    gradcheck(fn, [X], device)


def test_stride_and_contiguity(device):
    a = bt.zeros(2, 3, 4, device=device)
    assert a.stride() == (12, 4, 1) and a.is_contiguous()
    t = a.transpose(0, 2)
    assert t.stride() == (1, 4, 12) and not t.is_contiguous() and t.contiguous().is_contiguous()
    assert a[:, 1].stride() == (12, 1)
    with pytest.raises(bt.ShapeError, match="view"):
        t.view(-1)
    assert tuple(t.reshape(-1).shape) == (24,)


def test_repeated_index_accumulates(device):
    x = bt.tensor([1.0, 2.0, 3.0], device=device, requires_grad=True)
    x[bt.tensor([0, 0, 2], device=device)].sum().backward()
    np.testing.assert_allclose(host(x.grad), [2, 0, 1])


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cat_stack(dim, device):
    a, b = X, rng(4).standard_normal((2, 3, 4))
    check_forward(lambda x, y: bt.cat([x, y], dim), lambda x, y: np.concatenate([x, y], dim), [a, b], device)
    check_forward(lambda x, y: bt.stack([x, y], dim), lambda x, y: np.stack([x, y], dim), [a, b], device)
    check_vs_torch(lambda x, y: bt.cat([x, y], dim), lambda x, y: torch.cat([x, y], dim), [a, b], device)
    check_vs_torch(lambda x, y: bt.stack([x, y], dim), lambda x, y: torch.stack([x, y], dim), [a, b], device)
    gradcheck(lambda x, y: bt.cat([x, y[:, :2]], 1), [a, b], device)
    gradcheck(lambda x, y: bt.stack([x, y], dim), [a, b], device)


@pytest.mark.parametrize("arg", [2, [1, 3], 3])
def test_split_chunk(arg, device):
    if isinstance(arg, list):
        fn = lambda a: bt.cat([p * (i + 1) for i, p in enumerate(a.split(arg, dim=-1))], -1)  # noqa: E731
        tfn = lambda a: torch.cat([p * (i + 1) for i, p in enumerate(a.split(arg, dim=-1))], -1)  # noqa: E731
    else:
        fn = lambda a: bt.cat([p * (i + 1) for i, p in enumerate(a.chunk(arg, dim=-1))], -1)  # noqa: E731
        tfn = lambda a: torch.cat([p * (i + 1) for i, p in enumerate(a.chunk(arg, dim=-1))], -1)  # noqa: E731
    check_vs_torch(fn, tfn, [X], device)
    gradcheck(fn, [X], device)
    parts = bt.tensor(X, device=device).chunk(arg if isinstance(arg, int) else 2, dim=2)
    tparts = torch.tensor(X).chunk(arg if isinstance(arg, int) else 2, dim=2)
    assert [tuple(p.shape) for p in parts] == [tuple(p.shape) for p in tparts]


def test_setitem(device):
    a = bt.zeros(3, 4, device=device)
    a[1] = 5.0
    a[:, 2] = bt.arange(3, device=device, dtype=bt.float32)
    a[bt.tensor([0, 2], device=device), 0] = -1.0
    ref = np.zeros((3, 4))
    ref[1] = 5
    ref[:, 2] = np.arange(3)
    ref[[0, 2], 0] = -1
    np.testing.assert_allclose(host(a), ref)
    assert a._version.v == 3


def test_setitem_autograd(device):
    v = bt.tensor([1.0, 2.0], device=device, requires_grad=True)
    base = bt.zeros(2, 3, device=device)
    base[:, 1] = v * 3
    (base * bt.tensor([[1.0, 2.0, 3.0]], device=device)).sum().backward()
    np.testing.assert_allclose(host(v.grad), [6.0, 6.0])


def test_bfloat16_views(device):
    a = bt.arange(12, dtype=bt.bfloat16, device=device).view(3, 4)
    t = a.t() if hasattr(a, "t") else a.transpose(0, 1)
    assert t.dtype is bt.bfloat16 and t._version is a._version
    np.testing.assert_allclose(host(t), np.arange(12).reshape(3, 4).T)
    np.testing.assert_allclose(host(bt.cat([a, a], 0)), np.concatenate([np.arange(12).reshape(3, 4)] * 2))
