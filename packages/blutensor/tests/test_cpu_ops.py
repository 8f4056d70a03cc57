"""The compiled CPU kernels (blutensor.backends.numpy) against the NumPy reference kernels in float64.

Every kernel class runs forward and backward on float32 inputs and is compared with the reference op
(blutensor.ops.nn_ops, optim) run on the same values in float64; AdamW must equal the reference bitwise.
Determinism: the same thread count gives the same bits, and the kernels are built to give the same bits for
any thread count. Fallback: without the library (BLUTRAIN_CPU_KERNELS=0, no compiler) the reference runs and a
warning says so once.
"""

from __future__ import annotations

import os
import subprocess
import sys

import blutensor as bt
import numpy as np
import pytest
from blutensor.autograd.node import Ctx
from blutensor.backends.numpy import available
from blutensor.backends.numpy import nn as cpu_nn
from blutensor.ops import dispatch, nn_ops

pytestmark = pytest.mark.skipif(not available(), reason="compiled CPU kernels unavailable (no C compiler)")

R = np.random.default_rng(0)


def f32(*shape, scale=1.0):
    return (R.standard_normal(shape) * scale).astype(np.float32)


def ctx(n):
    c = Ctx()
    c.needs = (True,) * n
    return c


def run_pair(kernel, ref_fwd, ref_bwd, arrays, attrs, n_in, grad_scale=1.0):
    """(kernel outputs, reference outputs): forward value and input gradients, the reference in float64."""
    c1, c2 = ctx(n_in), ctx(n_in)
    y1 = kernel.forward(c1, *arrays, **attrs)
    assert not getattr(c1, "ref", False), "the compiled kernel should have served this call"
    wide = [a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype == np.float32 else a for a in arrays]
    y2 = ref_fwd(c2, *wide, **attrs)
    g = (R.standard_normal(np.shape(y1)) * grad_scale).astype(np.float32)
    g1 = kernel.backward(c1, g)
    g2 = ref_bwd(c2, g.astype(np.float64))
    return (y1, *g1), (y2, *g2)


def close(got, want, rtol=2e-5, atol=2e-6):
    for a, b in zip(got, want):
        if a is None or b is None:
            assert a is None and b is None
            continue
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol * max(1.0, float(np.abs(b).max())))


def test_cpu_kernels_are_selected_for_float32_and_bfloat16():
    for op in ("gelu", "layer_norm", "cross_entropy", "embedding", "sdpa"):
        for dt in ("float32", "bfloat16"):
            assert dispatch.resolve(op, "cpu", dt).PLUGIN_NAME == f"blutensor.cpu.{op}"
        assert dispatch.resolve(op, "cpu", "float64").PLUGIN_NAME == f"blutensor.{op}"  # the reference


@pytest.mark.parametrize("shape", [(7,), (3, 1000), (2, 4096 + 5)])
def test_gelu_tanh_matches_reference(shape):
    x = f32(*shape, scale=3.0)
    x.flat[:3] = (0.0, 12.0, -12.0)
    got, want = run_pair(cpu_nn.GeluCpu, nn_ops.gelu_forward, nn_ops.gelu_backward, (x,), {"approximate": "tanh"}, 1)
    close(got, want)


def test_gelu_erf_runs_the_reference():
    c = ctx(1)
    x = f32(5)
    y = cpu_nn.GeluCpu.forward(c, x, approximate="none")
    assert c.ref
    np.testing.assert_array_equal(y, nn_ops.gelu_forward(ctx(1), x, approximate="none"))


@pytest.mark.parametrize("N,C,affine,needs", [(5, 128, (True, True), (1, 1, 1)), (70, 48, (True, False), (1, 1, 0)),
                                              (33, 19, (False, False), (1, 0, 0)), (64, 384, (True, True), (0, 1, 1))])
