"""The TMA (sm_90a) launch path on fake CuPy: tensor-map specs (dims, byte strides, boxes) that the emulated
kernel reads the operands through, the persistent grid, which problems TMA can serve (16-byte aligned
bases, leading dimensions and batch strides) and the fall-back to the mma.sync kernels for the others; the maps are
encoded by blutensor's encoder (blutensor.ext.tma), which the plugin host hands to blublas."""

from __future__ import annotations

import blutensor as bt
import kernel_contract
import numpy as np
import pytest
from blublas import GemmError, configs, launch, selftest, settings, tma
from blublas.api import plan
from blublas.testing import check_case, make_case


@pytest.fixture
def fcp(monkeypatch, tmp_path):
    monkeypatch.setenv("BLUBLAS_WGMMA", "1")
    return kernel_contract.install(monkeypatch, tmp_path, sm90=True)


@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_every_tma_config_through_the_tensor_maps(fcp, layout, precision):
    variant = "wgmma" if precision == "bf16" else "wgmma_tf32"
    rng = np.random.default_rng(3)
    for cfg in configs.configs_for(variant, 90):
        if layout not in cfg.layouts:
            continue
        for shape in selftest.PROBE_SHAPES + ((2200, 2100, 40),):  # the last: > 132 tiles, CTAs loop
            shape = selftest.tma_shape(*shape, layout, precision)
            for kw in ({"bias": "f32", "epilogue": "gelu", "save_preact": True, "beta": 0.5}, {"batch": 2}):
                case = make_case(rng, *shape, layout=layout, precision=precision, **kw)
                assert check_case(case, fcp, config=cfg.name) <= case.tol, (cfg.name, shape, kw)
                assert kernel_contract.LAUNCHES[-1]["name"] == cfg.kernel_name(layout if precision == "bf16" else "nt")
                assert kernel_contract.LAUNCHES[-1]["block"] == (384,)
        case = make_case(
            rng,
            *selftest.tma_shape(96, 200, 1500, layout, precision),
            layout=layout,
            precision=precision,
            bias="f32",
            epilogue="gelu",
        )
        assert check_case(case, fcp, config=cfg.name, splits=3) <= case.tol  # split-K: k chunks of whole tiles
        assert kernel_contract.LAUNCHES[-1]["name"] == "blu_gemm_splitk_reduce_v4"  # N = 200: float4 partials


def _problem(xp, layout, precision, m, n, k, batch=0):
    ta, tb = layout[0] == "t", layout[1] == "t"
    dt = np.uint16 if precision == "bf16" else np.float32
    lead = (batch,) if batch else ()
    a = xp.zeros(lead + ((k, m) if ta else (m, k)), dtype=dt)
    b = xp.zeros(lead + ((n, k) if tb else (k, n)), dtype=dt)
    return plan(
        a,
        b,
        None,
        trans_a=ta,
        trans_b=tb,
        alpha=1.0,
        beta=0.0,
        bias=None,
        epilogue="none",
        save_preact=None,
        precision=precision,
        batched=bool(batch),
    )


def test_tensor_map_specs_of_every_layout(fcp):
    cfg = configs.ALL_CONFIGS["wgmma"]["128x256x64_ws_s4"]
    p = _problem(fcp, "nn", "bf16", 300, 264, 136)
    a, b = launch.tma_specs(p, cfg)
    assert (a.dims, a.strides, a.box, a.dtype) == ((136, 300, 1), (272, 272 * 300), (64, 128, 1), bt.ext.tma.DTYPE_BF16)
    assert (b.dims, b.strides, b.box) == ((264, 136, 1), (528, 528 * 136), (64, 64, 1))  # N-major: 64-col atoms
    p = _problem(fcp, "tn", "bf16", 304, 264, 99, batch=3)
    a, b = launch.tma_specs(p, cfg)
    assert (a.dims, a.strides, a.box) == ((304, 99, 3), (608, 608 * 99), (64, 64, 1))
    p = _problem(fcp, "nt", "tf32", 130, 70, 100)
    a, b = launch.tma_specs(p, configs.ALL_CONFIGS["wgmma_tf32"]["128x256x32_ws_s4"])
    assert (a.dims, a.box, a.dtype) == ((100, 130, 1), (32, 128, 1), bt.ext.tma.DTYPE_F32)
    assert (b.dims, b.strides, b.box) == ((100, 70, 1), (400, 400 * 70), (32, 256, 1))
    enc = bt.ext.tma
    assert enc.encode_args(b)[7:] == (enc.INTERLEAVE_NONE, enc.SWIZZLE_128B, enc.L2_PROMOTION_256B, 0)


def test_tma_rejects_what_the_driver_would(fcp):
    assert launch.tma_ok(_problem(fcp, "nt", "bf16", 130, 70, 104)) == ""
    assert "multiples of 16" in launch.tma_ok(_problem(fcp, "nt", "bf16", 130, 70, 100))
    assert "multiples of 16" in launch.tma_ok(_problem(fcp, "nn", "bf16", 130, 70, 104))  # B ld = 70
    assert launch.tma_ok(_problem(fcp, "nt", "bf16", 130, 70, 0)) == "K = 0"
    spec = tma.operand_spec(0x1008, 10, 64, 64, 0, 0, 2, 128)
    assert "16-byte aligned" in tma.spec_problem(spec)
    with pytest.raises(GemmError, match="cannot be read by TMA"):
        tma.check_spec(spec, "a")


