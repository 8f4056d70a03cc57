"""NN ops: matmul/bmm (batch broadcasting), linear, softmax, log_softmax, layer_norm, gelu,
cross_entropy, embedding, dropout, scaled_dot_product_attention — vs NumPy, finite differences, torch."""

from __future__ import annotations

import math

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from conftest import check_forward, check_vs_torch, gradcheck, host, rng

R = rng(5)


@pytest.mark.parametrize("sa,sb", [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((4,), (4, 5)), ((3, 4), (4,)),
                                   ((2, 1, 3, 4), (5, 4, 2)), ((4,), (4,)), ((3, 3, 4), (4, 2))], ids=str)
def test_matmul(sa, sb, device):
    a, b = R.standard_normal(sa), R.standard_normal(sb)
    check_forward(bt.matmul, np.matmul, [a, b], device)
    check_vs_torch(bt.matmul, torch.matmul, [a, b], device)
    gradcheck(bt.matmul, [a, b], device)


def test_bmm(device):
    a, b = R.standard_normal((2, 3, 4)), R.standard_normal((2, 4, 5))
    check_forward(bt.bmm, np.matmul, [a, b], device)
    check_vs_torch(bt.bmm, torch.bmm, [a, b], device)
    gradcheck(bt.bmm, [a, b], device)


@pytest.mark.parametrize("bias", [True, False])
def test_linear(bias, device):
    x, w, b = R.standard_normal((2, 3, 4)), R.standard_normal((5, 4)), R.standard_normal(5)
    args = [x, w, b] if bias else [x, w]
    check_forward(F.linear, lambda x_, w_, b_=None: x_ @ w_.T + (0 if b_ is None else b_), args, device)
    check_vs_torch(F.linear, TF.linear, args, device)
    gradcheck(F.linear, args, device)


@pytest.mark.parametrize("dim", [-1, 0, 1])
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax(name, dim, device):
    x = R.standard_normal((3, 4, 5)) * 3
    fn = lambda a: getattr(F, name)(a, dim=dim)  # noqa: E731

    def ref(a):
        s = a - a.max(axis=dim, keepdims=True)
        ls = s - np.log(np.exp(s).sum(axis=dim, keepdims=True))
        return ls if name == "log_softmax" else np.exp(ls)

    check_forward(fn, ref, [x], device)
    check_vs_torch(fn, lambda a: getattr(torch, name)(a, dim=dim), [x], device)
    gradcheck(fn, [x], device)


def test_softmax_large_logits_stable(device):
    x = bt.tensor([[1000.0, 1001.0, -1000.0]], device=device)
    np.testing.assert_allclose(host(F.softmax(x, -1)), torch.softmax(torch.tensor([[1000.0, 1001.0, -1000.0]]),
                                                                     -1).numpy(), rtol=1e-6)


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm(affine, device):
    x = R.standard_normal((2, 3, 6)) * 2 + 1
    w, b = R.standard_normal(6), R.standard_normal(6)
    if affine:
        fn = lambda a, w_, b_: F.layer_norm(a, (6,), w_, b_, 1e-5)  # noqa: E731
        tfn = lambda a, w_, b_: TF.layer_norm(a, (6,), w_, b_, 1e-5)  # noqa: E731
        args = [x, w, b]
    else:
        fn, tfn, args = (lambda a: F.layer_norm(a, 6)), (lambda a: TF.layer_norm(a, (6,))), [x]

    def ref(a, w_=None, b_=None):
        y = (a - a.mean(-1, keepdims=True)) / np.sqrt(a.var(-1, keepdims=True) + 1e-5)
        return y * w_ + b_ if w_ is not None else y

    check_forward(fn, ref, args, device)
    check_vs_torch(fn, tfn, args, device)
    gradcheck(fn, args, device)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(approximate, device):
    x = R.standard_normal((3, 7)) * 2
    fn = lambda a: F.gelu(a, approximate=approximate)  # noqa: E731

    def ref(a):
        if approximate == "tanh":
            return 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))
        return 0.5 * a * (1 + np.vectorize(math.erf)(a / math.sqrt(2)))

    check_forward(fn, ref, [x], device)
    check_vs_torch(fn, lambda a: TF.gelu(a, approximate=approximate), [x], device)
    gradcheck(fn, [x], device)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore", [False, True])
