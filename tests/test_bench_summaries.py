"""The benchmark summarizers turn raw measurements into the committed result files: ratios, geometric means
and the target verdicts must follow from the numbers (CPU, synthetic pytest-benchmark JSON)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

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
