"""The fused MLP on a CUDA GPU (blutensor.ops.gelu_mlp through the selected GEMM provider, cuBLASLt's GELU_AUX_BIAS
and DGELU_BGRAD epilogues with blublas' 'cublas'): values and gradients against float64 NumPy and against the unfused
ops (linear, gelu, linear) for fp32, tf32 and bf16 on small odd shapes, with and without biases, gradients added into
existing float32 buffers, and no separate GELU-backward kernel where cuBLASLt fuses it (the CPU twins:
test_gelu_mlp.py)."""

from __future__ import annotations

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
import pytest
from blutensor import ext
from blutensor.autograd.node import ACCUMULATED, Ctx
from blutensor.ops import gelu_mlp
from conftest import HAS_CUDA, rng
from test_gelu_mlp import _inputs as _cpu_inputs

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs CuPy and a CUDA GPU")]

SHAPES = [(37, 40, 72), (37, 40, 36)]  # d_ff 36: a pre-activation leading dimension cuBLASLt's GELU aux refuses
K0, K1 = 0.7978845608028654, 0.044715


def _inputs(shape, bias, seed=0):
    m, d, ff = shape
    return list(_cpu_inputs(seed, bias, m, d, ff))


def _ref64(x, w1, b1, w2, b2, g):
    """(y, gx, gw1, gb1, gw2, gb2) in float64."""
    u = x @ w1.T + (0 if b1 is None else b1)
    t = np.tanh(K0 * (u + K1 * u**3))
    h = 0.5 * u * (1 + t)
    du = (g @ w2) * (0.5 * (1 + t) + 0.5 * u * (1 - t * t) * K0 * (1 + 3 * K1 * u * u))
    return (h @ w2.T + (0 if b2 is None else b2), du @ w1, du.T @ x, None if b1 is None else du.sum(0), g.T @ h,
            None if b2 is None else g.sum(0))


def _unfused(args):
    """The same through blutensor's ops and autograd on CUDA (float32)."""
    ts = [None if a is None else bt.tensor(a, device="cuda", requires_grad=True) for a in args[:5]]
    y = F.linear(F.gelu(F.linear(ts[0], ts[1], ts[2]), approximate="tanh"), ts[3], ts[4])
    (y * bt.tensor(args[5], device="cuda")).sum().backward()
    return [y.to("cpu").numpy()] + [None if t is None else t.grad.to("cpu").numpy() for t in ts]


def _fused(arrays, into=None):
    ctx = Ctx()
    ctx.needs = (True, True, arrays[2] is not None, True, arrays[4] is not None)
    y = gelu_mlp.gelu_mlp_forward(ctx, *arrays[:5])
    ctx.grad_into = into
    return [y, *gelu_mlp.gelu_mlp_backward(ctx, arrays[5])]


def _host(a):
    return a.get() if hasattr(a, "get") else a


def _err(got, want):
    return float(np.abs(np.asarray(got, np.float64) - want).max() / max(1e-30, np.abs(want).max()))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_mlp_matches_float64_and_the_unfused_ops(shape, precision, bias):
    import cupy

    args = _inputs(shape, bias)
    tol = {"fp32": 1e-5, "tf32": 5e-3}[precision]
    with bt.policy.scope(precision=precision):
        dev = [None if a is None else cupy.asarray(a) for a in args]
        assert gelu_mlp.fusing_provider(dev[0]) is not None, "the selected GEMM provider does not fuse GELU"
        got = [None if a is None else _host(a) for a in _fused(dev)]
        unf = _unfused(args)
    ref = _ref64(*[None if a is None else a.astype(np.float64) for a in args])
    for i, (a, b, r) in enumerate(zip(got, unf, ref)):
        assert (a is None) == (r is None), i
        if r is not None:
            assert _err(a, r) <= tol, (i, _err(a, r))
            assert _err(a, b) <= 2 * tol, (i, _err(a, b))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_fused_mlp_matches_float64_and_adds_into_float32_buffers(shape, bias):
    """bf16 bits in (as autocast's casts give them): bf16 output and input gradient, float32 weight and bias
    gradients added into existing buffers; without buffers the bias gradient comes back as bf16 bits."""
    import cupy

    args = _inputs(shape, bias, seed=1)
    bits = [None if a is None else ext.cast_to_bf16(cupy.asarray(a)) for a in args]
    vals = [None if b is None else ext.cast_to_f32(b).get().astype(np.float64) for b in bits]
    ref = _ref64(*vals)
    r = rng(2)
    old = [None if a is None else r.standard_normal(a.shape).astype(np.float32) for a in args[1:5]]
    bufs = [None if o is None else cupy.asarray(o) for o in old]
    got = _fused(bits, into=(None, *bufs))
    assert got[0].dtype == np.uint16 and got[1].dtype == np.uint16
    for i in (0, 1):
        assert _err(ext.cast_to_f32(got[i]).get(), ref[i]) <= 2e-2, (i, _err(ext.cast_to_f32(got[i]).get(), ref[i]))
    for j, (buf, o) in enumerate(zip(bufs, old)):
        if buf is None:
            assert got[2 + j] is None
            continue
        assert got[2 + j] is ACCUMULATED
        assert _err(buf.get() - o, ref[2 + j]) <= 2e-2, (j, _err(buf.get() - o, ref[2 + j]))
    if bias:
        gb1 = _fused(bits)[3]
        assert gb1.dtype == np.uint16 and _err(ext.cast_to_f32(gb1).get(), ref[3]) <= 2e-2


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_fused_mlp_launches_no_gelu_backward_kernel(precision):
    """Where cuBLASLt fuses both epilogues (d_ff a multiple of 8), no separate GELU kernel runs but the float32
    recompute of the GELU output for c_proj's weight gradient (bf16 keeps it: none at all)."""
    import cupy

    args = _inputs((64, 40, 72), True, seed=3)
    with bt.policy.scope(precision="tf32" if precision == "tf32" else "fp32"):
        dev = [cupy.asarray(a) for a in args]
        if precision == "bf16":
            dev = [ext.cast_to_bf16(a) for a in dev]
        prov = gelu_mlp.fusing_provider(dev[0])
        if prov is None or "dgelu" not in ext.fused_epilogues(prov):
            pytest.skip(f"the GEMM provider {getattr(prov, 'PLUGIN_NAME', None)} does not fuse dgelu")
        _fused(dev)  # warm-up: kernels compiled, cuBLASLt algorithms chosen
        with ext.recording_kernel_launches() as names:
            _fused(dev)
            cupy.cuda.get_current_stream().synchronize()
    gelu = {n: c for n, c in names.items() if n.startswith("blu_gelu")}
    want = {} if precision == "bf16" else {"blu_gelu_forward_f32": 1}
    assert {n.replace("plain_", ""): c for n, c in gelu.items()} == want, gelu
