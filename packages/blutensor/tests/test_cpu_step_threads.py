"""The CPU step's threaded pieces outside the fused kernels: GEMM row blocks on the OpenMP threads (with the
linear bias added in the same pass), the threaded transposing copy and column sum, and glibc malloc keeping freed
arrays. Each is compared with NumPy (bit for bit where it runs NumPy's own arithmetic) and a float64 reference."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import blutensor as bt
import numpy as np
import pytest
from blutensor.backends.numpy import _build, available, gemm, strided

pytestmark = pytest.mark.skipif(not available(), reason="compiled CPU kernels unavailable (no C compiler)")

R = np.random.default_rng(3)


def f32(*shape):
    return R.standard_normal(shape).astype(np.float32)


@pytest.fixture
def two_threads():
    before = bt.get_num_threads()
    bt.set_num_threads(2)
    yield
    bt.set_num_threads(before)


def _pool(a, b, n, bias=None):
    """The same product with the blocks on the Python pool (np.matmul on each block)."""
    saved = list(gemm._sgemm), _build._state.pop("sgemm", None)
    gemm._sgemm[:] = [None]
    try:
        return gemm.matmul(a, b, n, bias)
    finally:
        gemm._sgemm[:] = saved[0]
        if saved[1]:
            _build._state["sgemm"] = saved[1]


def test_gemm_blocks_on_the_openmp_threads_equal_numpy_blocks():
    assert gemm._numpy_sgemm() is not None  # NumPy's BLAS symbol is found, so the OpenMP path is the one tested
    a, b, bias = f32(517, 130), f32(130, 257), f32(257)
    layouts = [(a, b), (np.asfortranarray(a), b), (a, np.asfortranarray(b)), (f32(130, 517).T, b),
               (f32(517, 200)[:, :130], b)]  # C order, transposed operands, a row stride longer than the row
    for x, y in layouts:
        want = x.astype(np.float64) @ y.astype(np.float64)
        for n in (2, 3):
            got = gemm.matmul(x, y, n)
            assert _build._state.get("sgemm")  # the compiled path ran
            np.testing.assert_array_equal(got, _pool(x, y, n))
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
            gb = gemm.matmul(x, y, n, bias)
            np.testing.assert_array_equal(gb, _pool(x, y, n) + bias)  # the epilogue adds as `y += b` does
            np.testing.assert_allclose(gb, want + bias, rtol=1e-4, atol=1e-4)
    g, x2 = f32(2048, 96), f32(2048, 64)  # linear's weight gradient: g.T @ x over the tokens
    np.testing.assert_array_equal(gemm.matmul(g.T, x2, 2), _pool(g.T, x2, 2))


def test_threaded_linear_matches_the_reference_and_repeats(two_threads):
    x, w, b = f32(4, 128, 96), f32(160, 96) * 0.1, f32(160)
    xt, wt, bt_ = (bt.tensor(v, requires_grad=True) for v in (x, w, b))
    y = bt.nn.functional.linear(xt, wt, bt_)
    g = f32(4, 128, 160)
    y.backward(bt.tensor(g))
    x64, w64, g64 = (v.astype(np.float64) for v in (x, w, g))
    np.testing.assert_allclose(y.numpy(), x64 @ w64.T + b, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(wt.grad.numpy(), g64.reshape(-1, 160).T @ x64.reshape(-1, 96), rtol=1e-4, atol=1e-3)
    np.testing.assert_array_equal(bt_.grad.numpy(), g.reshape(-1, 160).sum(axis=0))  # NumPy's order of additions
    np.testing.assert_allclose(xt.grad.numpy(), g64 @ w64, rtol=1e-4, atol=1e-4)
    y2 = bt.nn.functional.linear(bt.tensor(x), bt.tensor(w), bt.tensor(b))
    np.testing.assert_array_equal(y2.numpy(), y.numpy())  # same threads, same bits


def test_threaded_copy_and_column_sum_equal_numpy(two_threads):
    q = f32(8, 128, 3, 4, 32)  # (B, T, 3, H, hd) -> (3, B, H, T, hd), the attention layout
    for v in (q.transpose(2, 0, 3, 1, 4), q[..., ::2].transpose(2, 0, 3, 1, 4), q.transpose(4, 3, 2, 1, 0)):
        assert v.size >= strided.MIN_ELEMENTS  # the threaded copy, not NumPy's
        got = strided.contiguous(v)
        assert got.flags.c_contiguous
        np.testing.assert_array_equal(got, np.ascontiguousarray(v))
    small = f32(4, 8).T
    np.testing.assert_array_equal(strided.contiguous(small), np.ascontiguousarray(small))
    for shape in ((2048, 384), (3000, 67), (50000, 3)):
        x = f32(*shape) * 3 + 0.25
        assert x.size >= strided.MIN_ELEMENTS
        np.testing.assert_array_equal(strided.col_sum(x), x.sum(axis=0))
        np.testing.assert_allclose(strided.col_sum(x), x.astype(np.float64).sum(axis=0), rtol=1e-4, atol=1e-2)


FAULTS = """
import resource, numpy as np
from blutensor.backends.numpy import status
s = status()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):  # temporaries of a few MB made and freed together, as in a training step
    arrays = [np.empty(n << 18, np.float32) for n in (4, 4, 2, 4)]
    for a in arrays:
        a.fill(1.0)
    del arrays, a
print(s["malloc_kept"], resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc only")
def test_freed_arrays_are_reused_without_page_faults():
    def run(**env):
        e = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
        r = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True, timeout=60,
                           env={**e, **env})
        assert r.returncode == 0, r.stderr
        kept, faults = r.stdout.split()
        return kept == "True", int(faults)

    kept, faults = run()
    assert kept and faults < 6 * 1024, faults  # the first round faults its 3,584 pages in, the rest reuse them
    kept, faults = run(BLUTRAIN_CPU_MALLOC="0")
    assert not kept and faults > 20 * 1024, faults  # glibc's default trims the freed heap: fresh pages every round
    assert run(MALLOC_TRIM_THRESHOLD_="1000000")[0] is False  # the user's own malloc tuning is left alone


FORK_GEMM = """
import os, numpy as np, blutensor as bt, blutensor.nn.functional as F
from blutensor.backends.numpy import _build
bt.set_num_threads(2)
r = np.random.default_rng(0)
x, w, b = (bt.tensor(r.standard_normal(s).astype(np.float32)) for s in ((1024, 256), (384, 256), (384,)))
want = F.linear(x, w, b).numpy()
assert _build._state.get("sgemm")  # the parent's GEMM ran on the OpenMP threads
pid = os.fork()
if pid == 0:  # the child's OpenMP cannot run threads: its blocks take the Python pool, same bits, no hang
    os._exit(0 if np.array_equal(F.linear(x, w, b).numpy(), want) else 3)
print("child", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_a_forked_child_splits_its_gemms_without_hanging():
    r = subprocess.run([sys.executable, "-c", FORK_GEMM], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "child 0" in r.stdout, (r.stdout, r.stderr)