def test_gemm_operand_rules_beyond_the_drivers(fcp):
    """Rows that overlap (ld < cols) or batch entries that overlap are refused before the driver sees them."""
    assert "shorter than a row" in tma.spec_problem(tma.operand_spec(1 << 20, 10, 72, 64, 0, 0, 2, 128))
    assert "overlaps" in tma.spec_problem(tma.operand_spec(1 << 20, 10, 64, 64, 2, 64 * 8, 2, 128))
    assert tma.spec_problem(tma.operand_spec(1 << 20, 10, 64, 64, 2, 64 * 10, 2, 128)) == ""


def test_without_an_encoder_sm90_runs_mma_sync_and_a_forced_tma_config_says_why(fcp, monkeypatch):
    monkeypatch.setattr(tma, "_encoder", None)
    monkeypatch.setattr(tma, "_searched", True)  # as in a process where no encoder is installed
    assert not tma.available()
    p = _problem(fcp, "nt", "bf16", 130, 70, 104)
    assert "tensor-map encoder" in launch.tma_ok(p)
    rng = np.random.default_rng(5)
    case = make_case(rng, 512, 512, 256, layout="nt", precision="bf16")
    assert check_case(case, fcp) <= case.tol
    assert kernel_contract.LAUNCHES[-1]["name"].startswith("blu_gemm_bf16_")
    with pytest.raises(GemmError, match="use_encoder"):
        check_case(case, fcp, config="128x256x64_ws_s4")
    with pytest.raises(GemmError, match="use_encoder"):
        tma.operand_spec(1 << 20, 64, 64, 64, 0, 0, 2, 128)
    tma.use_encoder(bt.ext.tma)  # as the plugin host does when it loads blublas
    assert launch.tma_ok(p) == ""  # no verdict of the encoder-less state is kept
    assert check_case(case, fcp) <= case.tol
    assert kernel_contract.LAUNCHES[-1]["name"].startswith("blu_gemm_wgmma_")


def test_use_encoder_refuses_a_module_without_the_encoders_interface(monkeypatch):
    monkeypatch.setattr(tma, "_encoder", tma._encoder)
    with pytest.raises(GemmError, match="not a TMA tensor-map encoder: it lacks tensor_spec"):
        tma.use_encoder(np)


def test_an_installed_encoder_is_found_through_its_entry_point(monkeypatch):
    monkeypatch.setattr(tma, "_encoder", None)
    monkeypatch.setattr(tma, "_searched", False)
    assert tma.available() and tma.encoder() is bt.ext.tma  # blutensor registers blutensor.ext:tma
    import importlib.metadata as md

    monkeypatch.setattr(tma, "_encoder", None)
    monkeypatch.setattr(tma, "_searched", False)
    bad = md.EntryPoint("broken", "numpy:ndarray", tma.ENTRY_POINT_GROUP)
    monkeypatch.setattr(md, "entry_points", lambda group: [bad] if group == tma.ENTRY_POINT_GROUP else [])
    with pytest.warns(UserWarning, match="entry point broken = numpy:ndarray unusable .*lacks tensor_spec"):
        assert not tma.available()
    assert "blutrain.tma_encoder" in tma.missing_reason()


def test_the_plugin_host_hands_blutensors_encoder_to_blublas(monkeypatch):
    monkeypatch.setattr(tma, "_encoder", None)
    monkeypatch.setattr(tma, "_searched", True)
    bt.ext.reset_host()
    try:
        host = bt.ext.get_host()
        assert "blublas" in host.registry("gemm")
        assert tma.encoder() is bt.ext.tma
    finally:
        bt.ext.reset_host()


def test_unaligned_problem_uses_mma_sync_and_forcing_tma_is_a_clear_error(fcp):
    rng = np.random.default_rng(4)
    case = make_case(rng, 512, 512, 250, layout="nt", precision="bf16")  # ld 250 bf16 = 500 bytes
    assert check_case(case, fcp) <= case.tol
    assert kernel_contract.LAUNCHES[-1]["name"].startswith("blu_gemm_bf16_")
    with pytest.raises(GemmError, match="reads operands through TMA"):
        check_case(case, fcp, config="128x256x64_ws_s4")
    case = make_case(rng, 512, 512, 256, layout="nt", precision="bf16")
    assert check_case(case, fcp) <= case.tol
    assert kernel_contract.LAUNCHES[-1]["name"].startswith("blu_gemm_wgmma_")


def test_tensor_maps_are_cached_and_passed_as_one_element_128_byte_arrays(fcp):
    spec = tma.operand_spec(1 << 20, 64, 64, 64, 0, 0, 2, 128)
    v = tma.encode(spec)
    assert isinstance(v, np.ndarray) and v.shape == (1,) and v.dtype.itemsize == 128 and v.nbytes == 128
    assert tma.encode(spec) is v


