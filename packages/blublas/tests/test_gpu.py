"""GPU twins of the CPU tests: the same float64 comparisons on CuPy arrays through our kernels and the
cuBLAS provider, every layout/precision/epilogue, odd sizes, batched, split-K, and capture in a CUDA graph."""

from __future__ import annotations

import numpy as np
import pytest
from blublas import EpilogueUnavailable, GemmError, gemm
from blublas.testing import ODD_SHAPES, check_case, make_case

pytestmark = pytest.mark.cuda


def _cupy():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
        if int(cupy.cuda.Device().compute_capability) < 80:
            raise RuntimeError("needs sm_80+")
        return cupy
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"needs CuPy and a CUDA GPU of sm_80+: {exc}")


LAYOUTS = ("nn", "nt", "tn")
PRECISIONS = ("fp32", "tf32", "bf16")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_gpu_plain_gemm_matches_float64(layout, precision, shape):
    cp = _cupy()
    rng = np.random.default_rng(hash((layout, precision, shape)) % 2**32)
    case = make_case(rng, *shape, layout=layout, precision=precision)
    assert check_case(case, cp) <= case.tol, case.describe()


EPILOGUES = [
    dict(bias="f32"),
    dict(bias="bf16"),
    dict(epilogue="gelu", bias="f32", save_preact=True),
    dict(alpha=-1.5, beta=0.25, bias="f32", epilogue="gelu", save_preact=True),
]


