"""Gradient accumulation in the kernel (blutensor.autograd.engine): where a leaf already owns a float32 ``.grad``
buffer, linear / layer_norm / embedding backward add their weight gradients into it (a beta = 1 GEMM on CUDA)
instead of handing the engine an array to add. The sums must equal the engine's own accumulation: bit for bit on
the CPU, within float32 rounding through a provider GEMM with beta = 1."""

from __future__ import annotations

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
import pytest
from blutensor.autograd import engine
from conftest import HAS_CUDA, host, rng

needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CuPy and a CUDA GPU")


def _model(dev, seed=0):
    r = rng(seed)

    def p(*s):
        return bt.nn.Parameter(bt.tensor((r.standard_normal(s) * 0.3).astype(np.float32), device=dev))

    return {"wte": p(11, 8), "wpe": p(6, 8), "ln_w": p(8), "ln_b": p(8), "w1": p(16, 8), "b1": p(16),
            "w2": p(8, 16), "b2": p(8)}


def _loss(m, idx, pos, y):
    x = F.embedding(idx, m["wte"]) + F.embedding(pos, m["wpe"])
    h = F.layer_norm(x, (8,), m["ln_w"], m["ln_b"])
    h = F.linear(F.gelu(F.linear(h, m["w1"], m["b1"]), approximate="tanh"), m["w2"], m["b2"])
    logits = F.linear(x + h, m["wte"])  # tied: wte gets an embedding and a linear gradient
    return F.cross_entropy(logits.view(-1, 11), y.view(-1))


def _data(dev):
    r = rng(7)
    idx = bt.tensor(r.integers(0, 11, (3, 6)), device=dev)  # repeated tokens
    pos = bt.arange(6, dtype=bt.int64, device=dev)
    y = bt.tensor(r.integers(0, 11, (3, 6)), device=dev)
    return idx, pos, y


def _run(dev, steps, monkeypatch=None, offer=True):
    """Grads after ``steps`` backward passes that accumulate (the first creates the buffers); the number of leaf
    gradients the engine itself added on the later passes."""
    m = _model(dev)
    data = _data(dev)
    calls = []
    real = engine._accumulate

    def spy(t, g, T):
        if g is not None and t.grad is not None:
            calls.append(tuple(t.shape))
        return real(t, g, T)

    sums = []
    real_sum = engine._sum
    if monkeypatch is not None:
        monkeypatch.setattr(engine, "_accumulate", spy)
        monkeypatch.setattr(engine, "_sum", lambda a, b: (sums.append(a.shape), real_sum(a, b))[1])
        if not offer:
            monkeypatch.setattr(engine, "_targets", lambda node, fan_in: None)
            monkeypatch.setattr(engine, "_pending_for", lambda node, pending, capture: None)
    for _ in range(steps):
        _loss(m, *data).backward()
    grads = {k: host(v.grad) for k, v in m.items()}
    return (grads, calls, sums) if monkeypatch is not None else (grads, calls)


def test_cpu_accumulation_in_kernels_is_bit_exact(monkeypatch):
    ref, ref_calls, ref_sums = _run("cpu", 3, monkeypatch, offer=False)
    monkeypatch.undo()
    got, calls, sums = _run("cpu", 3, monkeypatch, offer=True)
    # the residual stream's gradient (x + h, and layer_norm(x)) is summed by layer_norm's backward, not the engine
    assert len(sums) == len(ref_sums) - 3 and (3, 6, 8) in ref_sums
    assert len(ref_calls) == 2 * 8  # without offers: every parameter on passes 2 and 3 (wte: its summed gradient)
    assert calls == [(11, 8)] * 2  # with offers: all but the tied wte (summed first on the host) added in kernels
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


def test_accumulated_grads_match_numpy_float64():
    """Three accumulated passes equal three times one pass's gradient (float64 check of the sums)."""
    one, _ = _run("cpu", 1)
    three, _ = _run("cpu", 3)
    for k in one:
        np.testing.assert_allclose(three[k].astype(np.float64), 3 * one[k].astype(np.float64), rtol=1e-5,
                                   atol=1e-6, err_msg=k)


