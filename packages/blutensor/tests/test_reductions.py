"""Reductions over dims with keepdim: sum, mean, max/min (values, indices), var, std, norm, argmax."""

from __future__ import annotations

import blutensor as bt
import numpy as np
import pytest
import torch
from conftest import check_forward, check_vs_torch, gradcheck, host, rng

DIMS = [None, 0, 1, -1, (0, 2)]


def _x():
    return rng(1).permutation(24).reshape(2, 3, 4) / 7.0 - 1.5  # distinct values: max has no ties


def _tdim(d):
    return d if d is not None else tuple(range(3))


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("dim", DIMS, ids=str)
@pytest.mark.parametrize("name", ["sum", "mean", "var", "std", "amax", "amin"])
def test_reduction(name, dim, keepdim, device):
    x = _x()
    ax = dim if dim is None or isinstance(dim, tuple) else dim
    fn = lambda a: getattr(bt, name)(a, dim=dim, keepdim=keepdim)  # noqa: E731
    np_ref = {"sum": np.sum, "mean": np.mean, "amax": np.max, "amin": np.min,
              "var": lambda a, axis, keepdims: np.var(a, axis=axis, keepdims=keepdims, ddof=1),
              "std": lambda a, axis, keepdims: np.std(a, axis=axis, keepdims=keepdims, ddof=1)}[name]
    check_forward(fn, lambda a: np_ref(a, axis=ax, keepdims=keepdim), [x], device)
    tname = {"amax": "amax", "amin": "amin"}.get(name, name)
    check_vs_torch(fn, lambda a: getattr(torch, tname)(a, dim=_tdim(dim), keepdim=keepdim), [x], device)
    gradcheck(fn, [x], device)


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("name", ["max", "min"])
def test_max_min_dim(name, keepdim, device):
    x = _x()
    check_forward(lambda a: getattr(bt, name)(a, dim=1, keepdim=keepdim).values,
                  lambda a: getattr(np, name)(a, axis=1, keepdims=keepdim), [x], device)
    vals, idx = getattr(bt, name)(bt.tensor(x, device=device), dim=1, keepdim=keepdim)
    ref = getattr(torch, name)(torch.tensor(x), dim=1, keepdim=keepdim)
    np.testing.assert_allclose(host(vals), ref.values.numpy())
    np.testing.assert_array_equal(host(idx), ref.indices.numpy())
    assert idx.dtype is bt.int64
    fn = lambda a: getattr(bt, name)(a, dim=1, keepdim=keepdim).values  # noqa: E731
    check_vs_torch(fn, lambda a: getattr(torch, name)(a, dim=1, keepdim=keepdim).values, [x], device)
    gradcheck(fn, [x], device)


def test_global_max_ties_share_gradient(device):
    x = bt.tensor([1.0, 3.0, 3.0, 2.0], device=device, requires_grad=True)
    x.max().backward()
    np.testing.assert_allclose(host(x.grad), [0, 0.5, 0.5, 0])


@pytest.mark.parametrize("dim", [None, 0, -1])
def test_argmax_argmin(dim, device):
    x = _x()
    t = bt.tensor(x, device=device)
    np.testing.assert_array_equal(host(bt.argmax(t, dim=dim)), np.argmax(x, axis=dim))
    np.testing.assert_array_equal(host(bt.argmin(t, dim=dim)), np.argmin(x, axis=dim))
    if dim is not None:
        assert tuple(bt.argmax(t, dim=dim, keepdim=True).shape) == tuple(torch.argmax(torch.tensor(x), dim=dim,
                                                                                         keepdim=True).shape)


def test_var_correction_and_norm(device):
    x = _x()
    check_forward(lambda a: bt.var(a, dim=1, correction=0), lambda a: np.var(a, axis=1), [x], device)
    check_forward(lambda a: bt.var(a, 1, unbiased=False), lambda a: np.var(a, axis=1), [x], device)
    check_vs_torch(lambda a: bt.norm(a), lambda a: torch.linalg.vector_norm(a), [x], device)
    check_vs_torch(lambda a: bt.norm(a, dim=-1), lambda a: torch.linalg.vector_norm(a, dim=-1), [x], device)


def test_sum_int_and_dtype_arg(device):
    a = bt.arange(6, device=device).reshape(2, 3)
    assert a.sum().item() == 15 and a.sum(dim=0).dtype is bt.int64
    s = bt.sum(bt.ones(4, device=device, dtype=bt.bfloat16), dtype=bt.float32)
    assert s.dtype is bt.float32 and s.item() == 4.0


def test_float32_reduction_close_to_float64(device):
    x = rng(2).standard_normal((64, 33))
    t = bt.tensor(x, dtype=bt.float32, device=device)
    for name in ("sum", "mean", "var"):
        out = getattr(t, name)(dim=-1)
        assert out.dtype is bt.float32
        ref = {"sum": x.sum(-1), "mean": x.mean(-1), "var": x.var(-1, ddof=1)}[name]
        np.testing.assert_allclose(host(out), ref, rtol=1e-5, atol=1e-5)