def test_vec8_epilogue_flag_only_where_16_byte_rows_allow(fcp):
    rng = np.random.default_rng(9)
    for (m, n, k), want in (((256, 264, 128), True), ((256, 70, 128), False), ((130, 72, 104), True)):
        for kw in ({}, {"epilogue": "gelu", "save_preact": True, "bias": "f32", "beta": 0.5}):
            case = make_case(rng, m, n, k, layout="nt", precision="bf16", **kw)
            assert check_case(case, fcp, config="128x128x64_pp_s6") <= case.tol
            assert bool(kernel_contract.LAUNCHES[-1]["flags"] & launch.F_VEC8) == want, (m, n, k, kw)
    case = make_case(rng, 256, 264, 2048, layout="nt", precision="bf16")
    assert check_case(case, fcp, config="128x128x64_pp_s6", splits=2) <= case.tol
    gemm = [x for x in kernel_contract.LAUNCHES if x["name"].startswith("blu_gemm_wgmma")][-1]
    assert gemm["flags"] & launch.F_VEC8  # split-K: fp32 partials with row stride N = 264 (16-byte rows)
    case = make_case(rng, 256, 270, 2048, layout="nt", precision="bf16")
    assert check_case(case, fcp, config="128x128x64_pp_s6", splits=2) <= case.tol
    gemm = [x for x in kernel_contract.LAUNCHES if x["name"].startswith("blu_gemm_wgmma")][-1]
    assert not gemm["flags"] & launch.F_VEC8  # N = 270: rows of 1080 bytes


def test_tma_store_epilogue_only_for_plain_epilogues_on_tma_addressable_outputs(fcp, monkeypatch):
    """The output goes through the TMA-store map (the emulated kernel checks the map describes the output)
    for alpha/bias epilogues on 16-byte-row outputs, split-K partials included; beta, GELU or a pre-activation,
    or rows that are not 16-byte multiples, take the staged epilogue; BLUBLAS_WGMMA_TMA_STORE=0 turns it off."""
    rng = np.random.default_rng(12)

    def flag(m, n, k, splits=None, precision="bf16", **kw):
        case = make_case(rng, m, n, k, layout="nt", precision=precision, **kw)
        cfg = "128x128x64_pp_s6" if precision == "bf16" else "128x128x32_ws_s6"
        assert check_case(case, fcp, config=cfg, splits=splits) <= case.tol
        gemm = [x for x in kernel_contract.LAUNCHES if x["name"].startswith("blu_gemm_wgmma")][-1]
        return bool(gemm["flags"] & launch.F_TMA_STORE)

    assert flag(256, 264, 128)
    assert flag(130, 72, 104, bias="f32", alpha=0.5)
    assert flag(130, 72, 104, bias="bf16", out_bf16=False)
    assert flag(200, 136, 96, precision="tf32", bias="f32")
    assert flag(67, 136, 72, batch=3)
    assert flag(256, 264, 2048, splits=2)  # fp32 partials [z][M][N] in the workspace, rows of 1056 bytes
    assert not flag(256, 270, 2048, splits=2)  # rows of 1080 bytes
    assert not flag(256, 270, 128)  # bf16 rows of 540 bytes
    assert not flag(256, 264, 128, beta=0.5)
    assert not flag(256, 264, 128, epilogue="gelu")
    assert not flag(256, 264, 128, epilogue="gelu", save_preact=True, bias="f32")
    kernel_contract.LAUNCHES.clear()
    monkeypatch.setenv("BLUBLAS_WGMMA_TMA_STORE", "0")
    assert flag(256, 264, 128)  # read at the first GEMM: unchanged until blublas.settings.reset()
    settings.reset()
    assert not flag(256, 264, 128)


def test_shipped_h200_table_sets_the_default_for_the_gpt2_shapes(fcp):
    """Without an autotune cache entry the measured best of the shipped table (tuned_sm90.json) is the default
    for its shapes; other shapes use the cost model; a table entry whose config is not usable is ignored."""
    from blublas import autotune

    st = fcp.cuda.get_current_stream()
    for prec, lay, m, n, k in (("bf16", "nt", 16384, 2304, 768), ("tf32", "nn", 16384, 768, 2304)):
        key = autotune.problem_key(90, prec, lay, m, n, k, 1, "bf16" if prec == "bf16" else "f32")
        want = autotune.shipped(key)
        assert want is not None, key
        cfg, s = launch.select(_problem(fcp, lay, prec, m, n, k), st, None, None, False)
        assert (cfg.name, s) == (want["config"], want["splits"])
    assert autotune.shipped(autotune.problem_key(90, "bf16", "nt", 1000, 1000, 1000, 1, "bf16")) is None
    for entry in autotune._shipped.values():  # every entry names a config that exists
        assert any(entry["config"] in t for t in configs.ALL_CONFIGS.values()), entry
