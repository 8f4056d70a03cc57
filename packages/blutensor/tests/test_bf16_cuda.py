"""The bf16 training path's kernels on the GPU, against references: the float32 <-> bf16 cast (bitwise against
the round-to-nearest-even reference, odd offsets and infinities included), the autocast linear forward and its
gradients (float64 products of the bf16-rounded operands), the fused cross-entropy's float32 loss of bf16
logits. CPU twins: test_amp's bf16 GEMM classes on NumPy bits and the cast reference tests."""

from __future__ import annotations

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
import pytest
from blutensor import ext

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not bt.cuda.is_available(), reason="needs CuPy and a CUDA GPU")]


def _host(t) -> np.ndarray:
    return t.detach().to(bt.float32).to("cpu").numpy().astype(np.float64)


def test_cast_is_bitwise_the_reference_rounding():
    import cupy

    r = np.random.default_rng(0)
    v = (r.standard_normal(3 * 2**20 + 5) * 50).astype(np.float32)
    v[:4] = [np.inf, -np.inf, 0.0, -0.0]
    x = cupy.asarray(v)
    ref = ext.f32_to_bf16_bits(x, cupy)
    assert bool((ext.cast_to_bf16(x) == ref).all())
    assert bool((ext.cast_to_bf16(x[1:]) == ref[1:]).all())  # unaligned start
    assert bool((ext.cast_to_f32(ref) == (ref.astype(cupy.uint32) << 16).view(cupy.float32)).all())


def test_autocast_linear_forward_and_gradients_match_float64():
    r = np.random.default_rng(0)
    w = bt.nn.Parameter(bt.tensor(r.standard_normal((3072, 768)).astype(np.float32) * 0.02, device="cuda"))
    b = bt.nn.Parameter(bt.tensor(r.standard_normal(3072).astype(np.float32) * 0.02, device="cuda"))
    x = bt.tensor(r.standard_normal((4, 256, 768)).astype(np.float32), device="cuda")
    g = bt.tensor(r.standard_normal((4, 256, 3072)).astype(np.float32), device="cuda")
    with bt.autocast("cuda"):
        y = F.linear(x, w, b)
    (y.float() * g).sum().backward()
    xb, wb, bb, gb = (_host(t.to(bt.bfloat16)) for t in (x, w, b, g))
    gb2, xb2 = gb.reshape(-1, 3072), xb.reshape(-1, 768)

    def rel(a, ref):
        return float(np.abs(a - ref).max() / np.abs(ref).max())

    assert y.dtype is bt.bfloat16 and w.grad.dtype is bt.float32
    assert rel(_host(y), xb @ wb.T + bb) < 1e-2
    assert rel(_host(w.grad), gb2.T @ xb2) < 1e-2
    assert rel(_host(b.grad), gb2.sum(0)) < 1e-2


def test_fused_cross_entropy_of_bf16_logits_gives_the_float32_loss():
    r = np.random.default_rng(0)
    z = bt.tensor(r.standard_normal((512, 50304)).astype(np.float32) * 3, device="cuda").to(bt.bfloat16)
    z.requires_grad = True
    tgt = bt.tensor(r.integers(0, 50257, 512), device="cuda")
    with bt.autocast("cuda"):
        loss = F.cross_entropy(z, tgt)
    loss.backward()
    ref = F.cross_entropy(z.detach().float(), tgt)
    assert loss.dtype is bt.float32 and z.grad.dtype is bt.bfloat16
    assert abs(float(loss.item()) - float(ref.item())) < 1e-4
    # against float64 on the host
    zh = _host(z)
    lse = np.log(np.exp(zh - zh.max(1, keepdims=True)).sum(1)) + zh.max(1)
    t = tgt.to("cpu").numpy()
    assert abs(float(loss.item()) - float((lse - zh[np.arange(512), t]).mean())) < 1e-4
