"""Helpers of the PyTorch-parity suites: run one op on blutensor and on PyTorch CPU from the same NumPy
inputs, compare forward values and dtypes, then the gradients of a weighted sum of the (first) output."""

from __future__ import annotations

import blutensor as bt
import numpy as np
import torch

#: PyTorch itself computes a few float64 backward constants in float (hardsigmoid, celu): 1e-7 relative
TOL = {"float64": (1e-7, 1e-9), "float32": (2e-5, 1e-4), "bfloat16": (3e-2, 3e-2)}


def _leaf_bt(a, dtype, device, grad, nc):
    if a.dtype.kind != "f":
        t = bt.tensor(a, device=device)
        return t, t
    src = np.ascontiguousarray(np.swapaxes(a, -1, -2)) if nc else a
    leaf = bt.tensor(src, dtype=dtype, device=device, requires_grad=grad)
    return leaf, (leaf.transpose(-1, -2) if nc else leaf)


def _leaf_t(a, dtype, grad, nc):
    if a.dtype.kind != "f":
        t = torch.tensor(a)
        return t, t
    src = np.ascontiguousarray(np.swapaxes(a, -1, -2)) if nc else a
    leaf = torch.tensor(src, dtype=getattr(torch, dtype), requires_grad=grad)
    return leaf, (leaf.transpose(-1, -2) if nc else leaf)


def _first(o):
    return o[0] if isinstance(o, tuple | list) else o


def _as_list(o):
    return list(o) if isinstance(o, tuple | list) else [o]


def close(got, want, dtype="float64", what=""):
    """``got`` (blutensor Tensor) equals ``want`` (torch Tensor) in dtype, shape and value (NaN where NaN)."""
    assert isinstance(got, bt.Tensor), f"{what}: expected a Tensor, got {type(got).__name__}"
    assert str(want.dtype) == f"torch.{got.dtype.name}", f"{what}: dtype {got.dtype.name} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    g = got.detach().cpu().float().numpy() if got.dtype.name == "bfloat16" else got.detach().cpu().numpy()
    w = want.detach().float().numpy() if want.dtype == torch.bfloat16 else want.detach().numpy()
    if g.dtype.kind in "iub":
        np.testing.assert_array_equal(g, w, err_msg=what)
    else:
        rtol, atol = TOL.get(dtype, TOL["float32"])
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol, atol=atol, err_msg=what,
                                   equal_nan=True)


def check(fb, ft, arrays, device="cpu", dtype="float64", grad=True, nc=False, what=""):
    """Run ``fb`` (blutensor) and ``ft`` (torch) on tensors made from ``arrays`` (floating ones in ``dtype``;
    ``nc``: passed as transposed views of transposed copies, so non-contiguous) and compare every output and,
    where the first output is floating point, the gradient of sum(output * w) for each floating input."""
    arrays = [np.asarray(a) for a in arrays]
    bl = [_leaf_bt(a, getattr(bt, dtype), device, grad, nc and a.ndim >= 2) for a in arrays]
    tl = [_leaf_t(a, dtype, grad, nc and a.ndim >= 2) for a in arrays]
    ob = fb(*[x for _, x in bl])
    ot = ft(*[x for _, x in tl])
    for i, (g, w) in enumerate(zip(_as_list(ob), _as_list(ot))):
        close(g, w, dtype, f"{what} output {i}")
    b0, t0 = _first(ob), _first(ot)
    if not (grad and t0.requires_grad):
        return
    w = np.random.default_rng(7).standard_normal(tuple(t0.shape))
    (t0 * torch.tensor(w).to(t0.dtype)).sum().backward()
    (b0 * bt.tensor(w, device=device).to(b0.dtype)).sum().backward()
    for i, ((lb, _), (lt, _)) in enumerate(zip(bl, tl)):
        if lt.requires_grad:
            if lt.grad is None:
                assert lb.grad is None or not np.any(lb.grad.cpu().numpy()), f"{what}: grad {i} should be zero"
                continue
            assert lb.grad is not None, f"{what}: no gradient for input {i}"
            close(lb.grad, lt.grad, dtype, f"{what} grad {i}")
