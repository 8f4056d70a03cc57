"""RMSNorm's weight gradient accumulated by the kernel (``GRAD_INTO``): with a float32 ``.grad`` buffer already
present, ``rms_norm`` and ``add_rms_norm`` add dweight into it themselves (the engine's separate add does not run
for the weight) and the buffer ends equal, bit for bit, to the one the engine's add fills (CPU: the compiled
kernels and the NumPy references), and to old + dweight of a float64 reference. The compiled CPU ``rms_norm`` has
the arithmetic of ``add_rms_norm``'s kernels: ``rms_norm(x + r)`` is bitwise ``add_rms_norm(x, r)``'s y, forward
and backward. GPU (cuda-marked): the same accumulation through the CUDA kernels' accumulating reductions."""

from __future__ import annotations

import contextlib

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
import pytest
from blutensor.ext import recording_leaf_adds

rng = np.random.default_rng(11)
N, C = 70, 40  # 3 row blocks of the compiled kernels' dweight partials


def _cuda_ok() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _compiled() -> bool:
    from blutensor.backends.numpy import available

    return available()


def _data(c: int = C):
    x, r, gy, gh = (rng.standard_normal((N, c)).astype(np.float32) for _ in range(4))
    w = (1 + 0.1 * rng.standard_normal(c)).astype(np.float32)
    g0 = rng.standard_normal(c).astype(np.float32)  # what the weight's .grad holds before (an earlier micro-step)
    return x, r, w, gy, gh, g0


def _run(op, arrays, device="cpu", offers=True, autocast=False):
    """The weight's .grad after one backward into a buffer holding g0, and the engine's separate adds (shapes)."""
    x, r, w, gy, gh, g0 = arrays
    c = w.shape[0]
    t = lambda a: bt.tensor(a, device=device, requires_grad=True)  # noqa: E731
    xt, rt, wt = t(x), t(r), t(w)
    wt.grad = bt.tensor(g0, device=device)
    with recording_leaf_adds(offers=offers) as adds:
        with bt.autocast(device, dtype=bt.bfloat16, enabled=autocast):
            if op == "rms_norm":
                y = F.rms_norm(xt, (c,), wt, 1e-5)
                loss = (y.to(bt.float32) * bt.tensor(gy, device=device)).sum()
            else:
                h, y = F.add_rms_norm(xt, rt, (c,), wt, 1e-5)
                loss = (y.to(bt.float32) * bt.tensor(gy, device=device)).sum() + (h * bt.tensor(gh, device=device)
                                                                                 ).sum()
        loss.backward()
    return wt.grad.to("cpu").numpy().copy(), list(adds)


def _dweight64(op, arrays):
    x, r, w, gy, gh, g0 = (a.astype(np.float64) for a in arrays)
    h = x if op == "rms_norm" else x + r
    return g0 + (gy * h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-5)).sum(0)


@pytest.mark.parametrize("path", ["compiled", "numpy"])
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
def test_weight_gradient_accumulates_in_the_kernel_cpu(op, path):
    if path == "compiled" and not _compiled():
        pytest.skip("no C compiler: the compiled CPU kernels are not built")
    arrays = _data()
    with bt.ext.reference_kernels() if path == "numpy" else contextlib.nullcontext():
        got, adds = _run(op, arrays)
        want, ref_adds = _run(op, arrays, offers=False)
    assert (C,) in ref_adds  # without the offer the weight's gradient takes the engine's add
    assert (C,) not in adds and (N, C) in adds, adds  # with it the kernel added dweight (x's gradient: the engine)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, _dweight64(op, arrays), rtol=1e-5, atol=1e-4)


def test_compiled_rms_norm_is_bitwise_add_rms_norm():
    """rms_norm(x + r) and add_rms_norm(x, r)'s y: the same values and gradients, bit for bit (what lets a model
    fuse the residual add into the norm without changing its losses)."""
    if not _compiled():
        pytest.skip("no C compiler: the compiled CPU kernels are not built")
    x, r, w, gy, gh, _ = _data()
    for weight in (True, False):
        ts = [bt.tensor(a, requires_grad=True) for a in (x, r, w)]
        wt = ts[2] if weight else None
        h, y = F.add_rms_norm(ts[0], ts[1], (C,), wt, 1e-5)
        assert y.grad_fn.ctx.saved[3] == "c"  # the compiled kernels served the fused op
        ((y * bt.tensor(gy)).sum() + (h * bt.tensor(gh)).sum()).backward()
        us = [bt.tensor(a, requires_grad=True) for a in (x, r, w)]
        vt = us[2] if weight else None
        h2 = us[0] + us[1]
        y2 = F.rms_norm(h2, (C,), vt, 1e-5)
        assert y2.grad_fn.kernel.PLUGIN_NAME == "blutensor.cpu.rms_norm"
        ((y2 * bt.tensor(gy)).sum() + (h2 * bt.tensor(gh)).sum()).backward()
        np.testing.assert_array_equal(y.detach().numpy(), y2.detach().numpy())
        np.testing.assert_array_equal(h.detach().numpy(), h2.detach().numpy())
        for a, b in zip(ts[:3 if weight else 2], us):
            np.testing.assert_array_equal(a.grad.numpy(), b.grad.numpy())


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_ok(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("cols", [64, 200, 2048])
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
def test_weight_gradient_accumulates_in_the_kernel_cuda(op, cols, autocast):
    """GPU twin: the CUDA kernels add dweight into the float32 .grad buffer (the accumulating reductions of
    kernels/rms_norm.cu and add_rms_norm.cu, the register-resident and warp-per-row paths), bitwise what the
    engine's add gives, and old + dweight of the float64 reference."""
    arrays = _data(cols)
    got, adds = _run(op, arrays, "cuda", autocast=autocast)
    want, ref_adds = _run(op, arrays, "cuda", offers=False, autocast=autocast)
    assert (cols,) in ref_adds and (cols,) not in adds, adds
    np.testing.assert_array_equal(got, want)
    ref = _dweight64(op, arrays)
    tol = 3e-2 if autocast else 2e-5
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * max(1.0, float(np.abs(ref).max())) * 4)