def test_ready_hooks_fire_once_after_the_last_contribution():
    m = _model("cpu")
    data = _data("cpu")
    _loss(m, *data).backward()
    first = host(m["wte"].grad).copy()
    seen = []
    m["wte"].register_post_accumulate_grad_hook(lambda t: seen.append(host(t.grad).copy()))
    _loss(m, *data).backward()
    assert len(seen) == 1  # once, though two kernels (embedding, lm_head) added into the buffer
    np.testing.assert_array_equal(seen[0], host(m["wte"].grad))
    np.testing.assert_allclose(seen[0], 2 * first, rtol=1e-5, atol=1e-7)


def test_tensor_hook_sees_the_gradient_so_no_buffer_is_offered():
    m = _model("cpu")
    data = _data("cpu")
    _loss(m, *data).backward()
    g1 = host(m["w1"].grad).copy()
    got = []
    m["w1"].register_hook(lambda g: (got.append(host(g).copy()), g * 2.0)[1])
    _loss(m, *data).backward()
    assert len(got) == 1
    np.testing.assert_allclose(got[0], g1, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(host(m["w1"].grad), 3 * g1, rtol=1e-5, atol=1e-6)  # g1 + 2 * g1


def test_autograd_grad_leaves_dot_grad_alone():
    m = _model("cpu")
    data = _data("cpu")
    _loss(m, *data).backward()
    before = host(m["w2"].grad).copy()
    (gw,) = bt.autograd.grad(_loss(m, *data), [m["w2"]])
    np.testing.assert_array_equal(host(m["w2"].grad), before)
    np.testing.assert_allclose(host(gw), before, rtol=1e-6, atol=1e-7)


def test_summed_without_a_pending_gradient_is_refused():
    class Bad(bt.autograd.Function):
        GRAD_SUM = True

        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            return bt.autograd.Summed(g._data)

    x = bt.tensor(np.ones(3, np.float32), requires_grad=True)
    with pytest.raises(bt.errors.AutogradError, match="returned Summed for input 0"):
        Bad.apply(x * 1.0).sum().backward()


def test_accumulated_for_an_input_without_a_buffer_is_refused():
    class Bad(bt.autograd.Function):
        GRAD_INTO = True

        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            return bt.autograd.ACCUMULATED

    x = bt.nn.Parameter(bt.ones(3))
    with pytest.raises(bt.errors.AutogradError, match="returned ACCUMULATED for input 0"):
        Bad.apply(x).sum().backward()  # x.grad is None: nothing was offered


def test_function_with_grad_into_adds_into_the_buffer():
    class Scale(bt.autograd.Function):
        GRAD_INTO = True

        @staticmethod
        def forward(ctx, x):
            return x * 3.0

        @staticmethod
        def backward(ctx, g):
            into = ctx.grad_into
            if into is not None and into[0] is not None:
                buf = into[0]
                buf += 3.0 * g._data
                return bt.autograd.ACCUMULATED
            return g * 3.0

    x = bt.nn.Parameter(bt.tensor(np.arange(4, dtype=np.float32)))
    Scale.apply(x).sum().backward()
    buf = x.grad._data
    Scale.apply(x).sum().backward()
    assert x.grad._data is buf  # the same buffer, added into
    np.testing.assert_array_equal(host(x.grad), np.full(4, 6.0, np.float32))


# ---------------------------------------------------------------- the CUDA formulas, on NumPy (fake CuPy)
def _host_provider():
    """An installed GEMM provider that declares bf16, ACCUMULATE (beta = 1) and HOST_ARRAYS (a NumPy reference),
    found by those capabilities; the test skips where none is installed."""
    from blutensor import ext

    for p in ext.gemm_providers():
        if ("bf16" in getattr(p, "PRECISIONS", ()) and getattr(p, "ACCUMULATE", False)
                and getattr(p, "HOST_ARRAYS", False)):
            return p
    pytest.skip("no installed GEMM provider declares bf16 and ACCUMULATE on host arrays")


def test_provider_matmul_into_equals_product_plus_add():
    """The beta = 1 GEMM of a host-array provider (its NumPy reference) equals out + a @ b (fp32 and bf16
    inputs)."""
    prov = _host_provider()
    from blutensor.backends import bf16_bits_to_f32, f32_to_bf16_bits
    from blutensor.gemm import provider_matmul_into

    r = rng(3)
    a = r.standard_normal((40, 24)).astype(np.float32)
    b = r.standard_normal((24, 9)).astype(np.float32)
    out0 = r.standard_normal((40, 9)).astype(np.float32)
    for prec, tol in (("fp32", 1e-5), ("tf32", 3e-3)):
        out = out0.copy()
        provider_matmul_into(prov, a, b, out, np, precision=prec)
        ref = out0.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64)
        np.testing.assert_allclose(out, ref, rtol=tol, atol=10 * tol)
    # bf16 operands (uint16 bits), float32 out: the transposed-A layout of a weight gradient
    ab, bb = f32_to_bf16_bits(a, np), f32_to_bf16_bits(r.standard_normal((40, 9)).astype(np.float32), np)
    w0 = r.standard_normal((24, 9)).astype(np.float32)
    out = w0.copy()
    provider_matmul_into(prov, ab.T, bb, out, np)
    ref = w0.astype(np.float64) + bf16_bits_to_f32(ab, np).astype(np.float64).T @ bf16_bits_to_f32(bb, np)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="provider_matmul_into"):
        provider_matmul_into(prov, a, b, np.zeros((3, 3), np.float32), np)