def test_layer_norm_matches_reference(N, C, affine, needs):
    x = f32(N, C, scale=2.0) + 3.0
    w = f32(C) if affine[0] else None
    b = f32(C) if affine[1] else None
    args = (x, w, b)
    c1, c2 = Ctx(), Ctx()
    c1.needs = c2.needs = tuple(bool(v) for v in needs)
    attrs = {"normalized_shape": (C,), "eps": 1e-5}
    y1 = cpu_nn.LayerNormCpu.forward(c1, *args, **attrs)
    assert not getattr(c1, "ref", False)
    y2 = nn_ops.layer_norm_forward(c2, *(None if a is None else a.astype(np.float64) for a in args), **attrs)
    g = f32(N, C)
    close((y1, *cpu_nn.LayerNormCpu.backward(c1, g)), (y2, *nn_ops.layer_norm_backward(c2, g.astype(np.float64))))


@pytest.mark.parametrize("N,C,weight,needs", [(5, 128, True, (1, 1)), (70, 48, True, (0, 1)), (33, 19, False, (1, 0)),
                                            (64, 384, True, (1, 0))])
def test_rms_norm_matches_reference(N, C, weight, needs):
    from blutensor.ops import decoder_ops

    assert dispatch.resolve("rms_norm", "cpu", "float32").PLUGIN_NAME == "blutensor.cpu.rms_norm"
    x = f32(N, C, scale=2.0) + 1.0
    w = f32(C) if weight else None
    c1, c2 = Ctx(), Ctx()
    c1.needs = c2.needs = tuple(bool(v) for v in needs)
    attrs = {"normalized_shape": (C,), "eps": 1e-5}
    y1 = cpu_nn.RmsNormCpu.forward(c1, x, w, **attrs)
    assert not getattr(c1, "ref", False)
    y2 = decoder_ops.rms_norm_forward(c2, x.astype(np.float64), None if w is None else w.astype(np.float64), **attrs)
    g = f32(N, C)
    close((y1, *cpu_nn.RmsNormCpu.backward(c1, g)), (y2, *decoder_ops.rms_norm_backward(c2, g.astype(np.float64))))


@pytest.mark.parametrize("N,C,reduction,ignore,ls", [(64, 1024, "mean", None, 0.0), (37, 50, "sum", 3, 0.0),
                                                      (20, 17, "none", 5, 0.1), (9, 300, "mean", 0, 0.2)])
def test_cross_entropy_matches_reference(N, C, reduction, ignore, ls):
    z = f32(N, C, scale=4.0)
    t = R.integers(0, C, N)
    attrs = {"reduction": reduction, "label_smoothing": ls}
    if ignore is not None:
        t[:ignore] = -100
    got, want = run_pair(cpu_nn.CrossEntropyCpu, nn_ops.cross_entropy_forward, nn_ops.cross_entropy_backward,
                         (z, t), attrs, 2)
    close(got, want)


def test_cross_entropy_bad_target_is_named_by_the_reference():
    with pytest.raises(bt.ShapeError, match="target index 9 out of range for 4 classes"):
        bt.nn.functional.cross_entropy(bt.tensor(f32(3, 4)), bt.tensor(np.array([0, 9, 1])))


def test_cross_entropy_nan_logit_gives_nan_loss():
    z = f32(4, 64)
    z[2, 5] = np.nan
    loss = cpu_nn.CrossEntropyCpu.forward(ctx(2), z, np.arange(4), reduction="none")
    assert np.isnan(loss[2]) and np.isfinite(loss[[0, 1, 3]]).all()


def test_embedding_backward_accumulates_repeated_tokens():
    idx = R.integers(0, 13, (6, 40))
    idx[0, :5] = 7
    w = f32(13, 72)
    got, want = run_pair(cpu_nn.EmbeddingCpu, nn_ops.embedding_forward, nn_ops.embedding_backward, (idx, w), {}, 2)
    close(got, want)


@pytest.mark.parametrize("L,S,E,Ev,causal", [(128, 128, 32, 32, True), (70, 70, 40, 40, True),
                                              (33, 50, 20, 24, False), (50, 33, 16, 64, True), (5, 7, 3, 2, True)])
