"""The benchmark summarizers turn raw measurements into the committed result files: ratios, geometric means
and the target verdicts must follow from the numbers (CPU, synthetic pytest-benchmark JSON)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bench(times: dict) -> dict:
    """pytest-benchmark JSON with extra_info as bench_gemm.py writes it; times[(prec, shape, provider)] = ms."""
    out = []
    for (prec, name, provider), (kern, eager) in times.items():
        out.append({"extra_info": {"name": name, "layout": "nt", "M": 2, "N": 3, "K": 4, "precision": prec,
                                   "provider": provider, "kernel_ms": kern, "tflops": 1.0, "eager_ms": eager,
                                   "gpu": "X", "config": "c", "splits": 1}})
    out.append({"extra_info": {}})  # foreign benchmark rows are ignored
    return {"benchmarks": out}


def test_gemm_summary_ratios_geomeans_and_verdicts():
    sg = _load("benchmarks/blublas/summarize_gemm.py")
    shapes = [f"s{i}" for i in range(15)]
    t = {}
    for i, s in enumerate(shapes):
        t[("bf16", s, "cublas")] = (1.0, 2.0)
        t[("bf16", s, "blublas")] = (1.0 / 0.9 if i else 1.0 / 0.55, 1.0)  # one shape below the 0.6 floor
        t[("tf32", s, "cublas")] = (1.0, 1.0)
        t[("tf32", s, "blublas")] = (1.0 / 0.95, 1.0)
    t[("fp32", "s0", "cublas")] = (1.0, 1.0)  # fp32 without its BluBLAS row: skipped, not counted
    res = sg.summarize(_bench(t), "abc")
    bf, tf = res["precisions"]["bf16"], res["precisions"]["tf32"]
    assert res["commit"] == "abc" and "fp32" not in res["precisions"]
    assert math.isclose(bf["geomean_ratio"], round(math.exp((14 * math.log(0.9) + math.log(0.55)) / 15), 3))
    assert bf["min_ratio"] == 0.55 and bf["min_shape"] == "s0" and not bf["meets_target"]  # min < 0.6
    assert bf["geomean_ratio_eager"] == 2.0
    assert tf["geomean_ratio"] == 0.95 and tf["meets_target"] and tf["shapes"] == 15
    t2 = {k: v for k, v in t.items() if k[1] != "s3"}  # a missing shape never meets the target
    assert not sg.summarize(_bench(t2))["precisions"]["tf32"]["meets_target"]


def test_step_profile_buckets_and_counts():
    """benchmarks/step_profile.py: kernels land in gemm / attention / other, casts and standalone adds are counted
    in 'other' only, the top 'other' list is sorted by time."""
    sp = _load("benchmarks/step_profile.py")
    rows = {
        "sm90_xmma_gemm_bf16bf16_f32": {"count": 98.0, "us": 16000.0},
        "blu_sdpa_mma_forward_bf16": {"count": 12.0, "us": 2000.0},
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop": {"count": 12.0, "us": 990.0},
        "blu_cast_f32_to_bf16": {"count": 25.0, "us": 500.0},
        "cupy_add": {"count": 20.0, "us": 300.0},
        "blu_embedding_backward_seg_f32_f32": {"count": 1.0, "us": 60.0},
        "blu_layer_norm_backward_s6_f32": {"count": 25.0, "us": 1200.0},
    }
    s = sp.summarize(rows, top=3)
    assert math.isclose(s["category_ms"]["gemm"], 16.0)
    assert math.isclose(s["category_ms"]["attention"], 2.99)
    assert math.isclose(s["category_ms"]["other"], 2.06)
    assert s["casts"] == {"launches": 25.0, "ms": 0.5}
    assert s["adds"] == {"launches": 20.0, "ms": 0.3}
    assert math.isclose(s["embedding_backward_ms"], 0.06)
    assert [k["name"] for k in s["top_other"]] == ["blu_layer_norm_backward_s6_f32", "blu_cast_f32_to_bf16",
                                                   "cupy_add"]
    assert s["launches"] == 193.0


def test_step_profile_timeline_measures_idle_gaps_and_overlap():
    """benchmarks/step_profile.py's timeline: span from first start to last end, busy time as the union of the kernel
    intervals (an overlap counted once), idle time binned by gap length, the longest gap named by its neighbours."""
    sp = _load("benchmarks/step_profile.py")
    # two steps of us intervals: a..b overlapping c, a 3 us gap, a 150 us gap, a 1 us gap
    spans = [(0.0, 10.0, "a"), (5.0, 12.0, "c"), (15.0, 20.0, "b"), (170.0, 180.0, "d"), (181.0, 200.0, "e")]
    t = sp.timeline(list(reversed(spans)), 2, 0.004)
    assert math.isclose(t["span_ms"], 200.0 / 2 / 1e3)
    assert math.isclose(t["busy_ms"], (12.0 + 5.0 + 10.0 + 19.0) / 2 / 1e3)
    assert math.isclose(t["idle_ms"], t["span_ms"] - t["busy_ms"])
    assert math.isclose(t["wall_ms"], 2.0)
    bins = t["idle_by_gap"]
    assert bins["0-2us"] == {"count": 0.5, "ms": 0.0005} and bins["2-5us"] == {"count": 0.5, "ms": 0.0015}
    assert bins["100-infus"] == {"count": 0.5, "ms": 0.075}
    assert t["longest_gaps"][0] == {"us": 150.0, "after": "b", "before": "d"}
    assert sp.timeline([], 1, 1.0) == {}


def test_gemm_configs_records_the_blublas_settings_in_force(monkeypatch):
    """The configs benchmark records what blublas.settings read (the values its GEMMs use), not os.environ."""
    settings = pytest.importorskip("blublas.settings")
    bench = _load("benchmarks/blublas/bench_gemm_configs.py")
    monkeypatch.setenv("BLUBLAS_WGMMA_TMA_STORE", "0")
    monkeypatch.setenv("BLUBLAS_WGMMA", "off")
    settings.reset()
    try:
        rec = bench.settings_in_force()
        assert rec["wgmma_tma_store"] is False and rec["wgmma"] == "off" and rec["autotune"] is False
        assert set(rec) == set(settings.ENV) and isinstance(rec["cache_dir"], str)
        monkeypatch.setenv("BLUBLAS_WGMMA_TMA_STORE", "1")  # read once: not in force until a reset
        assert bench.settings_in_force() == rec
        json.dumps(rec)
    finally:
        monkeypatch.undo()
        settings.reset()
