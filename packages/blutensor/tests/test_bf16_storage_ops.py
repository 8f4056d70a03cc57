"""bfloat16 storage arithmetic (raw uint16 bits): ``bf16_add`` (the autograd engine's sum of a bf16 tensor's
gradient contributions) and ``bf16_sum0`` (grouped-query attention's dK/dV over the query heads of a group), both
added in float32 and rounded to nearest even. The NumPy path is checked against ml_dtypes' bfloat16 rounding; the
CUDA kernels (kernels/cast.cu) against the NumPy path, bit for bit, aligned and not."""

from __future__ import annotations

import blutensor as bt
import ml_dtypes
import numpy as np
import pytest
from blutensor.backends import bf16_add, bf16_bits_to_f32, bf16_sum0, f32_to_bf16_bits

needs_gpu = pytest.mark.skipif(not bt.cuda.is_available(), reason="needs CuPy and a CUDA GPU")


def _bits(shape, seed: int) -> np.ndarray:
    """bf16 bits of scaled normals, with infinities and signed zeros at the front."""
    v = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 50
    flat = v.reshape(-1)
    flat[:4] = [np.inf, -np.inf, 0.0, -0.0][: flat.size]
    return v.astype(ml_dtypes.bfloat16).view(np.uint16)


def _round(x32: np.ndarray) -> np.ndarray:
    return x32.astype(ml_dtypes.bfloat16).view(np.uint16)


def _widen(bits: np.ndarray) -> np.ndarray:
    return bits.view(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize("shape", [(1001,), (4, 96, 64), (3, 5)])
def test_numpy_bf16_add_is_the_rounded_float32_sum(shape):
    a, b = _bits(shape, 1), _bits(shape, 2)
    np.testing.assert_array_equal(bf16_add(a, b, np), _round(_widen(a) + _widen(b)))


@pytest.mark.parametrize("G,shape", [(1, (7,)), (4, (2, 8, 64, 64)), (3, (5, 13))])
def test_numpy_bf16_sum0_adds_the_slices_in_float32(G, shape):
    parts = _bits((G,) + shape, 3)
    want = _widen(parts[0])
    for g in range(1, G):
        want = want + _widen(parts[g])
    np.testing.assert_array_equal(bf16_sum0(parts, np), _round(want))


def test_numpy_widen_and_narrow_agree_with_ml_dtypes():
    v = np.random.default_rng(4).standard_normal(4099).astype(np.float32) * 1e3
    np.testing.assert_array_equal(f32_to_bf16_bits(v, np), _round(v))
    bits = _round(v)
    np.testing.assert_array_equal(bf16_bits_to_f32(bits, np), _widen(bits))


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("n", [8 * 1000, 8 * 1000 + 5, 3])
def test_cuda_bf16_kernels_match_numpy_bit_for_bit(n):
    import cupy

    a, b = _bits((n,), 5), _bits((n,), 6)
    da, db = cupy.asarray(a), cupy.asarray(b)
    np.testing.assert_array_equal(cupy.asnumpy(bf16_add(da, db, cupy)), bf16_add(a, b, np))
    np.testing.assert_array_equal(cupy.asnumpy(bf16_add(da[1:], db[1:], cupy)), bf16_add(a[1:], b[1:], np))
    for G in (1, 2, 4):
        parts = _bits((G, n), 7 + G)
        np.testing.assert_array_equal(cupy.asnumpy(bf16_sum0(cupy.asarray(parts), cupy)), bf16_sum0(parts, np))
    v = np.random.default_rng(8).standard_normal(n).astype(np.float32) * 100
    np.testing.assert_array_equal(cupy.asnumpy(f32_to_bf16_bits(cupy.asarray(v), cupy)), f32_to_bf16_bits(v, np))
    np.testing.assert_array_equal(cupy.asnumpy(bf16_bits_to_f32(da, cupy)), bf16_bits_to_f32(a, np))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, needs_gpu])])
def test_bf16_gradient_of_two_consumers_is_their_rounded_sum(device):
    """A bf16 leaf read twice: the engine sums the two bf16 contributions in float32 and rounds once."""
    r = np.random.default_rng(9)
    x = bt.tensor(r.standard_normal((6, 40)).astype(np.float32), device=device).to(bt.bfloat16)
    x.requires_grad_(True)
    g1 = r.standard_normal((6, 40)).astype(np.float32)
    g2 = r.standard_normal((6, 40)).astype(np.float32)
    y = (x * 1.0).sum() * 0 + (x * bt.tensor(g1, device=device).to(bt.bfloat16)).sum() \
        + (x * bt.tensor(g2, device=device).to(bt.bfloat16)).sum()
    y.backward()
    got = x.grad.to(bt.float32).to("cpu").numpy()
    c1, c2 = _widen(_round(g1)), _widen(_round(g2))
    want = _widen(_round(c1 + c2))  # the zero contribution adds exactly, in any order
    np.testing.assert_array_equal(got, want)