def test_sdpa_matches_reference(L, S, E, Ev, causal):
    q, k, v = f32(2, 3, L, E), f32(2, 3, S, E), f32(2, 3, S, Ev)
    got, want = run_pair(cpu_nn.SdpaCpu, nn_ops.sdpa_forward, nn_ops.sdpa_backward, (q, k, v),
                         {"is_causal": causal, "scale": 0.3}, 4)
    close(got, want, rtol=1e-4, atol=1e-5)


def test_sdpa_mask_and_dropout_run_the_reference():
    q = f32(1, 4, 8)
    c = ctx(4)
    cpu_nn.SdpaCpu.forward(c, q, q, q, np.ones((4, 4), bool))
    assert c.ref


def test_adamw_is_bitwise_the_reference(monkeypatch):
    from blutensor.backends.numpy import optim as cpu_optim
    from blutensor.optim import adamw

    x0 = f32(1000, 3)
    grads = [f32(1000, 3) for _ in range(3)]

    def three_steps():
        p = bt.tensor(x0.copy(), requires_grad=True)
        m, v = np.zeros_like(x0), np.zeros_like(x0)
        for step, g in enumerate(grads, 1):
            p.grad = bt.tensor(g)
            adamw.adamw_update(p, m, v, step, 3e-3, 0.9, 0.95, 1e-8, 0.1)
        return p.numpy(), m, v

    compiled = three_steps()
    monkeypatch.setattr(cpu_optim, "_lib", lambda: None)  # the NumPy reference
    reference = three_steps()
    for a, b in zip(compiled, reference):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(compiled[0], x0)


@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_clip_grad_norm_matches_float64(max_norm):
    shapes = [(300, 7), (40000,), (3,), (1,)]
    ps = [bt.tensor(f32(*s), requires_grad=True) for s in shapes]
    gs = [f32(*s) for s in shapes]
    for p, g in zip(ps, gs):
        p.grad = bt.tensor(g.copy())
    total = float(bt.optim.clip_grad_norm_(ps, max_norm))
    want = np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in gs))
    assert abs(total - want) <= 1e-6 * want
    coef = min(max_norm / (want + 1e-6), 1.0)
    for p, g in zip(ps, gs):
        np.testing.assert_allclose(p.grad.numpy(), g * coef, rtol=1e-6)


def _kernel_outputs():
    """Outputs of every kernel on fixed inputs (forward and backward)."""
    r = np.random.default_rng(5)
    x = r.standard_normal((300, 96)).astype(np.float32)
    w, b = r.standard_normal(96).astype(np.float32), r.standard_normal(96).astype(np.float32)
    q = r.standard_normal((3, 2, 64, 16)).astype(np.float32)
    outs = []
    for K, arrays, attrs, n in [(cpu_nn.GeluCpu, (x,), {"approximate": "tanh"}, 1),
                                (cpu_nn.LayerNormCpu, (x, w, b), {"normalized_shape": (96,)}, 3),
                                (cpu_nn.CrossEntropyCpu, (x, r.integers(0, 96, 300)), {}, 2),
                                (cpu_nn.EmbeddingCpu, (r.integers(0, 50, 300), x[:50]), {}, 2),
                                (cpu_nn.SdpaCpu, (q, q * 0.5, q + 1), {"is_causal": True}, 4)]:
        c = ctx(n)
        y = K.forward(c, *arrays, **attrs)
        outs += [y, *(g for g in K.backward(c, np.ones_like(y)) if g is not None)]
    grads = [r.standard_normal(s).astype(np.float32) for s in ((50000,), (77, 3))]
    ps = [bt.tensor(np.zeros_like(g), requires_grad=True) for g in grads]
    for p, g in zip(ps, grads):
        p.grad = bt.tensor(g)
    outs.append(np.asarray(bt.optim.clip_grad_norm_(ps, 0.1).numpy()))
    return outs


def test_same_results_for_the_same_and_for_other_thread_counts():
    before = bt.get_num_threads()
    try:
        bt.set_num_threads(2)
        a, a2 = _kernel_outputs(), _kernel_outputs()
        bt.set_num_threads(1)
        b = _kernel_outputs()
    finally:
        bt.set_num_threads(before)
    for x, y, z in zip(a, a2, b):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(x, z)


