"""backends/cupy/sort.py: the sync-free stable radix argsort equals NumPy's stable argsort (CPU reference)."""

import blutensor as bt
import numpy as np
import pytest
from blutensor.backends.cupy.sort import stable_argsort


@pytest.mark.parametrize("n, V", [(0, 5), (1, 5), (17, 3), (1000, 256), (4096, 257), (16384, 50304), (3000, 1 << 20)])
def test_stable_argsort_matches_numpy(n, V):
    keys = np.random.default_rng(n + V).integers(0, V, size=n)
    got = stable_argsort(keys, V)
    np.testing.assert_array_equal(got, np.argsort(keys, kind="stable"))


def test_stable_argsort_many_duplicates_keeps_order():
    keys = np.array([3, 1, 3, 3, 0, 1, 0, 3] * 50)
    np.testing.assert_array_equal(stable_argsort(keys, 4), np.argsort(keys, kind="stable"))


class _FakeCp:
    """Just enough of CuPy for the probe cache: one device, and a graph module that must not be reached."""

    class cuda:  # noqa: N801
        class runtime:  # noqa: N801
            @staticmethod
            def getDevice():
                return 0


def test_thrust_capturable_inside_a_capture_never_probes(monkeypatch):
    """Inside a capture (probe=False) an unprobed device answers False (the radix sort); a cached answer is
    returned as it is, and nothing is captured."""
    from blutensor.backends.cupy import sort

    monkeypatch.setattr(sort, "_thrust_ok", {})
    assert sort.thrust_capturable(_FakeCp, probe=False) is False
    sort._thrust_ok[0] = True
    assert sort.thrust_capturable(_FakeCp, probe=False) is True
    assert sort.thrust_capturable(_FakeCp) is True  # cached: no second probe


def test_thrust_capturable_probe_failure_means_radix(monkeypatch):
    """A probe that cannot capture (here: no CuPy graph support at all) caches False instead of raising."""
    from blutensor.backends.cupy import sort

    monkeypatch.setattr(sort, "_thrust_ok", {})
    assert sort.thrust_capturable(_FakeCp) is False
    assert sort._thrust_ok == {0: False}


def _cupy_with_gpu():
    """CuPy when a GPU is present, else skip the test."""
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("no GPU")
    except Exception:  # noqa: BLE001
        pytest.skip("no GPU")
    return cp


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["segments", "runs", "pieces"])
def test_cuda_embedding_backward_modes(mode, monkeypatch):
    """GPU twin of test_cpu_embedding_backward_pieces_emulation: both backward algorithms against float64 with a
    very frequent token, bitwise repeatable, and equal inside a CUDA graph."""
    cp = _cupy_with_gpu()
    from blutensor.backends.cupy.embedding import embedding_backward
    from blutensor.cuda_graph import CUDAGraph, graph

    bt.policy.update(embedding_backward=mode)  # conftest resets the policy after the test
    rng = np.random.default_rng(1)
    idx_h = rng.integers(0, 997, size=5000)
    idx_h[rng.permutation(5000)[:1800]] = 5
    g_h = rng.standard_normal((5000, 200)).astype(np.float32)
    idx, g = cp.asarray(idx_h, dtype=cp.int64), cp.asarray(g_h)
    dw = embedding_backward(idx, g, 1000)
    want = np.zeros((1000, 200))
    np.add.at(want, idx_h, g_h.astype(np.float64))
    assert float(np.abs(cp.asnumpy(dw) - want).max()) < 1e-4 * float(np.abs(want).max())
    assert bool((embedding_backward(idx, g, 1000) == dw).all())
    cg = CUDAGraph()
    with graph(cg):
        out = embedding_backward(idx, g, 1000)
    cg.replay()
    cp.cuda.Device().synchronize()
    assert bool((out == dw).all())


