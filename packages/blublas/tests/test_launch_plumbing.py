"""The GPU launch path (config choice, kernel arguments, split-K workspace and reduction, epilogue flags,
batch strides, views) run against the fake CUDA device, whose kernels emulate the documented kernel contract."""

from __future__ import annotations

import kernel_contract
import numpy as np
import pytest
from blublas import configs, launch, loader, settings
from blublas.testing import check_case, make_case


@pytest.fixture
def fcp(monkeypatch, tmp_path):
    monkeypatch.setenv("BLUBLAS_WGMMA_PROBE", "inproc")  # fake CuPy lives in this process only
    return kernel_contract.install(monkeypatch, tmp_path)


LAYOUTS = ("nn", "nt", "tn")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("precision,out_bf16", [("fp32", False), ("tf32", False), ("bf16", True), ("bf16", False)])
def test_launch_plumbing_every_config(fcp, layout, precision, out_bf16):
    rng = np.random.default_rng(0)
    for cfg in configs.configs_for(configs.VARIANT_OF_PRECISION[precision], 90):
        case = make_case(
            rng,
            37,
            29,
            45,
            layout=layout,
            precision=precision,
            out_bf16=out_bf16,
            bias="f32",
            epilogue="gelu",
            save_preact=True,
            alpha=0.5,
            beta=0.75,
        )
        assert check_case(case, fcp, config=cfg.name) <= case.tol, (cfg.name, case.describe())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("splits", [2, 3])
def test_launch_plumbing_split_k(fcp, layout, precision, splits):
    rng = np.random.default_rng(1)
    n = 24 if splits == 2 else 26  # N % 4 == 0: the float4 reduction; else the element-wise one
    case = make_case(
        rng,
        40,
        n,
        300,
        layout=layout,
        precision=precision,
        bias="bf16",
        epilogue="gelu",
        save_preact=True,
        alpha=2.0,
        beta=0.5,
    )
    cfg = configs.configs_for(configs.VARIANT_OF_PRECISION[precision], 90)[-1].name
    assert check_case(case, fcp, config=cfg, splits=splits) <= case.tol, case.describe()
    names = [rec["name"] for rec in kernel_contract.LAUNCHES]
    assert ("blu_gemm_splitk_reduce_v4" if n % 4 == 0 else "blu_gemm_splitk_reduce") in names


@pytest.mark.parametrize("layout", LAYOUTS)
def test_launch_plumbing_batched_and_heuristic(fcp, layout):
    rng = np.random.default_rng(2)
    for precision in ("fp32", "tf32", "bf16"):
        case = make_case(
            rng, 33, 18, 20, layout=layout, precision=precision, batch=3, bias="f32", epilogue="gelu", save_preact=True
        )
        assert check_case(case, fcp) <= case.tol, case.describe()
        case = make_case(rng, 64, 64, 4096, layout=layout, precision=precision, batch=2)
        assert check_case(case, fcp) <= case.tol, case.describe()


def test_launch_plumbing_views_and_vector_flag(fcp):
    from blublas import gemm

    rng = np.random.default_rng(3)
    big = fcp.asarray(rng.standard_normal((64, 41)).astype(np.float32))
    a = big[1:, 1:]  # ld 41, misaligned for 16-byte loads -> element path
    b = fcp.asarray(rng.standard_normal((40, 16)).astype(np.float32))
    out = gemm(a, b, precision="tf32")
    np.testing.assert_allclose(out.get(), a.get().astype(np.float64) @ b.get(), rtol=1e-4, atol=1e-4)
    assert kernel_contract.LAUNCHES[-1]["name"].startswith("blu_gemm_tf32_")
    a2 = fcp.asarray(rng.standard_normal((64, 32)).astype(np.float32))
    gemm(a2, b[:32], precision="tf32")  # b[:32] is 16-byte aligned with ld 16
    assert kernel_contract.LAUNCHES[-1]["block"]


