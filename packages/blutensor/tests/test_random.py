"""Counter-based Philox4x32-10: known-answer vectors, reproducibility from a seed, offsets, and the
same stream (dropout masks, rand, randn) on CPU and CUDA."""

from __future__ import annotations

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
import pytest
from blutensor.random import Generator, philox4x32
from conftest import HAS_CUDA, host

M = 0xFFFFFFFF


def philox_scalar(ctr, key):
    """Pure-Python Philox4x32-10 reference (Salmon et al., Random123)."""
    c = list(ctr)
    k0, k1 = key
    for _ in range(10):
        p0 = c[0] * 0xD2511F53
        p1 = c[2] * 0xCD9E8D57
        c = [((p1 >> 32) ^ c[1] ^ k0) & M, p1 & M, ((p0 >> 32) ^ c[3] ^ k1) & M, p0 & M]
        k0, k1 = (k0 + 0x9E3779B9) & M, (k1 + 0xBB67AE85) & M
    return c


def test_known_answer_vectors():
    # Random123 kat_vectors: philox4x32 10 rounds
    assert philox_scalar([0, 0, 0, 0], [0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert philox_scalar([M, M, M, M], [M, M]) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    lo = np.array([0, 5, 123456], dtype=np.uint64)
    hi = np.array([0, 1, 7], dtype=np.uint64)
    out = philox4x32(lo, hi, 42, 7, np)
    for j in range(3):
        assert [int(o[j]) for o in out] == philox_scalar([int(lo[j]), int(hi[j]), 0, 0], [42, 7])


def test_seed_reproducible_and_offsets():
    bt.manual_seed(123)
    a = host(bt.randn(5))
    st = bt.get_rng_state()
    b = host(bt.randn(5))
    bt.manual_seed(123)
    np.testing.assert_array_equal(host(bt.randn(5)), a)
    bt.set_rng_state(st)
    np.testing.assert_array_equal(host(bt.randn(5)), b)
    assert not np.array_equal(a, b)
    g = Generator(9)
    g.uniform((10,), np)
    assert g.offset == 3  # ceil(10 / 4) Philox blocks consumed


def test_generator_argument_isolated_from_default():
    g1, g2 = Generator(5), Generator(5)
    x = bt.rand(7, generator=g1)
    bt.rand(3)
    y = bt.rand(7, generator=g2)
    np.testing.assert_array_equal(host(x), host(y))


def _dropout_mask(device, seed=11, shape=(33, 17), p=0.25):
    bt.manual_seed(seed)
    x = bt.ones(*shape, device=device)
    return host(F.dropout(x, p)) != 0


def _reference_mask(seed=11, shape=(33, 17), p=0.25):
    """The mask from the scalar Philox reference: keep iff 24-bit uniform >= p."""
    n = int(np.prod(shape))
    words = []
    for blk in range((n + 3) // 4):
        words += philox_scalar([blk & M, blk >> 32, 0, 0], [seed & M, seed >> 32])
    u = (np.array(words[:n], dtype=np.uint64) >> 8).astype(np.float32) * np.float32(1 / 16777216)
    return (u >= p).reshape(shape)


def test_dropout_mask_matches_philox_reference_cpu():
    """CPU twin of the CUDA test: the mask is exactly the Philox stream's, so any backend computing
    the same stream gives the same mask."""
    np.testing.assert_array_equal(_dropout_mask("cpu"), _reference_mask())


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CuPy and a CUDA GPU")
def test_dropout_mask_identical_on_cpu_and_cuda():
    np.testing.assert_array_equal(_dropout_mask("cuda"), _dropout_mask("cpu"))
    np.testing.assert_array_equal(_dropout_mask("cuda"), _reference_mask())


def test_rand_stream_reference_cpu():
    bt.manual_seed(4)
    r = host(bt.rand(9))
    words = []
    for blk in range(3):
        words += philox_scalar([blk, 0, 0, 0], [4, 0])
    ref = (np.array(words[:9], dtype=np.uint64) >> 8).astype(np.float32) * np.float32(1 / 16777216)
    np.testing.assert_array_equal(r, ref)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CuPy and a CUDA GPU")
def test_rand_randn_same_stream_on_cuda():
    for fn in (bt.rand, bt.randn):
        bt.manual_seed(4)
        a = host(fn(1001))
        bt.manual_seed(4)
        b = host(fn(1001, device="cuda"))
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    bt.manual_seed(4)
    a = host(bt.rand(1001))
    bt.manual_seed(4)
    np.testing.assert_array_equal(a, host(bt.rand(1001, device="cuda")))


def test_dropout_advances_offset():
    bt.manual_seed(0)
    m1 = host(F.dropout(bt.ones(100), 0.5)) != 0
    m2 = host(F.dropout(bt.ones(100), 0.5)) != 0
    assert not np.array_equal(m1, m2)
    assert bt.get_rng_state()["offset"] == 50
