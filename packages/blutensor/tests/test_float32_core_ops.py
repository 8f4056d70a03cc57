"""float32 forward values and gradients of the core training ops (matmul, softmax, LayerNorm, GELU both ways, a sum,
causal attention) on every device, against PyTorch CPU in float64; bfloat16 autograd of an elementwise product.

On 'cuda' (cuda-marked, with a GPU) these run the CUDA kernels and the CuPy branch of each op; on 'cpu' the same
assertions hold for the NumPy/C kernels, so a CUDA result that differs from the CPU one by more than float32
rounding fails against the same reference.
"""

from __future__ import annotations

import blutensor as bt
import numpy as np
import pytest
from conftest import host

torch = pytest.importorskip("torch")
F, TF = bt.nn.functional, torch.nn.functional

R = np.random.default_rng(0)
X = R.standard_normal((4, 8, 16)).astype(np.float32)
W = R.standard_normal((16, 16)).astype(np.float32)
G = R.standard_normal((4, 8, 16))  # projection of the output: loss = sum(y * G) (G summed over dim 1 for "sum")

#: name -> (blutensor function of (x, w), PyTorch function of (x, w))
OPS = {
    "matmul": (lambda x, w: x @ w, lambda x, w: x @ w),
    "softmax": (lambda x, w: F.softmax(x, -1), lambda x, w: torch.softmax(x, -1)),
    "layer_norm": (lambda x, w: F.layer_norm(x, (16,)), lambda x, w: TF.layer_norm(x, (16,))),
    "gelu_tanh": (lambda x, w: F.gelu(x, approximate="tanh"), lambda x, w: TF.gelu(x, approximate="tanh")),
    "gelu": (lambda x, w: F.gelu(x), lambda x, w: TF.gelu(x)),
    "sum": (lambda x, w: x.sum(1), lambda x, w: x.sum(1)),
    "sdpa_causal": (lambda x, w: F.scaled_dot_product_attention(x, x @ w, x, is_causal=True),
                    lambda x, w: TF.scaled_dot_product_attention(x, x @ w, x, is_causal=True)),
}


@pytest.mark.parametrize("name", list(OPS))
def test_float32_op_and_gradients_match_float64_torch(name, device):
    fb, ft = OPS[name]
    x = bt.tensor(X, device=device, requires_grad=True)
    w = bt.tensor(W, device=device, requires_grad=True)
    y = fb(x, w)
    assert y.dtype is bt.float32 and y.device.type == device
    g = G[:, 0] if name == "sum" else G
    (y * bt.tensor(g.astype(np.float32), device=device)).sum().backward()
    tx = torch.tensor(X, dtype=torch.float64, requires_grad=True)
    tw = torch.tensor(W, dtype=torch.float64, requires_grad=True)
    ty = ft(tx, tw)
    (ty * torch.tensor(g)).sum().backward()
    _close(y, ty, 1e-5, 2e-5, f"{name} forward")
    _close(x.grad, tx.grad, 1e-4, 1e-4, f"{name} gradient of x")
    if tw.grad is not None:
        _close(w.grad, tw.grad, 1e-4, 1e-4, f"{name} gradient of w")
    else:
        assert w.grad is None


def _close(got, want, rtol: float, atol: float, what: str) -> None:
    """``got`` (blutensor) within float32 rounding of ``want`` (torch float64): atol relative to max(1, |want|)."""
    ref = want.detach().numpy()
    np.testing.assert_allclose(host(got), ref, rtol=rtol, atol=atol * max(1.0, float(np.abs(ref).max())), err_msg=what)


def test_bfloat16_product_gradient_is_exact(device):
    """d sum(x * x)/dx = x + x: exact in bfloat16 (a doubling), so the bfloat16 gradient equals 2x bit for bit."""
    x = bt.randn(64, 64, dtype=bt.bfloat16, device=device, requires_grad=True)
    (x * x).sum().backward()
    assert x.grad.dtype is bt.bfloat16 and x.grad.device.type == device
    xv = host(x)
    np.testing.assert_array_equal(host(x.grad), 2 * xv)
    assert np.abs(xv).max() > 0
