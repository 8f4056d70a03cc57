"""cuda_ops/sort.py: the sync-free stable radix argsort equals NumPy's stable argsort (CPU reference)."""

import numpy as np
import pytest
from blutensor.cuda_ops.sort import stable_argsort


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
    from blutensor.cuda_ops import sort

    monkeypatch.setattr(sort, "_thrust_ok", {})
    assert sort.thrust_capturable(_FakeCp, probe=False) is False
    sort._thrust_ok[0] = True
    assert sort.thrust_capturable(_FakeCp, probe=False) is True
    assert sort.thrust_capturable(_FakeCp) is True  # cached: no second probe


def test_thrust_capturable_probe_failure_means_radix(monkeypatch):
    """A probe that cannot capture (here: no CuPy graph support at all) caches False instead of raising."""
    from blutensor.cuda_ops import sort

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
@pytest.mark.parametrize("mode", ["runs", "pieces"])
def test_cuda_embedding_backward_modes(mode, monkeypatch):
    """GPU twin of test_cpu_embedding_backward_pieces_emulation: both backward algorithms against float64 with a
    very frequent token, bitwise repeatable, and equal inside a CUDA graph."""
    cp = _cupy_with_gpu()
    from blutensor.cuda_graph import CUDAGraph, graph
    from blutensor.cuda_ops.embedding import embedding_backward

    monkeypatch.setenv("BLUTRAIN_EMBEDDING_BWD", mode)
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
def test_embedding_backward_in_a_graph_equals_eager():
    """GPU: the probe's answer (Thrust or radix inside the graph) gives the eager result bit for bit."""
    cp = _cupy_with_gpu()
    from blutensor.cuda_graph import CUDAGraph, graph
    from blutensor.cuda_ops.embedding import embedding_backward
    from blutensor.cuda_ops.sort import thrust_capturable

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