@pytest.fixture
def numpy_as_cupy(monkeypatch):
    """backends.cupy.linalg's classes on NumPy bf16 bits through a host-array provider (found by its capabilities)."""
    prov = _host_provider()
    from blutensor.backends import f32_to_bf16_bits
    from blutensor.backends.cupy import cast, linalg

    monkeypatch.setattr(linalg, "cupy", lambda: np)
    monkeypatch.setattr(linalg, "bf16_provider", lambda: prov)
    monkeypatch.setattr(cast, "to_bf16", lambda a: f32_to_bf16_bits(a, np))
    monkeypatch.setattr(linalg, "_ones_bf16", lambda n: np.full((1, n), 0x3F80, dtype=np.uint16))
    return linalg


def test_bf16_linear_backward_adds_into_float32_masters(numpy_as_cupy):
    """LinearCuda (bf16) backward with offered float32 buffers: dW and db land in them through beta = 1, equal to
    the same GEMMs into a zeroed float32 output added separately (bit for bit on the reference provider)."""
    from blutensor.autograd.node import ACCUMULATED, Ctx
    from blutensor.backends import bf16_bits_to_f32, f32_to_bf16_bits

    r = rng(5)

    def bits(s):
        return f32_to_bf16_bits(r.standard_normal(s).astype(np.float32), np)

    x, w, b, g = bits((2, 7, 16)), bits((12, 16)), bits((12,)), bits((2, 7, 12))
    ctx = Ctx()
    ctx.needs = (True, True, True)
    numpy_as_cupy.LinearCuda.forward(ctx, x, w, b)
    gw0 = r.standard_normal((12, 16)).astype(np.float32)
    gb0 = r.standard_normal(12).astype(np.float32)
    bw, bb = gw0.copy(), gb0.copy()
    ctx.grad_into = (None, bw, bb)
    gx, gw, gb = numpy_as_cupy.LinearCuda.backward(ctx, g)
    assert gw is ACCUMULATED and gb is ACCUMULATED and gx.dtype == np.uint16
    prov = numpy_as_cupy.bf16_provider()
    g2, x2 = g.reshape(-1, 12), x.reshape(-1, 16)
    sep_w = np.zeros((12, 16), np.float32)
    numpy_as_cupy.mm(prov, g2, x2, trans_a=True, out=sep_w)
    sep_b = np.zeros((1, 12), np.float32)
    numpy_as_cupy.mm(prov, np.full((1, 14), 0x3F80, np.uint16), g2, out=sep_b)
    np.testing.assert_array_equal(bw, gw0 + sep_w)
    np.testing.assert_array_equal(bb, gb0 + sep_b.reshape(-1))
    ref_w = gw0 + bf16_bits_to_f32(g2, np).astype(np.float64).T @ bf16_bits_to_f32(x2, np)
    np.testing.assert_allclose(bw, ref_w, rtol=1e-5, atol=1e-4)