def test_cross_entropy(reduction, ignore, device):
    logits = R.standard_normal((6, 5)) * 2
    target = R.integers(0, 5, 6)
    if ignore:
        target[[1, 4]] = -100
    fn = lambda z, t: F.cross_entropy(z, t, reduction=reduction)  # noqa: E731
    tfn = lambda z, t: TF.cross_entropy(z, t, reduction=reduction)  # noqa: E731

    def ref(z, t):
        ls = z - z.max(-1, keepdims=True)
        ls = ls - np.log(np.exp(ls).sum(-1, keepdims=True))
        valid = t != -100
        nll = np.where(valid, -ls[np.arange(len(t)), np.where(valid, t, 0)], 0.0)
        return {"mean": nll.sum() / valid.sum(), "sum": nll.sum(), "none": nll}[reduction]

    check_forward(fn, ref, [logits, target], device)
    check_vs_torch(fn, tfn, [logits, target], device)
    gradcheck(fn, [logits, target], device)


def test_cross_entropy_batched_and_custom_ignore(device):
    z, t = R.standard_normal((2, 4, 3)), R.integers(0, 4, (2, 3))  # PyTorch's (N, C, d) layout
    t[0, 1] = 2
    fn = lambda a, b: F.cross_entropy(a, b, ignore_index=2)  # noqa: E731
    check_vs_torch(fn, lambda a, b: TF.cross_entropy(a, b, ignore_index=2), [z, t], device)
    gradcheck(fn, [z, t], device)


def test_cross_entropy_label_smoothing(device):
    z, t = R.standard_normal((5, 4)), R.integers(0, 4, 5)
    fn = lambda a, b: F.cross_entropy(a, b, label_smoothing=0.1)  # noqa: E731
    check_vs_torch(fn, lambda a, b: TF.cross_entropy(a, b, label_smoothing=0.1), [z, t], device)