def test_autotune_measures_once_then_reuses_cache(fcp, monkeypatch):
    from blublas import autotune, gemm

    calls = []

    def fake_timer(run, warmup=2, reps=5):
        def t(cand):
            calls.append(cand)
            run(cand)
            return {"128x128x32_w2x2_s4": 1.0}.get(cand[0].name, 2.0) + 0.1 * cand[1]

        return t

    monkeypatch.setattr(autotune, "cuda_event_timer", fake_timer)
    rng = np.random.default_rng(4)
    a = fcp.asarray(rng.standard_normal((64, 48)).astype(np.float32))
    b = fcp.asarray(rng.standard_normal((48, 32)).astype(np.float32))
    from blublas.reference import f32_to_bf16_bits

    a16, b16 = fcp.asarray(f32_to_bf16_bits(a.get())), fcp.asarray(f32_to_bf16_bits(b.get()))
    gemm(a16, b16, precision="bf16", autotune=True)
    assert calls
    n = len(calls)
    kernel_contract.LAUNCHES.clear()
    gemm(a16, b16, precision="bf16", autotune=True)
    assert len(calls) == n  # cached
    assert kernel_contract.LAUNCHES[-1]["name"] == "blu_gemm_bf16_128x128x32_w2x2_s4_nn"
    entries = autotune.default_cache()
    assert len(entries) == 1


@pytest.mark.parametrize("precision,out_bf16", [("fp32", False), ("bf16", True), ("bf16", False)])
def test_cublas_fallback_epilogue_kernel_arguments(fcp, monkeypatch, precision, out_bf16):
    """When cuBLASLt rejects the fused epilogue, the plain GEMM + our epilogue kernel give the same result."""
    from blublas import cublas
    from blublas.testing import to_f64

    def fake_matmul(p, st, stream, fuse):
        if fuse:
            return False
        a = to_f64(p.a.get(), p.precision == "bf16")
        b = to_f64(p.b.get(), p.precision == "bf16")
        opa = np.swapaxes(a, -1, -2) if p.trans_a else a
        opb = np.swapaxes(b, -1, -2) if p.trans_b else b
        v = p.alpha * (opa @ opb)
        if p.beta:
            v = v + p.beta * to_f64(p.out.get(), p.out_tag == "bf16")
        from blublas.reference import f32_to_bf16_bits

        p.out[...] = f32_to_bf16_bits(v.astype(np.float32)) if p.out_tag == "bf16" else v.astype(np.float32)
        return True

    monkeypatch.setattr(cublas, "_matmul", fake_matmul)
    monkeypatch.setattr(cublas, "_state", lambda dev: None)
    rng = np.random.default_rng(5)
    for batch in (0, 2):
        case = make_case(
            rng,
            21,
            14,
            9,
            layout="nt",
            precision=precision,
            out_bf16=out_bf16,
            batch=batch,
            bias="f32",
            epilogue="gelu",
            save_preact=True,
            alpha=0.5,
            beta=0.25,
        )
        assert check_case(case, fcp, "cublas") <= case.tol, case.describe()
    assert kernel_contract.LAUNCHES[-1]["name"] == "blu_gemm_epilogue_apply"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_launch_plumbing_wgmma(fcp, monkeypatch, tmp_path, layout):
    """With BLUBLAS_WGMMA=1 on sm_90 the wgmma variant is chosen for bf16 and compiled for sm_90a."""
    monkeypatch.setenv("BLUBLAS_WGMMA", "1")
    built = []

    def fake_cubin(filename, arch):
        built.append((filename, arch))
        return tmp_path / "gemm_wgmma_bf16_sm90a.cubin"

    monkeypatch.setattr(loader, "_cubin_with_nvrtc", fake_cubin)
    monkeypatch.setattr(loader, "_modules", {})
    rng = np.random.default_rng(6)
    for cfg in configs.configs_for("wgmma", 90):
        case = make_case(
            rng, 136, 72, 104, layout=layout, precision="bf16", bias="f32", epilogue="gelu", save_preact=True, beta=0.5
        )
        assert check_case(case, fcp, config=cfg.name) <= case.tol, (cfg.name, case.describe())
        assert kernel_contract.LAUNCHES[-1]["name"] == cfg.kernel_name(layout)
    case = make_case(rng, 512, 512, 256, layout=layout, precision="bf16")
    assert check_case(case, fcp) <= case.tol
    assert kernel_contract.LAUNCHES[-1]["name"].startswith("blu_gemm_wgmma_")
    assert built == [("gemm_wgmma_bf16.cu", "90a")]
    for cfg in configs.configs_for("wgmma_tf32", 90):
        case = make_case(
            rng, 136, 72, 104, layout=layout, precision="tf32", bias="f32", epilogue="gelu", save_preact=True, beta=0.5
        )
        # wgmma reads tf32 K-major only: NN/TN copy the M/N-major operands transposed, then run the NT kernel
        assert check_case(case, fcp, config=cfg.name) <= case.tol, (cfg.name, case.describe())
        assert kernel_contract.LAUNCHES[-1]["name"] == cfg.kernel_name("nt")
        copies = [x["name"] for x in kernel_contract.LAUNCHES[-3:-1] if x["name"] == "blu_transpose_f32"]
        assert len(copies) == {"nt": 0, "nn": 1, "tn": 2}[layout]
    case = make_case(rng, 512, 512, 256, layout=layout, precision="tf32")
    assert check_case(case, fcp) <= case.tol
    if layout == "nt":  # NN/TN: the heuristic weighs the copies (this small problem may stay on mma.sync)
        assert kernel_contract.LAUNCHES[-1]["name"].startswith("blu_gemm_wgmma_tf32_")