def test_cast_forwards_only_float32_to_bfloat16():
    from blutensor.autograd.node import Ctx
    from blutensor.backends.cupy.cast import CastCuda

    ctx = Ctx()
    ctx.saved = (bt.float32, bt.bfloat16)
    assert CastCuda.forwards_grad_into(ctx)
    ctx.saved = (bt.bfloat16, bt.float32)
    assert not CastCuda.forwards_grad_into(ctx)


# ---------------------------------------------------------------- the same on the GPU
@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("autocast", [False, True])
def test_cuda_accumulation_in_kernels_matches_engine_adds(monkeypatch, autocast):
    """CUDA (fp32, and bf16 autocast through the weight casts): three accumulating passes with buffers offered
    equal the engine's separate adds within float32 rounding, and no leaf gradient is added by the engine."""
    def run(offer):
        m = _model("cuda")
        data = _data("cuda")
        calls = []
        real = engine._accumulate

        def spy(t, g, T):
            if g is not None and t.grad is not None:
                calls.append(tuple(t.shape))
            return real(t, g, T)

        with monkeypatch.context() as mp:
            mp.setattr(engine, "_accumulate", spy)
            if not offer:
                mp.setattr(engine, "_targets", lambda node, fan_in: None)
                mp.setattr(engine, "_pending_for", lambda node, pending, capture: None)
            for _ in range(3):
                if autocast:
                    with bt.autocast("cuda"):
                        bt.amp.precast(list(m.values()))
                        loss = _loss(m, *data)
                else:
                    loss = _loss(m, *data)
                loss.backward()
        return {k: host(v.grad) for k, v in m.items()}, calls

    ref, ref_calls = run(False)
    got, calls = run(True)
    assert ref_calls and calls == [], calls
    tol = 2e-2 if autocast else 1e-5  # bf16: the offered path skips rounding dW to bf16
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=tol, atol=tol * 1e-1, err_msg=k)


def test_provider_without_accumulate_gets_no_buffer(numpy_as_cupy, monkeypatch):
    """A GEMM provider that does not declare ACCUMULATE may ignore out/beta: the bf16 linear then returns its
    gradients (the engine adds them) and leaves the offered buffers alone."""
    from blutensor.autograd.node import ACCUMULATED, Ctx
    from blutensor.backends import f32_to_bf16_bits
    from blutensor.gemm import accumulates

    base = numpy_as_cupy.bf16_provider()

    class Plain(base):
        ACCUMULATE = False

    assert accumulates(base) and not accumulates(Plain)
    monkeypatch.setattr(numpy_as_cupy, "bf16_provider", lambda: Plain)
    r = rng(9)
    x, w, b, g = (f32_to_bf16_bits(r.standard_normal(s).astype(np.float32), np) for s in ((5, 8), (4, 8), (4,), (5, 4)))
    ctx = Ctx()
    ctx.needs = (True, True, True)
    numpy_as_cupy.LinearCuda.forward(ctx, x, w, b)
    bw, bb = np.ones((4, 8), np.float32), np.ones(4, np.float32)
    ctx.grad_into = (None, bw, bb)
    _, gw, gb = numpy_as_cupy.LinearCuda.backward(ctx, g)
    assert gw is not ACCUMULATED and gb is not ACCUMULATED and gw.dtype == np.uint16
    assert (bw == 1).all() and (bb == 1).all()