def test_embedding(device):
    w = R.standard_normal((7, 3))
    idx = np.array([[1, 3, 1], [6, 0, 1]])
    fn = lambda i, w_: F.embedding(i, w_)  # noqa: E731
    check_forward(fn, lambda i, w_: w_[i], [idx, w], device)
    check_vs_torch(fn, lambda i, w_: TF.embedding(i, w_), [idx, w], device)
    gradcheck(fn, [idx, w], device)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa(causal, device):
    q, k, v = (R.standard_normal((2, 2, 4, 3)) for _ in range(3))
    fn = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal)  # noqa: E731
    tfn = lambda a, b, c: TF.scaled_dot_product_attention(a, b, c, is_causal=causal)  # noqa: E731

    def ref(a, b, c):
        s = a @ b.swapaxes(-1, -2) / math.sqrt(a.shape[-1])
        if causal:
            s = np.where(np.tril(np.ones((4, 4), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        return (p / p.sum(-1, keepdims=True)) @ c

    check_forward(fn, ref, [q, k, v], device)
    check_vs_torch(fn, tfn, [q, k, v], device)
    gradcheck(fn, [q, k, v], device)


def test_sdpa_masks(device):
    q, k, v = (R.standard_normal((1, 3, 4, 2)) for _ in range(3))
    mask = R.standard_normal((4, 4)) > -0.5
    np.fill_diagonal(mask, True)
    addm = R.standard_normal((4, 4))
    for m in (mask, addm):
        fn = lambda a, b, c, m=m: F.scaled_dot_product_attention(a, b, c, attn_mask=bt.tensor(m, device=a.device))  # noqa: E731
        tfn = lambda a, b, c, m=m: TF.scaled_dot_product_attention(a, b, c, attn_mask=torch.tensor(m))  # noqa: E731
        check_vs_torch(fn, tfn, [q, k, v], device)


def test_dropout_scaling_and_grad(device):
    x = bt.ones(1000, device=device, dtype=bt.float64, requires_grad=True)
    y = F.dropout(x, 0.3)
    kept = host(y) != 0
    assert 0.6 < kept.mean() < 0.8
    np.testing.assert_allclose(host(y)[kept], 1 / 0.7)
    y.sum().backward()
    np.testing.assert_allclose(host(x.grad), host(y))
    assert F.dropout(x, 0.3, training=False) is x
    z = F.dropout(x, 1.0)
    assert float(host(z).sum()) == 0


def test_dropout_gradcheck(device):
    x = R.standard_normal((4, 5))

    def fn(a):
        bt.manual_seed(7)  # the same mask for every evaluation
        return F.dropout(a, 0.4)

    gradcheck(fn, [x], device)


def test_sdpa_dropout_reproducible(device):
    q, k, v = (bt.tensor(R.standard_normal((1, 2, 5, 3)), device=device) for _ in range(3))
    bt.manual_seed(3)
    a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    bt.manual_seed(3)
    b = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    c = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    np.testing.assert_array_equal(host(a), host(b))
    assert not np.array_equal(host(b), host(c))


def test_float32_nn_ops_close_to_torch(device):
    """float32 kernels stay within float32 rounding of PyTorch's float32 results."""
    x = R.standard_normal((4, 8)).astype(np.float32)
    t = bt.tensor(x, device=device)
    tx = torch.tensor(x)
    np.testing.assert_allclose(host(F.softmax(t, -1)), torch.softmax(tx, -1).numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(host(F.layer_norm(t, 8)), TF.layer_norm(tx, (8,)).numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(host(F.gelu(t)), TF.gelu(tx).numpy(), rtol=1e-5, atol=1e-6)
    assert F.gelu(t).dtype is bt.float32 and F.layer_norm(t, 8).dtype is bt.float32


class _StrictProvider:
    """A GEMM provider with the plugin operand contract: 2-D or 3-D, last axis contiguous, trans flags."""

    calls: list = []

    @classmethod
    def matmul(cls, a, b, *, trans_a=False, trans_b=False, precision="fp32", **_):
        for x in (a, b):
            assert x.ndim in (2, 3) and (x.shape[-1] <= 1 or x.strides[-1] == x.itemsize), (x.shape, x.strides)
        cls.calls.append((a.ndim, b.ndim, trans_a, trans_b, precision))
        return np.matmul(a.swapaxes(-1, -2) if trans_a else a, b.swapaxes(-1, -2) if trans_b else b)


@pytest.mark.parametrize("sa,sb,ta,tb", [((3, 4), (4, 5), False, False), ((3, 4), (4, 5), True, True),
                                         ((2, 3, 4), (4, 5), False, True), ((2, 3, 4), (2, 4, 5), True, False),
                                         ((3, 4), (2, 4, 5), False, True), ((2, 1, 3, 4), (5, 4, 2), True, True)],
                         ids=str)
def test_provider_matmul_operand_contract(sa, sb, ta, tb):
    """CPU twin of the CUDA GEMM-provider path: transposed views reach the provider as trans flags,
    batch broadcasting becomes 2-D/3-D calls, and the result equals np.matmul."""
    from blutensor.gemm import provider_matmul

    a = R.standard_normal(sa).astype(np.float32)
    b = R.standard_normal(sb).astype(np.float32)
    av = np.ascontiguousarray(a.swapaxes(-1, -2)).swapaxes(-1, -2) if ta else a  # a transposed view
    bv = np.ascontiguousarray(b.swapaxes(-1, -2)).swapaxes(-1, -2) if tb else b
    _StrictProvider.calls.clear()
    out = provider_matmul(_StrictProvider, av, bv, np)
    np.testing.assert_allclose(out, np.matmul(a, b), rtol=1e-5, atol=1e-6)
    assert _StrictProvider.calls and _StrictProvider.calls[0][4] == "fp32"
    if ta and len(sa) == 2 and len(sb) == 2:
        assert _StrictProvider.calls[0][2:4] == (True, True)