def test_wgmma_auto_mode_self_tests_once_and_falls_back_on_failure(fcp, monkeypatch):
    """Default BLUBLAS_WGMMA=auto: the wgmma variant is used after its self-test passed; a failing
    self-test disables it (with a warning) and the mma.sync kernels serve the call."""
    import blublas.testing as bt

    monkeypatch.delenv("BLUBLAS_WGMMA", raising=False)
    rng = np.random.default_rng(7)
    case = make_case(rng, 512, 512, 256, layout="nn", precision="bf16")
    assert check_case(case, fcp) <= case.tol
    assert launch._probe_results == {(0, "wgmma", "nn"): True}
    assert kernel_contract.LAUNCHES[-1]["name"].startswith("blu_gemm_wgmma_")

    monkeypatch.setattr(launch, "_probe_results", {})
    monkeypatch.setattr("blublas.memo._launch_memo", {})
    real = bt.check_case
    monkeypatch.setattr(
        bt, "check_case", lambda c, xp, *a, **k: float("inf") if k.get("config") else real(c, xp, *a, **k)
    )
    with pytest.warns(UserWarning, match="wgmma kernels disabled for layout nt"):
        case = make_case(rng, 512, 512, 256, layout="nt", precision="bf16")
        assert real(case, fcp) <= case.tol
    assert launch._probe_results == {(0, "wgmma", "nt"): False}
    assert kernel_contract.LAUNCHES[-1]["name"].startswith("blu_gemm_bf16_")


def test_wgmma_off_never_self_tests(fcp, monkeypatch):
    monkeypatch.setenv("BLUBLAS_WGMMA", "0")
    rng = np.random.default_rng(8)
    case = make_case(rng, 512, 512, 256, layout="tn", precision="bf16")
    assert check_case(case, fcp) <= case.tol
    assert launch._probe_results == {}
    assert kernel_contract.LAUNCHES[-1]["name"].startswith("blu_gemm_bf16_")


