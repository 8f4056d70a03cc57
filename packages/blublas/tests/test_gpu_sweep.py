"""GPU sweeps beyond tests/test_gpu.py, each against float64: every tile config on odd and ragged shapes, the
epilogues the CPU tests cover (gelu alone, alpha/beta without bias) on both providers, batched GEMMs of every
layout, the split-K heuristic, the heuristic's choice on unaligned and aligned problems, capture of every
precision with a saved pre-activation, the SIMT configs' split-K / batched / misaligned-view paths, and the
sm_90a TMA path (raw swizzled box bytes against a NumPy model; every wgmma config on tile edges, both output
types, batched). The CPU twins of the float64 comparisons are tests/test_reference_cpu.py's cases."""

from __future__ import annotations

import numpy as np
import pytest
from blublas import gemm
from blublas.testing import check_case, make_case

pytestmark = pytest.mark.cuda

LAYOUTS = ("nn", "nt", "tn")
PRECISIONS = ("fp32", "tf32", "bf16")


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


def _configs(variant: str) -> list:
    from blublas import configs, loader

    return configs.configs_for(variant, loader.compute_capability())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_gpu_every_config_on_odd_shapes(precision):
    """Every config of the precision's default variant, forced, on the tile-edge shapes of each layout."""
    cp = _cupy()
    from blublas import configs

    rng = np.random.default_rng(31)
    for cfg in _configs(configs.VARIANT_OF_PRECISION[precision]):
        for layout in LAYOUTS:
            for shape in ((1, 1, 1), (7, 5, 3), (130, 67, 19), (257, 129, 200)):
                case = make_case(rng, *shape, layout=layout, precision=precision, bias="f32")
                assert check_case(case, cp, config=cfg.name) <= case.tol, (cfg.name, case.describe())


EXTRA_EPILOGUES = [dict(epilogue="gelu"), dict(alpha=0.5, beta=1.0)]


@pytest.mark.parametrize("provider", ["blublas", "cublas"])
@pytest.mark.parametrize("precision,out_bf16", [("fp32", False), ("tf32", False), ("bf16", True), ("bf16", False)])
@pytest.mark.parametrize("epi", EXTRA_EPILOGUES, ids=lambda e: "-".join(f"{k}={v}" for k, v in e.items()))
def test_gpu_gelu_alone_and_beta_without_bias(provider, precision, out_bf16, epi):
    cp = _cupy()
    rng = np.random.default_rng(37)
    for layout in LAYOUTS:
        case = make_case(rng, 133, 72, 96, layout=layout, precision=precision, out_bf16=out_bf16, **epi)
        assert check_case(case, cp, provider) <= case.tol, case.describe()


