"""Generated code: the C kernels compile and run; the CUDA text of the same kernels compiles with NVRTC
(CPU twin of the GPU check); the AdamW trace rule is bit-exact against blutensor's update."""

import math

import blucompiler
import blutensor as bt
import numpy as np
import pytest
from blucompiler.codegen import Input, KernelSpec, KOp, emit, translation_unit
from helpers import batch, make_model, tiny_cfg, train_step


def _compiled_tiny():
    m, o = make_model(tiny_cfg(n_layer=1))
    f = blucompiler.compile(train_step(m, o), backend="numpy")
    rng = np.random.default_rng(0)
    f(*batch(rng))
    f(*batch(rng))
    return f


def test_cuda_text_of_gpt2_kernels_compiles_with_nvrtc():
    pytest.importorskip("cuda.bindings.nvrtc")
    from blucompiler.lower_cuda import _nvrtc_cubin

    f = _compiled_tiny()
    specs = [k.spec() for k in f.last.runtime.kernels if k.layout is not None]
    assert len(specs) > 20
    src = translation_unit([emit(s, "cuda") for s in specs], "cuda")
    assert src.count('extern "C" __global__') == len(specs)
    try:
        cubin = _nvrtc_cubin(src, "gpt2_kernels.cu", "90")
    except OSError as e:  # no libnvrtc on this machine
        pytest.skip(str(e))
    assert cubin is not None and len(cubin) > 1000


def test_c_kernel_broadcast_strided_and_reduction():
    """A hand-written spec: strided (transposed) and broadcast inputs, then a row reduction."""
    from blucompiler.lower_c import compile_c

    f32 = np.dtype(np.float32)
    ew = KernelSpec("k_ew", "elementwise", (3, 4),
                    [Input("ptr", f32, (3, 4), (1, 3)), Input("ptr", f32, (4,), (1,)), Input("lit", np.dtype(float), (),
                                                                                               (), 0.5, True)],
                    [KOp("mul", [("in", 0), ("in", 2)], f32), KOp("add", [("v", 0), ("in", 1)], f32),
                     KOp("tanh", [("v", 1)], f32)], [("v", 2)], [f32])
    red = KernelSpec("k_red", "reduce", (3, 4), [Input("ptr", f32, (3, 4), (4, 1))],
                     [KOp("exp", [("in", 0)], f32), KOp("reduce", [("v", 0)], f32,
                                                         {"kind": "sum", "axes": (1,), "keepdims": True})],
                     [("v", 1)], [f32])
    fns = compile_c([ew, red])
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    out = np.empty((3, 4), np.float32)
    fns["k_ew"]([a.T, b], [out])
    np.testing.assert_allclose(out, np.tanh(a.T * np.float32(0.5) + b), rtol=1e-6)
    s = np.empty((3, 1), np.float32)
    fns["k_red"]([out], [s])
    np.testing.assert_allclose(s, np.exp(out).sum(1, keepdims=True), rtol=1e-6)


def test_adamw_rule_matches_blutensor_update_bit_exactly():
    from blucompiler.rules import _adamw_scalars
    from blutensor.optim.adamw import adamw_update

    rng = np.random.default_rng(0)
    p = bt.tensor(rng.standard_normal(257).astype(np.float32), requires_grad=True)
    x = p.numpy().copy()
    m = np.zeros(257, np.float32)
    v = np.zeros(257, np.float32)
    m2, v2 = m.copy(), v.copy()
    group = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    for step in range(1, 6):
        g = rng.standard_normal(257).astype(np.float32) * 1e-2
        p.grad = bt.tensor(g)
        adamw_update(p, m, v, step, group["lr"], *group["betas"], group["eps"], group["weight_decay"])
        c = _adamw_scalars(group, {"step": step})
        x *= c[0]
        m2 += c[1] * (g - m2)
        v2 *= c[2]
        v2 += c[3] * g * g
        x += (c[6] * m2) / (np.sqrt(v2) / c[4] + c[5])
        np.testing.assert_array_equal(x, p.numpy())
    assert math.isclose(float(c[4]), math.sqrt(1 - 0.95 ** 5), rel_tol=1e-7)


def test_compiler_backend_plugin_registered():
    from blutensor.plugin import get_host

    reg = get_host().registry("compiler")
    cls = reg.select("blucompiler")
    step = cls.compile(lambda x: (x * 2).sum(), backend="numpy")
    assert step(bt.tensor(np.ones(3, np.float32))).item() == 6.0


@pytest.mark.cuda
def test_gpt2_step_compiled_matches_eager_on_cuda():
    """GPU twin of test_gpt2_step_matches_eager (skipped without CuPy and a GPU)."""
    cfg = tiny_cfg()
    m_e, o_e = make_model(cfg, device="cuda")
    m_c, o_c = make_model(cfg, device="cuda")
    eager, comp = train_step(m_e, o_e), blucompiler.compile(train_step(m_c, o_c))
    rng = np.random.default_rng(0)
    for _ in range(3):
        x, y = batch(rng, device="cuda")
        assert abs(eager(x, y).item() - comp(x, y).item()) <= 1e-4
    assert comp.report()["backend"] == "cuda"


