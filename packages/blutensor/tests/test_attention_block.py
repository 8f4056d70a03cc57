"""blutensor.ops.attention: one block of attention with its log-sum-exp (the piece ring attention merges), and
its backward from the merged rows' output and LSE; checked against a NumPy float64 reference, including two
blocks merged by their LSEs, and the portable path's memory staying linear in the sequence."""

import tracemalloc

import numpy as np
import pytest
from blutensor.errors import ShapeError
from blutensor.ops.attention import attention_block_backward, attention_block_forward
from conftest import HAS_CUDA

needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CuPy and a CUDA GPU")


def reference(q, k, v, causal, do):
    """float64: o, lse, dq, dk, dv of softmax(q k^T / sqrt(E)) v."""
    s = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    p = e / e.sum(-1, keepdims=True)
    o = p @ v
    lse = (np.log(e.sum(-1, keepdims=True)) + m)[..., 0]
    dv = p.swapaxes(-1, -2) @ do
    dp = do @ v.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.sqrt(q.shape[-1])
    return o, lse, ds @ k, ds.swapaxes(-1, -2) @ q, dv


def data(L, S, E=16, seed=0):
    r = np.random.default_rng(seed)
    return (r.standard_normal((2, 3, L, E)), r.standard_normal((2, 3, S, E)), r.standard_normal((2, 3, S, E)),
            r.standard_normal((2, 3, L, E)))


def check(xp, dtype, tol, causal, L, S):
    q, k, v, do = data(L, S)
    ref = reference(q, k, v, causal, do)
    a = [xp.asarray(x.astype(dtype)) for x in (q, k, v, do)]
    o, lse = attention_block_forward(a[0], a[1], a[2], is_causal=causal)
    grads = attention_block_backward(a[0], a[1], a[2], o, lse, a[3], is_causal=causal)
    got = [o, lse, *grads]
    for name, g, r in zip(("o", "lse", "dq", "dk", "dv"), got, ref):
        g = g.get() if hasattr(g, "get") else g
        assert np.abs(g.astype(np.float64) - r).max() <= tol * max(1.0, np.abs(r).max()), name


@pytest.mark.parametrize("causal,L,S", [(True, 300, 300), (False, 130, 700), (True, 1, 1)])
def test_block_matches_float64(causal, L, S):
    check(np, np.float64, 1e-12, causal, L, S)
    check(np, np.float32, 2e-5, causal, L, S)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("causal,L,S", [(True, 256, 256), (False, 128, 384)])
def test_block_flash_kernels_match_float64(causal, L, S):
    import cupy

    check(cupy, np.float32, 2e-3, causal, L, S)  # tf32x3 / SIMT kernels; lse is the kernels' own


def test_two_blocks_merged_by_lse_equal_one():
    """Keys split in two blocks: o = sum_b exp(lse_b - lse) o_b with lse = logaddexp(lse_1, lse_2)."""
    q, k, v, do = data(64, 96)
    o1, l1 = attention_block_forward(q, k[..., :40, :], v[..., :40, :])
    o2, l2 = attention_block_forward(q, k[..., 40:, :], v[..., 40:, :])
    lse = np.logaddexp(l1, l2)
    o = np.exp(l1 - lse)[..., None] * o1 + np.exp(l2 - lse)[..., None] * o2
    ro, rl, rdq, rdk, rdv = reference(q, k, v, False, do)
    assert np.abs(o - ro).max() < 1e-12 and np.abs(lse - rl).max() < 1e-12
    g1 = attention_block_backward(q, k[..., :40, :], v[..., :40, :], o, lse, do)
    g2 = attention_block_backward(q, k[..., 40:, :], v[..., 40:, :], o, lse, do)
    assert np.abs(g1[0] + g2[0] - rdq).max() < 1e-12
    assert np.abs(np.concatenate([g1[1], g2[1]], -2) - rdk).max() < 1e-12
    assert np.abs(np.concatenate([g1[2], g2[2]], -2) - rdv).max() < 1e-12


def _peak(L):
    q, k, v, do = (a[:1, :1] for a in data(L, L, E=32, seed=1))
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    o, lse = attention_block_forward(q, k, v, is_causal=True)
    attention_block_backward(q, k, v, o, lse, do, is_causal=True)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return peak


def test_memory_is_linear_in_the_sequence():
    small, big = _peak(2048), _peak(4096)
    assert big < 2.0 * small, (small, big)  # the (L x L) scores would make it 4x
    assert small < 2048 * 2048 * 8  # far below one float64 score matrix


def test_bad_shapes_are_named():
    q = np.zeros((2, 4, 8))
    with pytest.raises(ShapeError, match="attention block: q"):
        attention_block_forward(q, np.zeros((2, 4, 9)), np.zeros((2, 4, 9)))
    o, lse = attention_block_forward(q, q, q)
    with pytest.raises(ShapeError, match="attention block backward"):
        attention_block_backward(q, q, q, o, lse[..., :2], o)