@pytest.mark.parametrize("provider", ["blublas", "cublas"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("precision,out_bf16", [("fp32", False), ("tf32", False), ("bf16", True), ("bf16", False)])
@pytest.mark.parametrize("epi", EPILOGUES, ids=lambda e: "-".join(f"{k}={v}" for k, v in e.items()))
def test_gpu_epilogues_match_float64(provider, layout, precision, out_bf16, epi):
    cp = _cupy()
    rng = np.random.default_rng(7)
    case = make_case(rng, 133, 72, 96, layout=layout, precision=precision, out_bf16=out_bf16, **epi)
    assert check_case(case, cp, provider) <= case.tol, case.describe()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("precision,out_bf16", [("fp32", False), ("tf32", False), ("bf16", True), ("bf16", False)])
@pytest.mark.parametrize("bias_grad", [False, True])
@pytest.mark.parametrize("shape", [(37, 72, 40), (133, 96, 72)])
def test_gpu_dgelu_epilogue_matches_float64(layout, precision, out_bf16, bias_grad, shape):
    """cuBLASLt's DGELU / DGELU_BGRAD: (op(a) @ op(b)) * gelu'(preact) and its float32 column sums against float64
    (skipped, with cuBLASLt's answer, where this library has no fused algorithm for the combination)."""
    cp = _cupy()
    rng = np.random.default_rng(31)
    case = make_case(rng, *shape, layout=layout, precision=precision, out_bf16=out_bf16, epilogue="dgelu",
                     bias_grad=bias_grad)
    try:
        err = check_case(case, cp, "cublas")
    except EpilogueUnavailable as exc:
        pytest.skip(f"no fused algorithm here: {exc}")
    assert err <= case.tol, case.describe()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("bias_grad", [False, True])
def test_gpu_dgelu_is_fused_at_gpt2_mlp_shapes(precision, bias_grad):
    """GPT-2 124M's c_proj dX GEMM (B*T = 2048 rows here, 768 -> 3072) with the DGELU epilogue: cuBLASLt has a
    fused algorithm (EpilogueUnavailable fails this test: the fused MLP backward would take its unfused fallback)
    and its result matches float64. bf16 with the float32 bias gradient has none in cuBLASLt 13 (the MLP then
    runs DGELU alone plus the bias GEMV): there DGELU without the bias gradient must be fused."""
    cp = _cupy()
    rng = np.random.default_rng(37)
    case = make_case(rng, 2048, 3072, 768, layout="nn", precision=precision, epilogue="dgelu", bias_grad=bias_grad)
    try:
        assert check_case(case, cp, "cublas") <= case.tol, case.describe()
    except EpilogueUnavailable:
        if not (precision == "bf16" and bias_grad):
            raise
        case = make_case(rng, 2048, 3072, 768, layout="nn", precision=precision, epilogue="dgelu", bias_grad=False)
        assert check_case(case, cp, "cublas") <= case.tol, case.describe()


def test_gpu_dgelu_inside_cuda_graph_capture():
    """DGELU_BGRAD recorded into a CUDA graph replays on the captured stream with new inputs."""
    cp = _cupy()
    from blublas.reference import gelu_tanh_grad

    rng = np.random.default_rng(41)
    g = cp.asarray(rng.standard_normal((256, 128)).astype(np.float32))
    w = cp.asarray(rng.standard_normal((128, 192)).astype(np.float32))
    u = cp.asarray(rng.standard_normal((256, 192)).astype(np.float32))
    out, bg = cp.zeros((256, 192), cp.float32), cp.zeros(192, cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    kw = dict(epilogue="dgelu", preact=u, bias_grad=bg, precision="tf32", stream=stream, provider="cublas")
    with stream:
        try:
            gemm(g, w, out, **kw)  # warm-up outside capture: handle, workspace, algorithm
        except EpilogueUnavailable as exc:
            pytest.skip(f"no fused algorithm here: {exc}")
        stream.begin_capture()
        gemm(g, w, out, **kw)
        graph = stream.end_capture()
        out.fill(0)
        bg.fill(0)
        g[...] = g * 0.5
        graph.launch(stream)
    stream.synchronize()
    ref = (g.get().astype(np.float64) @ w.get()) * gelu_tanh_grad(u.get().astype(np.float64))
    scale = np.max(np.abs(ref))
    assert np.max(np.abs(out.get() - ref)) / scale < 5e-3
    assert np.max(np.abs(bg.get() - ref.sum(axis=0))) / (256 * scale) < 5e-3


@pytest.mark.parametrize("provider", ["blublas", "cublas"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_batched_gemm_on_the_gpu_matches_float64(provider, precision):
    cp = _cupy()
    rng = np.random.default_rng(11)
    case = make_case(
        rng,
        67,
        40,
        33,
        layout="nt",
        precision=precision,
        batch=3,
        bias="f32",
        epilogue="gelu",
        save_preact=True,
    )
    assert check_case(case, cp, provider) <= case.tol, case.describe()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("splits", [2, 5])
def test_gpu_split_k_matches_float64(precision, splits):
    cp = _cupy()
    from blublas import configs

    rng = np.random.default_rng(13)
    case = make_case(
        rng,
        96,
        80,
        1500,
        layout="tn",
        precision=precision,
        bias="f32",
        epilogue="gelu",
        save_preact=True,
        alpha=0.5,
        beta=0.5,
    )
    from blublas import loader

    cfg = configs.configs_for(configs.VARIANT_OF_PRECISION[precision], loader.compute_capability())[-1].name
    assert check_case(case, cp, config=cfg, splits=splits) <= case.tol, case.describe()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_gpu_every_config_is_correct(precision):
    cp = _cupy()
    from blublas import configs, loader

    variant = configs.VARIANT_OF_PRECISION[precision]
    rng = np.random.default_rng(17)
    for cfg in configs.configs_for(variant, loader.compute_capability()):
        for layout in LAYOUTS:
            case = make_case(rng, 300, 270, 129, layout=layout, precision=precision, bias="f32")
            assert check_case(case, cp, config=cfg.name) <= case.tol, (cfg.name, case.describe())


def test_gpu_unaligned_leading_dimension_uses_the_scalar_path():
    cp = _cupy()
    rng = np.random.default_rng(19)
    big = cp.asarray(rng.standard_normal((70, 41)).astype(np.float32))
    a = big[1:, 1:]  # ld 41, base not 16-byte aligned
    b = cp.asarray(rng.standard_normal((40, 9)).astype(np.float32))
    out = gemm(a, b, precision="tf32")
    ref = a.get().astype(np.float64) @ b.get().astype(np.float64)
    assert np.max(np.abs(out.get() - ref)) / np.max(np.abs(a.get()) @ np.abs(b.get())) < 2e-3


def test_gpu_misaligned_pointer_is_rejected():
    cp = _cupy()
    raw = cp.zeros(4 * 20 + 2, dtype=cp.uint8)
    a = cp.ndarray((4, 5), dtype=cp.float32, memptr=raw.data + 1)
    with pytest.raises(GemmError, match="a: misaligned pointer"):
        gemm(a, cp.ones((5, 3), cp.float32))


def test_gpu_mixed_numpy_and_cupy_is_rejected():
    cp = _cupy()
    with pytest.raises(GemmError, match="b is a numpy array but a is a cupy array"):
        gemm(cp.ones((2, 2), cp.float32), np.ones((2, 2), np.float32))


@pytest.mark.parametrize("provider", ["blublas", "cublas"])
def test_gpu_gemm_inside_cuda_graph_capture(provider):
    cp = _cupy()
    rng = np.random.default_rng(23)
    a = cp.asarray(rng.standard_normal((256, 128)).astype(np.float32))
    w = cp.asarray(rng.standard_normal((192, 128)).astype(np.float32))
    bias = cp.asarray(rng.standard_normal(192).astype(np.float32))
    out = cp.zeros((256, 192), cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        gemm(
            a,
            w,
            out,
            trans_b=True,
            bias=bias,
            epilogue="gelu",
            precision="tf32",
            stream=stream,
            provider=provider,
        )  # warm-up outside capture: compiles, creates handles, picks configs
        stream.begin_capture()
        gemm(
            a,
            w,
            out,
            trans_b=True,
            bias=bias,
            epilogue="gelu",
            precision="tf32",
            stream=stream,
            provider=provider,
        )
        graph = stream.end_capture()
        out.fill(0)
        a[...] = a * 0.5
        graph.launch(stream)
    stream.synchronize()
    from blublas.reference import gelu_tanh

    ref = gelu_tanh(a.get().astype(np.float64) @ w.get().T.astype(np.float64) + bias.get())
    assert np.max(np.abs(out.get() - ref)) / np.max(np.abs(ref)) < 5e-3


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_gpu_wgmma_variants_on_sm90(layout, precision):
    """The sm_90a wgmma kernels (forced by config name) against float64; TF32 wgmma exists for NT only."""
    cp = _cupy()
    from blublas import configs, loader
    from blublas.selftest import tma_shape

    if loader.compute_capability() != 90:
        pytest.skip("wgmma kernels need sm_90")
    variant = "wgmma" if precision == "bf16" else "wgmma_tf32"
    rng = np.random.default_rng(29)
    for cfg in configs.configs_for(variant, 90):
        if layout not in cfg.layouts:
            continue
        for shape in ((7, 5, 3), (257, 129, 200), (300, 270, 129), (2200, 2100, 40)):
            shape = tma_shape(*shape, layout, precision)  # TMA: 16-byte leading dimensions
            case = make_case(
                rng, *shape, layout=layout, precision=precision, bias="f32", epilogue="gelu", save_preact=True, beta=0.5
            )
            assert check_case(case, cp, config=cfg.name) <= case.tol, (cfg.name, case.describe())
        case = make_case(rng, *tma_shape(96, 300, 1500, layout, precision), layout=layout, precision=precision)
        assert check_case(case, cp, config=cfg.name, splits=3) <= case.tol, (cfg.name, case.describe())