def _op_specs():
    """One small kernel per elementwise op kind and per reduction kind/dtype."""
    f32, f64, i64, b = (np.dtype(t) for t in (np.float32, np.float64, np.int64, np.bool_))
    un = ["neg", "exp", "log", "tanh", "sqrt", "abs", "sign", "sin", "cos", "erf", "recip", "square", "copy"]
    bi = ["add", "sub", "mul", "div", "pow", "max", "min"]
    cmp_ = ["eq", "ne", "lt", "le", "gt", "ge"]
    dom = (3, 5)
    x = Input("ptr", f32, dom, (5, 1))
    y = Input("ptr", f32, (5,), (1,))
    specs = []
    for k in un:
        specs.append(KernelSpec(f"u_{k}", "elementwise", dom, [x], [KOp(k, [("in", 0)], f32)], [("v", 0)], [f32]))
    for k in bi:
        specs.append(KernelSpec(f"b_{k}", "elementwise", dom, [x, y], [KOp(k, [("in", 0), ("in", 1)], f32)],
                                [("v", 0)], [f32]))
    for k in cmp_:
        specs.append(KernelSpec(f"c_{k}", "elementwise", dom, [x, Input("lit", f64, (), (), 0.25, True)],
                                [KOp(k, [("in", 0), ("in", 1)], b)], [("v", 0)], [b]))
    specs.append(KernelSpec("w_where", "elementwise", dom, [x, y, Input("val", f32)],
                            [KOp("gt", [("in", 0), ("in", 1)], b), KOp("where", [("v", 0), ("in", 0), ("in", 2)], f32),
                             KOp("not", [("v", 0)], b), KOp("cast", [("v", 2)], i64), KOp("cast", [("v", 1)], f64)],
                            [("v", 1), ("v", 3), ("v", 4)], [f32, i64, f64]))
    for rk, dt in (("sum", f32), ("mean", f32), ("max", f32), ("min", f32), ("sum", b), ("max", b), ("sum", i64)):
        inp = Input("ptr", dt, dom, (5, 1))
        out = np.dtype(np.int64) if (rk == "sum" and dt != f32) else dt
        specs.append(KernelSpec(f"r_{rk}_{dt.name}", "reduce", dom, [inp],
                                [KOp("reduce", [("in", 0)], out, {"kind": rk, "axes": (0,), "keepdims": False})],
                                [("v", 0)], [out]))
    return specs


def test_every_op_kind_in_c_matches_numpy():
    from blucompiler.lower_c import compile_c
    from blucompiler.ops_impl import run_op

    specs = _op_specs()
    fns = compile_c(specs)
    rng = np.random.default_rng(7)
    for s in specs:
        ins, vals = [], []
        for i in s.inputs:
            if i.mode == "lit":
                vals.append(i.value)
                continue
            if i.mode == "val":
                a = np.float32(0.75)
            elif i.dtype == np.bool_:
                a = rng.random(i.shape) > 0.5
            elif i.dtype.kind == "i":
                a = rng.integers(-5, 5, i.shape)
            else:
                a = (rng.random(i.shape) + 0.1).astype(i.dtype)
            ins.append(a)
            vals.append(a)
        outs = [np.empty(np.broadcast_shapes(s.domain) if s.kind == "elementwise" else (5,), dt)
                for dt in s.out_dtypes]
        fns[s.name](ins, outs)
        env = []
        for op in s.ops:
            args = [vals[a[1]] if a[0] == "in" else env[a[1]] for a in op.args]
            env.append(run_op(op.kind, op.attrs, op.dtype, s.domain, args, np, None))
        for o, r in zip(outs, s.outputs):
            want = vals[r[1]] if r[0] == "in" else env[r[1]]
            np.testing.assert_allclose(o.astype(np.float64), np.broadcast_to(want, o.shape).astype(np.float64),
                                       rtol=2e-6, atol=1e-7, err_msg=s.name)


def test_every_op_kind_compiles_for_cuda_with_nvrtc():
    pytest.importorskip("cuda.bindings.nvrtc")
    from blucompiler.lower_cuda import _nvrtc_cubin

    specs = _op_specs()
    src = translation_unit([emit(s, "cuda") for s in specs], "cuda")
    try:
        assert _nvrtc_cubin(src, "ops.cu", "90") is not None
    except OSError as e:
        pytest.skip(str(e))


@pytest.mark.cuda
def test_cuda_graph_replay_matches_eager_on_cuda():
    """GPU twin: compile(..., cuda_graph=True) captures on the 4th call and replays afterwards."""
    cfg = tiny_cfg()
    m_e, o_e = make_model(cfg, device="cuda")
    m_c, o_c = make_model(cfg, device="cuda")
    eager, comp = train_step(m_e, o_e), blucompiler.compile(train_step(m_c, o_c), cuda_graph=True)
    rng = np.random.default_rng(0)
    for _ in range(6):
        x, y = batch(rng, device="cuda")
        assert abs(eager(x, y).item() - comp(x, y).item()) <= 1e-4
    g = comp.report()["cuda_graph"]
    assert g["state"] in ("replay", "off") and (g["state"] == "off" or g["replays"] >= 2), g