@pytest.mark.cuda
@pytest.mark.parametrize("gdtype", ["float32", "bfloat16"])
def test_cuda_embedding_backward_segments_bitwise_and_accumulating(gdtype, monkeypatch):
    """GPU twin of test_cpu_embedding_backward_segments_emulation: the default backward, added into a float32
    buffer that already holds a gradient, equals the NumPy transliteration of its adds bit for bit."""
    cp = _cupy_with_gpu()
    from blutensor.backends import bf16_bits_to_f32, f32_to_bf16_bits
    from blutensor.backends.cupy import embedding
    from test_cuda_kernels import segments_emulation

    bt.policy.update(embedding_backward="segments")
    rng = np.random.default_rng(2)
    V, C, N = 1000, 200, 5003
    idx_h = rng.integers(0, V - 10, size=N)
    idx_h[rng.permutation(N)[:1800]] = 5
    g32 = rng.standard_normal((N, C)).astype(np.float32)
    if gdtype == "bfloat16":
        g_bits = f32_to_bf16_bits(g32, np)
        g_h, g = bf16_bits_to_f32(g_bits, np), cp.asarray(g_bits)
    else:
        g_h, g = g32, cp.asarray(g32)
    base = rng.standard_normal((V, C)).astype(np.float32)
    buf = cp.asarray(base)
    out = embedding.embedding_backward(cp.asarray(idx_h, dtype=cp.int64), g, V, out=buf)
    assert out is buf
    order = np.argsort(idx_h, kind="stable")
    want = segments_emulation(idx_h[order], order, g_h, base.copy(), embedding.SEG_PIECE)
    np.testing.assert_array_equal(cp.asnumpy(buf), want)


@pytest.mark.cuda
def test_cuda_embedding_backward_gpt2_shape_time(monkeypatch):
    """GPT-2 124M's embedding backward (16384 tokens, V = 50257, C = 768, Zipf-like tokens with one at 15%), added
    into the tied gradient buffer: deterministic, equal to float64 NumPy, and no slower than 0.4 ms (median of 20,
    CUDA events; a regression bound, benchmarks/step_profile.py reports the time in the step)."""
    cp = _cupy_with_gpu()
    from blutensor.backends.cupy.embedding import embedding_backward

    bt.policy.update(embedding_backward="segments")
    rng = np.random.default_rng(3)
    N, V, C = 16384, 50257, 768
    idx_h = np.minimum(rng.zipf(1.2, size=N) - 1, V - 1)
    idx_h[rng.permutation(N)[: N * 15 // 100]] = 220
    idx = cp.asarray(idx_h, dtype=cp.int64)
    g = cp.asarray(rng.standard_normal((N, C)).astype(np.float32))
    buf = cp.zeros((V, C), dtype=cp.float32)
    embedding_backward(idx, g, V, out=buf)
    once = buf.copy()
    times = []
    for _ in range(20):
        buf.fill(0)
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        embedding_backward(idx, g, V, out=buf)
        e1.record()
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1))
    ms = sorted(times)[10]
    print(f"embedding backward B*T={N} V={V} C={C}: {ms:.3f} ms")
    assert bool((buf == once).all())
    want = np.zeros((V, C))
    np.add.at(want, idx_h, cp.asnumpy(g).astype(np.float64))
    assert float(np.abs(cp.asnumpy(buf) - want).max()) < 1e-4 * float(np.abs(want).max())
    assert ms <= 0.4, f"embedding backward took {ms:.3f} ms (0.22 ms measured on the H200; 0.60 with one block a run)"


@pytest.mark.cuda
def test_embedding_backward_in_a_graph_equals_eager():
    """GPU: the probe's answer (Thrust or radix inside the graph) gives the eager result bit for bit."""
    cp = _cupy_with_gpu()
    from blutensor.backends.cupy.embedding import embedding_backward
    from blutensor.backends.cupy.sort import thrust_capturable
    from blutensor.cuda_graph import CUDAGraph, graph

    rng = np.random.default_rng(0)
    idx = cp.asarray(rng.integers(0, 1000, size=4099), dtype=cp.int64)
    g = cp.asarray(rng.standard_normal((4099, 96)), dtype=cp.float32)
    eager = embedding_backward(idx, g, 1000)
    assert isinstance(thrust_capturable(cp), bool)
    cg = CUDAGraph()
    with graph(cg):
        out = embedding_backward(idx, g, 1000)
    cg.replay()
    cp.cuda.Device().synchronize()
    assert bool((out == eager).all())