@pytest.mark.parametrize("provider", ["blublas", "cublas"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_batched_gemm_every_layout(provider, precision):
    cp = _cupy()
    rng = np.random.default_rng(41)
    for layout in LAYOUTS:
        case = make_case(rng, 67, 40, 33, layout=layout, precision=precision, batch=3, bias="f32", epilogue="gelu")
        assert check_case(case, cp, provider) <= case.tol, case.describe()
        case = make_case(rng, 64, 128, 64, layout=layout, precision=precision, batch=2)
        assert check_case(case, cp, provider) <= case.tol, case.describe()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_gpu_split_k_chosen_by_the_heuristic(precision):
    """Few output tiles and a long K: the heuristic splits K; the reduction must still match float64."""
    cp = _cupy()
    rng = np.random.default_rng(43)
    case = make_case(rng, 128, 128, 8192, layout="tn", precision=precision)
    assert check_case(case, cp) <= case.tol, case.describe()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_heuristic_choice_on_odd_and_aligned_problems(precision, layout):
    """The library's own choice (no forced config): element-wise loads on odd extents, vector loads on aligned."""
    cp = _cupy()
    rng = np.random.default_rng(47)
    case = make_case(rng, 515, 387, 261, layout=layout, precision=precision, bias="f32", epilogue="gelu")
    assert check_case(case, cp) <= case.tol, case.describe()
    case = make_case(rng, 1024, 768, 512, layout=layout, precision=precision)
    assert check_case(case, cp) <= case.tol, case.describe()


@pytest.mark.parametrize("provider", ["blublas", "cublas"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_gpu_capture_replays_with_new_inputs_and_saves_the_preactivation(provider, precision):
    """bias + gelu + saved pre-activation captured into a CUDA graph; the input changes after capture and the
    graph is replayed twice: both outputs must match float64 of the new input."""
    cp = _cupy()
    from blublas.reference import f32_to_bf16_bits, gelu_tanh
    from blublas.testing import to_f64

    bf = precision == "bf16"
    rng = np.random.default_rng(53)
    a_h = rng.standard_normal((512, 256)).astype(np.float32)
    w_h = rng.standard_normal((384, 256)).astype(np.float32)
    if bf:
        a_h, w_h = f32_to_bf16_bits(a_h), f32_to_bf16_bits(w_h)
    a, w = cp.asarray(a_h), cp.asarray(w_h)
    bias = cp.asarray(rng.standard_normal(384).astype(np.float32))
    dt = cp.uint16 if bf else cp.float32
    out, pre = cp.zeros((512, 384), dt), cp.zeros((512, 384), dt)
    stream = cp.cuda.Stream(non_blocking=True)
    kw = dict(
        trans_b=True, bias=bias, epilogue="gelu", save_preact=pre, precision=precision, stream=stream, provider=provider
    )
    # the new input: half the old one (a power-of-two scale, exact in bf16 and fp32)
    a2_h = f32_to_bf16_bits(to_f64(a_h, True).astype(np.float32) * 0.5) if bf else a_h * 0.5
    with stream:
        gemm(a, w, out, **kw)  # warm-up outside capture: compiles, creates handles, picks configs
        stream.begin_capture()
        gemm(a, w, out, **kw)
        graph = stream.end_capture()
        out.fill(0)
        pre.fill(0)
        a[...] = cp.asarray(a2_h)
        graph.launch(stream)
        graph.launch(stream)
    stream.synchronize()
    pre_ref = to_f64(a2_h, bf) @ to_f64(w_h, bf).T + bias.get()
    scale = float(np.max(np.abs(to_f64(a2_h, bf)) @ np.abs(to_f64(w_h, bf)).T)) + 3.0
    err_out = float(np.max(np.abs(to_f64(out.get(), bf) - gelu_tanh(pre_ref)))) / scale
    err_pre = float(np.max(np.abs(to_f64(pre.get(), bf) - pre_ref))) / scale
    tol = 5e-3 if bf else (2e-3 if precision == "tf32" else 1e-5)
    assert max(err_out, err_pre) <= tol, (err_out, err_pre)


# ---- SIMT (strict fp32): the paths only the SIMT kernels have -------------------------------------------


def _simt_configs() -> list:
    """The register-staged SIMT configs where this device has them (sm_90), else every SIMT config."""
    staged = [c for c in _configs("simt") if c.stages == 2]
    return staged or _configs("simt")


def test_gpu_simt_configs_on_ragged_16_byte_shapes():
    """16-byte loads with ragged M/N and a K tail, every layout, every register-staged SIMT config."""
    cp = _cupy()
    rng = np.random.default_rng(59)
    for cfg in _simt_configs():
        for layout in LAYOUTS:
            for shape in ((257, 132, 200), (300, 260, 132), (129, 388, 516)):
                case = make_case(rng, *shape, layout=layout, bias="f32")
                assert check_case(case, cp, config=cfg.name) <= case.tol, (cfg.name, case.describe())


def test_gpu_simt_split_k_and_batched_per_config():
    cp = _cupy()
    rng = np.random.default_rng(61)
    for cfg in _simt_configs():
        for layout in LAYOUTS:
            for s in (3, 7):
                epi = dict(bias="f32", epilogue="gelu", save_preact=True, alpha=0.5, beta=0.5)
                case = make_case(rng, 96, 136, 1500, layout=layout, **epi)
                assert check_case(case, cp, config=cfg.name, splits=s) <= case.tol, (cfg.name, s, case.describe())
            case = make_case(rng, 200, 264, 4100, layout=layout)
            assert check_case(case, cp, config=cfg.name, splits=4) <= case.tol, (cfg.name, case.describe())
            case = make_case(rng, 67, 140, 36, layout=layout, batch=3, bias="f32", epilogue="gelu", save_preact=True)
            assert check_case(case, cp, config=cfg.name) <= case.tol, (cfg.name, case.describe())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_simt_views_4_bytes_past_a_16_byte_boundary(layout):
    """Operands that start 4 bytes past a 16-byte boundary (leading dimension a multiple of 4): the element-wise
    load path of every SIMT config, against float64."""
    cp = _cupy()
    rng = np.random.default_rng(67)
    m, n, k = 200, 136, 72
    ta, tb = layout[0] == "t", layout[1] == "t"
    ash, bsh = ((k, m) if ta else (m, k)), ((n, k) if tb else (k, n))
    a_h = rng.standard_normal((ash[0], ash[1] + 4)).astype(np.float32)
    b_h = rng.standard_normal((bsh[0], bsh[1] + 4)).astype(np.float32)
    a, b = cp.asarray(a_h)[:, 1 : 1 + ash[1]], cp.asarray(b_h)[:, 1 : 1 + bsh[1]]
    a64, b64 = a_h[:, 1 : 1 + ash[1]].astype(np.float64), b_h[:, 1 : 1 + bsh[1]].astype(np.float64)
    a64, b64 = (a64.T if ta else a64), (b64.T if tb else b64)
    ref, scale = a64 @ b64, float(np.max(np.abs(a64) @ np.abs(b64)))
    for cfg in _simt_configs():
        out = gemm(a, b, trans_a=ta, trans_b=tb, config=cfg.name).get().astype(np.float64)
        assert float(np.max(np.abs(out - ref))) / scale <= 1e-5, cfg.name


# ---- sm_90a: TMA boxes and the wgmma configs ------------------------------------------------------------


def _need_sm90():
    from blublas import loader

    if loader.compute_capability() != 90:
        pytest.skip("the TMA / wgmma kernels need sm_90")


def _swizzled_box(host: np.ndarray, c0: int, c1: int, box: tuple[int, int]) -> np.ndarray:
    """What one TMA load of ``box`` (inner, outer) at column ``c0``, row ``c1`` leaves in shared memory with the
    128-byte swizzle: rows of 128 bytes, 16-byte chunk index XOR (row % 8), zeros outside the tensor."""
    es = host.dtype.itemsize
    out = np.zeros(box[1] * 128, np.uint8)
    for r in range(box[1]):
        for i in range(box[0]):
            gr, gc = c1 + r, c0 + i
            v = host[gr, gc] if (gr < host.shape[0] and gc < host.shape[1]) else host.dtype.type(0)
            addr = r * 128 + i * es
            addr ^= ((addr >> 7) & 7) << 4
            out[addr : addr + es] = np.frombuffer(np.array([v], host.dtype).tobytes(), np.uint8)
    return out


@pytest.mark.parametrize("kernel", ["blu_tma_smoke", "blu_tma_smoke_gmem"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_gpu_tma_box_bytes_match_the_swizzle_model(kernel, dtype):
    """One TMA box through the tensor map (as a __grid_constant__ parameter, and read from global memory): the
    raw shared-memory bytes equal the NumPy model, including a box mostly outside the tensor (zero fill)."""
    cp = _cupy()
    _need_sm90()
    from blublas import loader, tma

    rows, cols, dt, outer = {"bf16": (100, 200, np.uint16, 64), "fp32": (300, 100, np.float32, 128)}[dtype]
    host = (np.arange(rows * cols) % 65521).astype(dt).reshape(rows, cols)
    dev = cp.asarray(host)
    spec = tma.operand_spec(int(dev.data.ptr), rows, cols, cols, 0, 0, host.itemsize, outer)
    box = spec.box[:2]
    nbytes = box[1] * 128
    step = 16 // host.itemsize  # a box's inner start must be 16-byte aligned
    fn = loader.get_function("gemm_wgmma_bf16.cu", kernel, nbytes + 2048)
    tm = tma.encode(spec)
    arg0 = cp.asarray(np.frombuffer(tm.tobytes(), np.uint8)) if kernel.endswith("gmem") else tm
    for c0, c1 in ((0, 0), (box[0], 32), ((cols - 7) // step * step, rows - 5)):
        out = cp.zeros(nbytes, cp.uint8)
        args = (arg0, out, np.int32(nbytes), np.int32(c0), np.int32(c1), np.int32(0))
        fn((1,), (128,), args, shared_mem=nbytes + 2048)
        got, want = out.get(), _swizzled_box(host, c0, c1, box)
        assert np.array_equal(got, want), (c0, c1, int(np.count_nonzero(got != want)))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_gpu_wgmma_configs_on_edges_outputs_and_batches(layout, precision, monkeypatch):
    """Every wgmma config (forced) beyond tests/test_gpu.py's shapes: tile edges, a deep K, the full epilogue
    into bf16 and f32 outputs, batched (small and > 132 tiles, where the persistent CTAs loop)."""
    cp = _cupy()
    _need_sm90()
    from blublas.selftest import tma_shape

    monkeypatch.setenv("BLUBLAS_WGMMA", "1")
    variant = "wgmma" if precision == "bf16" else "wgmma_tf32"
    rng = np.random.default_rng(71)
    outs = (True, False) if precision == "bf16" else (False,)
    for cfg in _configs(variant):
        if layout not in cfg.layouts:
            continue
        cases = [
            (dict(bias="f32"), shape) for shape in ((1, 1, 1), (130, 67, 19), (256, 256, 64), (128, 512, 1024))
        ]
        cases += [
            (dict(out_bf16=o, bias="f32", epilogue="gelu", save_preact=True, alpha=0.5, beta=0.5), (133, 200, 96))
            for o in outs
        ]
        cases += [(dict(batch=3, bias="f32"), (67, 130, 70)), (dict(batch=2), (1100, 1300, 72))]
        for kw, shape in cases:
            case = make_case(rng, *tma_shape(*shape, layout, precision), layout=layout, precision=precision, **kw)
            assert check_case(case, cp, config=cfg.name) <= case.tol, (cfg.name, case.describe())
