"""float32 + bfloat16 adds (autocast's residual stream plus a bf16 GEMM output): the result is float32
``x + widen(y)`` bitwise, the bf16 operand's gradient is the float32 gradient rounded to bf16 and the float32
operand's is the gradient itself, inside and outside autocast, aligned and not, against a NumPy reference of the
same rounding. On CUDA the pair runs as one widening kernel (no cast node in the graph); on the CPU through type
promotion (a cast node, the same numbers). Broadcasting pairs are promoted on both."""

from __future__ import annotations

import blutensor as bt
import numpy as np
import pytest
from blutensor import ext

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not bt.cuda.is_available(), reason="needs CuPy and a CUDA GPU")])]


def _bf16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 (nearest even), as float32."""
    return (ext.f32_to_bf16_bits(a.astype(np.float32), np).astype(np.uint32) << 16).view(np.float32)


def _host(t) -> np.ndarray:
    return t.detach().to(bt.float32).to("cpu").numpy()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,autocast", [((4, 96, 768), True), ((3, 37), False), ((1001,), True)])
def test_float32_plus_bf16_is_exact_with_rounded_gradient(device, n, autocast):
    r = np.random.default_rng(1)
    xv = r.standard_normal(n).astype(np.float32)
    yv = _bf16(r.standard_normal(n).astype(np.float32) * 3)
    gv = r.standard_normal(n).astype(np.float32)
    x = bt.tensor(xv, device=device, requires_grad=True)
    y = bt.tensor(yv, device=device).to(bt.bfloat16).detach().requires_grad_()
    if autocast:
        with bt.autocast(device):
            out = x + y
    else:
        out = x + y
    assert out.dtype is bt.float32 and tuple(out.shape) == n
    np.testing.assert_array_equal(_host(out), xv + yv)
    if device == "cuda":  # one node, the widening add, straight on the bf16 leaf
        assert out.grad_fn.op == "add" and out.grad_fn.next[1] is y._acc
    (out * bt.tensor(gv, device=device)).sum().backward()
    assert y.grad.dtype is bt.bfloat16 and x.grad.dtype is bt.float32
    np.testing.assert_array_equal(_host(x.grad), gv)
    np.testing.assert_array_equal(_host(y.grad), _bf16(gv))


@pytest.mark.parametrize("device", DEVICES)
def test_broadcasting_mix_is_promoted(device):
    r = np.random.default_rng(2)
    xv = r.standard_normal((5, 8)).astype(np.float32)
    yv = _bf16(r.standard_normal(8).astype(np.float32))
    x = bt.tensor(xv, device=device, requires_grad=True)
    y = bt.tensor(yv, device=device).to(bt.bfloat16).detach().requires_grad_()
    out = x + y
    np.testing.assert_array_equal(_host(out), xv + yv)
    out.sum().backward()
    assert tuple(y.grad.shape) == (8,)
    np.testing.assert_array_equal(_host(y.grad), _bf16(np.full(8, 5, np.float32)))