def test_launch_memo_replays_repeated_calls_and_never_a_changed_one(fcp, monkeypatch):
    """A repeated call (same arrays, options, stream) replays the recorded launch without planning; any change
    of an array, a scalar option or a switch plans again; split-K (workspace) is never recorded."""
    from blublas import api

    rng = np.random.default_rng(5)
    case = make_case(rng, 96, 80, 64, layout="nt", precision="bf16", bias="f32")
    planned = []
    real_plan = api.plan
    monkeypatch.setattr(api, "plan", lambda *a, **k: planned.append(1) or real_plan(*a, **k))
    for _ in range(3):
        assert check_case(case, fcp, config="128x128x32_w2x2_s4") <= case.tol
    # check_case fills fresh arrays per call; where they reuse freed addresses the replayed launch (same
    # pointers, shapes, options) must still compute the new contents: the tolerance checks above
    a = fcp.asarray(case.a)
    b = fcp.asarray(case.b)
    out = fcp.zeros((96, 80), np.uint16)
    planned.clear()
    n0 = len(kernel_contract.LAUNCHES)
    for _ in range(3):
        api.gemm(a, b, out, trans_b=True, precision="bf16", config="128x128x32_w2x2_s4")
    assert len(planned) == 1 and len(kernel_contract.LAUNCHES) == n0 + 3  # planned once, launched three times
    first = out.get().copy()
    api.gemm(a, b, out, trans_b=True, precision="bf16", config="128x128x32_w2x2_s4", alpha=2.0)
    assert len(planned) == 2  # alpha changed: planned again
    doubled = out.get().copy()
    api.gemm(a, b, out, trans_b=True, precision="bf16", config="128x128x32_w2x2_s4")
    assert len(planned) == 2 and np.array_equal(out.get(), first)  # replayed the alpha = 1 launch
    assert not np.array_equal(doubled, first)
    monkeypatch.setenv("BLUBLAS_LAUNCH_MEMO", "0")
    api.gemm(a, b, out, trans_b=True, precision="bf16", config="128x128x32_w2x2_s4")
    assert len(planned) == 2  # the switches were read at the first GEMM: still memoized
    settings.reset()  # read again: memo off (and the recorded launches forgotten)
    api.gemm(a, b, out, trans_b=True, precision="bf16", config="128x128x32_w2x2_s4")
    api.gemm(a, b, out, trans_b=True, precision="bf16", config="128x128x32_w2x2_s4")
    assert len(planned) == 4
    monkeypatch.delenv("BLUBLAS_LAUNCH_MEMO")
    settings.reset()
    big_a64 = rng.standard_normal((64, 2048))
    big_a = fcp.asarray(big_a64.astype(np.float32))
    big_b64 = rng.standard_normal((2048, 48))
    big_b = fcp.asarray(big_b64.astype(np.float32))
    o2 = fcp.zeros((64, 48), np.float32)
    n0 = len(kernel_contract.LAUNCHES)
    for _ in range(2):  # split-K: GEMM into the workspace + reduction, both replayed
        api.gemm(big_a, big_b, o2, precision="fp32", splits=4, config="64x64x8_s4")
        assert np.allclose(o2.get(), big_a64 @ big_b64, rtol=1e-4, atol=1e-3)
    assert len(planned) == 5 and len(kernel_contract.LAUNCHES) == n0 + 4
    loader.workspace(1 << 22)  # a larger GEMM grew the stream's workspace: the recorded one is stale
    api.gemm(big_a, big_b, o2, precision="fp32", splits=4, config="64x64x8_s4")
    assert len(planned) == 6 and np.allclose(o2.get(), big_a64 @ big_b64, rtol=1e-4, atol=1e-3)


def test_launch_memo_leaves_bad_arguments_to_the_planner(fcp):
    """Arguments that are not arrays reach plan(), whose error names them (the memo key never raises)."""
    from blublas import GemmError, api

    a = fcp.asarray(np.zeros((8, 8), np.float32))
    out = fcp.zeros((8, 8), np.float32)
    with pytest.raises(GemmError, match="b"):
        api.gemm(a, [[1.0] * 8] * 8, out)
    with pytest.raises(GemmError, match="precision"):
        api.gemm(a, a, out, precision=["fp32"])