def test_set_num_threads_api(monkeypatch):
    from blutensor import threads

    before = bt.get_num_threads()
    try:
        bt.set_num_threads(3)
        assert bt.get_num_threads() == 3
        from threadpoolctl import threadpool_info

        assert all(i["num_threads"] == 1 for i in threadpool_info() if i["user_api"] == "blas")
        for bad in (0, -1, 1.5, "2", True):
            with pytest.raises(bt.ArgumentError, match="set_num_threads"):
                bt.set_num_threads(bad)
    finally:
        bt.set_num_threads(before)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cores = len(os.sched_getaffinity(0))
    assert threads.default_num_threads() == max(1, cores // 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert threads.default_num_threads() == 5


def test_threaded_host_gemm_matches_numpy():
    from blutensor.backends.numpy.gemm import matmul

    a, b = f32(517, 130), f32(130, 257)
    want = a.astype(np.float64) @ b.astype(np.float64)
    for n in (1, 2, 3):
        got = matmul(a, b, n)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(got, matmul(a, b, n))
    x, y = f32(64, 600), f32(64, 300)
    np.testing.assert_array_equal(matmul(x.T, y, 2), x.T @ y)  # a transposed view (the weight gradient's layout)
    p, q, w = f32(6, 3, 70, 40), f32(6, 3, 40, 50), f32(40, 50)
    for a, b in ((p, q), (p, w), (p, q.swapaxes(-1, -2).copy().swapaxes(-1, -2))):
        np.testing.assert_allclose(matmul(a, b, 2), np.matmul(a.astype(np.float64), b.astype(np.float64)),
                                   rtol=1e-4, atol=1e-4)


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


FALLBACK = """
import numpy as np, blutensor as bt
x = bt.tensor(np.linspace(-3, 3, 50, dtype=np.float32), requires_grad=True)
y = bt.nn.functional.gelu(x, approximate="tanh")
y.sum().backward()
y2 = bt.nn.functional.gelu(x, approximate="tanh")
from blutensor.backends.numpy import status
print("available", status()["available"], float(y.numpy().sum()))
"""


def test_without_the_library_the_reference_runs_and_says_so_once(tmp_path):
    r = _run(FALLBACK, BLUTRAIN_CPU_KERNELS="0")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("compiled CPU kernels unavailable (BLUTRAIN_CPU_KERNELS=0)") == 1
    assert "available False" in r.stdout
    x = np.linspace(-3, 3, 50, dtype=np.float32)
    want = float(nn_ops.gelu_forward(ctx(1), x.astype(np.float64), approximate="tanh").sum())
    assert abs(float(r.stdout.split()[-1]) - want) < 1e-4
    r = _run(FALLBACK, CC="no-such-compiler", BLUTRAIN_CPU_CACHE=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("no C compiler ('no-such-compiler' not on PATH") == 1
    assert "available False" in r.stdout


def test_the_library_is_built_once_into_the_cache(tmp_path):
    code = "from blutensor.backends.numpy import status; s = status(); print(s['available'], s['build_s'] is not None)"
    first = _run(code, BLUTRAIN_CPU_CACHE=str(tmp_path))
    second = _run(code, BLUTRAIN_CPU_CACHE=str(tmp_path))
    assert first.stdout.split() == ["True", "True"], first.stderr
    assert second.stdout.split() == ["True", "False"], second.stderr  # loaded from the cache, not rebuilt
    assert len(list(tmp_path.glob("blu_cpu_*.so"))) == 1


FORK = """
import os, numpy as np, blutensor as bt, blutensor.nn.functional as F
bt.set_num_threads(2)
x = bt.tensor(np.random.default_rng(0).standard_normal((1024, 512)).astype(np.float32))
want = F.gelu(x, approximate="tanh").numpy(), (x @ x.T).numpy()
pid = os.fork()
if pid == 0:
    ok = np.array_equal(F.gelu(x, approximate="tanh").numpy(), want[0]) and np.array_equal((x @ x.T).numpy(), want[1])
    os._exit(0 if ok else 3)
print("child", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_a_forked_child_runs_the_kernels_without_hanging():
    r = _run(FORK)  # GNU OpenMP cannot restart its pool after fork: the child's kernels run on one thread
    assert r.returncode == 0 and "child 0" in r.stdout, (r.stdout, r.stderr)


def _qkv_op_by_op(x, H, causal, scale):
    """sdpa_qkv's reference path: view/permute/contiguous + scaled_dot_product_attention + transpose/reshape."""
    import blutensor.nn.functional as F

    B, T, C3 = x.shape
    hd = C3 // (3 * H)
    parts = x.view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4)
    q, k, v = parts[0].contiguous(), parts[1].contiguous(), parts[2].contiguous()
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return y.transpose(1, 2).reshape(B, T, H * hd)


def _qkv_float64(x, g, H, causal, scale):
    """Attention forward and d(qkv) in NumPy float64 (softmax written out)."""
    B, T, C3 = x.shape
    hd = C3 // (3 * H)
    p5 = x.astype(np.float64).reshape(B, T, 3, H, hd).transpose(2, 0, 3, 1, 4)
    q, k, v = p5[0], p5[1], p5[2]
    sc = scale if scale is not None else 1 / np.sqrt(hd)
    s = q @ k.swapaxes(-1, -2) * sc
    if causal:
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = p @ v
    go = g.astype(np.float64).reshape(B, T, H, hd).transpose(0, 2, 1, 3)
    dv = p.swapaxes(-1, -2) @ go
    dp = go @ v.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * sc
    dq, dk = ds @ k, ds.swapaxes(-1, -2) @ q
    d = np.stack([dq, dk, dv]).transpose(1, 3, 0, 2, 4).reshape(B, T, C3)
    return o.transpose(0, 2, 1, 3).reshape(B, T, H * hd), d


@pytest.mark.parametrize("B, T, H, hd, causal, scale", [(2, 37, 3, 16, True, None), (3, 16, 2, 32, False, 0.3),
                                                        (1, 9, 1, 8, True, 1.0)])
def test_sdpa_qkv_reads_qkv_in_place_bitwise_the_op_path_and_float64(B, T, H, hd, causal, scale):
    """The host sdpa_qkv (q/k/v read in place, no copies) equals the op-by-op path bit for bit, and NumPy float64
    within float32 rounding; a profiler observer sees it as 'sdpa_qkv'."""
    from blutensor.backends.cupy.sdpa import sdpa_qkv

    xa, ga = f32(B, T, 3 * H * hd), f32(B, T, H * hd)
    outs = []
    for fn in (lambda x: sdpa_qkv(x, H, is_causal=causal, scale=scale), lambda x: _qkv_op_by_op(x, H, causal, scale)):
        x = bt.tensor(xa, requires_grad=True)
        y = fn(x)
        y.backward(bt.tensor(ga))
        outs.append((y.numpy(), x.grad.numpy(), y.grad_fn.op))
    (y, dx, op), (y_ref, dx_ref, _) = outs
    assert op == "SdpaQkvCpu"  # the fused host path ran
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(dx, dx_ref)
    y64, d64 = _qkv_float64(xa, ga, H, causal, scale)
    np.testing.assert_allclose(y, y64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, d64, rtol=1e-4, atol=1e-5)
    seen = []

    def obs(name, args, attrs, call):
        seen.append(name)
        return call()

    dispatch.observers.append(obs)
    try:
        sdpa_qkv(bt.tensor(xa), H, is_causal=causal, scale=scale)
    finally:
        dispatch.observers.remove(obs)
    assert seen[0] == "sdpa_qkv"


def test_sdpa_qkv_with_dropout_takes_the_op_path():
    from blutensor.backends.cupy.sdpa import sdpa_qkv

    x = bt.tensor(f32(2, 8, 3 * 2 * 8), requires_grad=True)
    assert sdpa_qkv(x, 2, dropout_p=0.5).grad_fn.op != "SdpaQkvCpu"
