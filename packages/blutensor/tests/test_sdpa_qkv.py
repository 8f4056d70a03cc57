"""Fused-qkv attention (backends/cupy/sdpa.py ``sdpa_qkv``): strided q/k/v views of the qkv projection.

CPU: the layout triples (sb, sh, st) handed to the strided kernels address exactly q/k/v/o/dO through the
kernels' formula  base(bh) = (bh / H) * sb + (bh % H) * sh,  row offset = row * st  (struct Lay); the
preprocess row mapping gives rowsum(dO * O) in (BH, L) order; sdpa_qkv equals a float64 NumPy reference
(forward and backward, causal or not, odd T). GPU (cuda-marked): the strided kernels equal the same
reference and the op-by-op path.
"""

from __future__ import annotations

import blutensor as bt
import numpy as np
import pytest
from blutensor.backends.cupy.sdpa import layout, sdpa_qkv


def _gather(flat, lay, H, shape, offset):
    """What the kernel reads for a (B, H, n, hd) tensor at element offset ``offset`` of ``flat``."""
    sb, sh, st = lay
    B, _, n, hd = shape
    out = np.empty(shape, flat.dtype)
    for bh in range(B * H):
        base = offset + (bh // H) * sb + (bh % H) * sh
        for r in range(n):
            out[bh // H, bh % H, r] = flat[base + r * st: base + r * st + hd]
    return out


@pytest.mark.parametrize("B, T, H, hd", [(2, 5, 3, 4), (1, 7, 2, 8)])
def test_layout_addresses_q_k_v_and_o(B, T, H, hd):
    C = H * hd
    qkv = np.arange(B * T * 3 * C, dtype=np.float32).reshape(B, T, 3 * C)
    qkv5 = qkv.reshape(B, T, 3, H, hd)
    ref = qkv5.transpose(2, 0, 3, 1, 4)  # (3, B, H, T, hd): what view/permute/contiguous produce
    flat = qkv.reshape(-1)
    for i in range(3):
        view = qkv5[:, :, i]
        off = (view.__array_interface__["data"][0] - qkv.__array_interface__["data"][0]) // 4
        assert off == i * C
        np.testing.assert_array_equal(_gather(flat, layout(view), H, (B, H, T, hd), off), ref[i])
    o = np.random.default_rng(0).standard_normal((B, T, H, hd)).astype(np.float32)
    np.testing.assert_array_equal(_gather(o.reshape(-1), layout(o), H, (B, H, T, hd), 0), o.transpose(0, 2, 1, 3))


def test_preprocess_row_mapping():
    B, T, H, hd = 2, 5, 3, 4
    rng = np.random.default_rng(1)
    o, do = (rng.standard_normal((B, T, H, hd)).astype(np.float32) for _ in range(2))
    sb, sh, st = layout(o)
    D = np.empty(B * H * T, np.float32)
    for row in range(B * H * T):  # sdpa_preprocess: bh = row / L, i = row % L
        bh, i = divmod(row, T)
        off = (bh // H) * sb + (bh % H) * sh + i * st
        D[row] = (do.reshape(-1)[off:off + hd] * o.reshape(-1)[off:off + hd]).sum()
    want = (do * o).sum(-1).transpose(0, 2, 1).reshape(-1)  # (B, H, T) order
    np.testing.assert_allclose(D, want, rtol=1e-6)


def test_layout_rejects_strided_head_dim():
    a = np.zeros((2, 3, 4, 8), np.float32)[..., ::2]
    with pytest.raises(bt.ShapeError, match="head dim must be contiguous"):
        layout(a)


def _reference(qkv, H, causal):
    """float64 attention of qkv (B, T, 3C) -> (B, T, C)."""
    B, T, C3 = qkv.shape
    hd = C3 // (3 * H)
    q, k, v = qkv.reshape(B, T, 3, H, hd).transpose(2, 0, 3, 1, 4)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
    if causal:
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ v).transpose(0, 2, 1, 3).reshape(B, T, H * hd)


def _fd_grad(qkv, H, causal, w, eps=1e-6):
    g = np.zeros_like(qkv)
    it = np.nditer(qkv, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        a, b = qkv.copy(), qkv.copy()
        a[i] += eps
        b[i] -= eps
        g[i] = ((_reference(a, H, causal) * w).sum() - (_reference(b, H, causal) * w).sum()) / (2 * eps)
    return g


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_qkv_cpu_matches_float64_reference(causal):
    B, T, H, hd = 2, 5, 2, 3
    rng = np.random.default_rng(2)
    x = rng.standard_normal((B, T, 3 * H * hd))
    w = rng.standard_normal((B, T, H * hd))
    t = bt.tensor(x, dtype=bt.float64, requires_grad=True)
    y = sdpa_qkv(t, H, is_causal=causal)
    np.testing.assert_allclose(y.numpy(), _reference(x, H, causal), rtol=1e-10, atol=1e-12)
    (y * bt.tensor(w, dtype=bt.float64)).sum().backward()
    np.testing.assert_allclose(t.grad.numpy(), _fd_grad(x, H, causal, w), rtol=1e-6, atol=1e-8)


def _cuda_ok() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_ok(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("precision, hd, T", [("fp32", 64, 77), ("tf32", 64, 131), ("fp32", 32, 65), ("tf32", 128, 64)])
def test_cuda_sdpa_qkv_matches_reference(causal, precision, hd, T):
    B, H = 2, 3
    rng = np.random.default_rng(3)
    x = rng.standard_normal((B, T, 3 * H * hd)).astype(np.float32)
    w = rng.standard_normal((B, T, H * hd)).astype(np.float32)
    prev = bt.get_matmul_precision()
    bt.set_matmul_precision(precision)
    try:
        t = bt.tensor(x, device="cuda", requires_grad=True)
        y = sdpa_qkv(t, H, is_causal=causal)
        assert y.grad_fn is not None and y.grad_fn.op == "SdpaQkv"  # the fused path ran
        (y * bt.tensor(w, device="cuda")).sum().backward()
        got_y, got_g = y.numpy(), t.grad.numpy()
    finally:
        bt.set_matmul_precision(prev)
    tol = 2e-3 if precision == "tf32" else 2e-5
    np.testing.assert_allclose(got_y, _reference(x.astype(np.float64), H, causal), rtol=tol, atol=tol)
    tc = bt.tensor(x.astype(np.float64), dtype=bt.float64, requires_grad=True)
    (sdpa_qkv(tc, H, is_causal=causal) * bt.tensor(w.astype(np.float64), dtype=bt.float64)).sum().backward()
    np.testing.assert_allclose(got_g, tc.grad.numpy(), rtol=tol * 5, atol=tol * 5)


def test_sdpa_rewriting_observers_are_recognised():
    from blutensor.backends.cupy.sdpa import _observed, _rewrites_sdpa

    class Ring:  # stands for dtms' context-parallel observer
        def __call__(self, op, inputs, attrs, run):
            return run()

    Ring.__module__ = "dtms.parallel.context_parallel"

    class Prof:
        def observe(self, op, inputs, attrs, run):
            return run()

    assert _rewrites_sdpa(Ring()) and not _rewrites_sdpa(Prof().observe)
    assert not _rewrites_sdpa(lambda op, inputs, attrs, run: run())
    seen = []

    def watcher(op, inputs, attrs, run):
        seen.append((op, attrs["n_head"]))
        return run()

    from blutensor.ops import dispatch

    dispatch.add_observer(watcher)
    try:
        assert _observed(lambda: 42, None, {"n_head": 3}) == 42
    finally:
        dispatch.remove_observer(watcher)
    assert seen == [("sdpa_qkv", 3)]
