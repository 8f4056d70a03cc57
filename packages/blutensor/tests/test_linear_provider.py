"""CPU twins of the CUDA linear path: the forward is ONE provider GEMM (NT, bias in the epilogue, no
transposed copy) and the bias gradient is a strict-fp32 GEMV through the provider; both equal NumPy."""

from __future__ import annotations

import numpy as np
import pytest
from blutensor.gemm import provider_bias_grad, provider_linear

R = np.random.default_rng(11)


class _Recorder:
    """A provider with the plugin operand contract (2-D/3-D, unit-stride last axis) that records its calls."""

    calls: list = []

    @classmethod
    def matmul(cls, a, b, *, trans_a=False, trans_b=False, precision="fp32", bias=None, **kw):
        assert not kw, kw
        for x in (a, b):
            assert x.ndim in (2, 3) and (x.shape[-1] <= 1 or x.strides[-1] == x.itemsize), (x.shape, x.strides)
        cls.calls.append({"ta": trans_a, "tb": trans_b, "precision": precision, "bias": bias is not None,
                          "a": a.shape, "b": b.shape})
        y = np.matmul(a.T if trans_a else a, b.T if trans_b else b)
        return y + bias if bias is not None else y


@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_is_one_nt_gemm_with_fused_bias(with_bias):
    x = R.standard_normal((37, 24)).astype(np.float32)
    w = R.standard_normal((10, 24)).astype(np.float32)  # (out, in) like nn.Linear
    b = R.standard_normal(10).astype(np.float32) if with_bias else None
    _Recorder.calls.clear()
    y = provider_linear(_Recorder, x, w, b, np)
    ref = x.astype(np.float64) @ w.astype(np.float64).T + (b if with_bias else 0.0)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    assert len(_Recorder.calls) == 1  # no separate bias pass
    c = _Recorder.calls[0]
    assert (c["ta"], c["tb"], c["bias"]) == (False, True, with_bias)
    assert c["b"] == w.shape  # the weight itself, not a transposed copy
    assert c["precision"] == "fp32"


def test_linear_tf32_mode_reaches_the_provider():
    from blutensor import gemm as g

    old = g.get_matmul_precision()
    try:
        g.set_matmul_precision("tf32")
        _Recorder.calls.clear()
        provider_linear(_Recorder, np.ones((4, 3), np.float32), np.ones((2, 3), np.float32), None, np)
        assert _Recorder.calls[0]["precision"] == "tf32"
    finally:
        g.set_matmul_precision(old)


def test_bias_grad_is_a_strict_fp32_gemv():
    g2 = R.standard_normal((513, 33)).astype(np.float32)
    _Recorder.calls.clear()
    gb = provider_bias_grad(_Recorder, g2, np)
    np.testing.assert_allclose(gb, g2.astype(np.float64).sum(axis=0), rtol=1e-5, atol=1e-4)
    assert gb.shape == (33,)
    (c,) = _Recorder.calls
    assert c["precision"] == "fp32" and c["a"] == (1, 513) and c["b"] == (513, 33)


def test_linear_op_on_numpy_matches_float64():
    """The generic op (NumPy path) keeps y = x w^T + b and the three gradients."""
    import blutensor as bt

    x = bt.tensor(R.standard_normal((2, 5, 6)).astype(np.float32), requires_grad=True)
    w = bt.tensor(R.standard_normal((4, 6)).astype(np.float32), requires_grad=True)
    b = bt.tensor(R.standard_normal(4).astype(np.float32), requires_grad=True)
    y = bt.nn.functional.linear(x, w, b)
    xn, wn, bn = (np.asarray(t.numpy(), np.float64) for t in (x, w, b))
    np.testing.assert_allclose(y.numpy(), xn @ wn.T + bn, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    np.testing.assert_allclose(b.grad.numpy(), np.full(4, 10.0), rtol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), xn.reshape(-1, 6).sum(0)[None].repeat(4, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), np.broadcast_to(wn.sum(0), (2, 5, 6)), rtol=1e-5, atol=1e-5)
