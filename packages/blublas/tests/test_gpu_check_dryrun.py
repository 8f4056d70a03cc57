"""dev/gpu_check.py end to end on fake_cupy with tiny shapes: every step runs, the JSON is written, and the
only failures are the cuBLAS capture cases (the fake cuBLAS call cannot be recorded into a fake graph)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import fake_cupy
import numpy as np
import pytest
from blublas import cublas
from blublas.reference import f32_to_bf16_bits
from blublas.testing import to_f64

GPU_CHECK = Path(__file__).resolve().parents[1] / "dev" / "gpu_check.py"


def _fake_matmul(p, st, stream, fuse):
    if fuse and (p.bias is not None or p.gelu):
        return False  # exercise the unfused + epilogue-kernel fallback
    a, b = to_f64(p.a.get(), p.precision == "bf16"), to_f64(p.b.get(), p.precision == "bf16")
    v = p.alpha * ((np.swapaxes(a, -1, -2) if p.trans_a else a) @ (np.swapaxes(b, -1, -2) if p.trans_b else b))
    if p.beta:
        v = v + p.beta * to_f64(p.out.get(), p.out_tag == "bf16")
    p.out[...] = f32_to_bf16_bits(v.astype(np.float32)) if p.out_tag == "bf16" else v.astype(np.float32)
    return True


@pytest.mark.slow
def test_gpu_check_runs_end_to_end_on_fake_cupy(monkeypatch, tmp_path):
    fake_cupy.install(monkeypatch, tmp_path)
    monkeypatch.setenv("BLUBLAS_CHECK_QUICK", "1")
    monkeypatch.setenv("BLUBLAS_CHECK_INPROC", "1")  # the wgmma groups run in this process (fake CuPy)
    monkeypatch.setenv("BLUBLAS_CHECK_TORCH", "0")  # no torch import under a fake "cupy"
    monkeypatch.setenv("BLUBLAS_WGMMA_PROBE", "inproc")  # fake CuPy lives in this process only
    monkeypatch.setattr(cublas, "_matmul", _fake_matmul)
    monkeypatch.setattr(cublas, "_state", lambda dev: None)
    monkeypatch.setattr(cublas, "load_library", lambda: None)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", str(out)])
    monkeypatch.setenv("BLUBLAS_CACHE_DIR", str(tmp_path / "cache"))
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", GPU_CHECK)
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    monkeypatch.setattr(gc, "precompile", lambda: None)
    monkeypatch.setattr(
        gc, "GPT2_SHAPES", [("fwd", "nt", 256, 192, 64), ("dx", "nn", 256, 64, 192), ("dw", "tn", 192, 64, 2048)]
    )
    monkeypatch.delenv("BLUBLAS_WGMMA", raising=False)
    gc.main()
    monkeypatch.delenv("BLUBLAS_WGMMA", raising=False)
    res = json.loads((out / "blublas_gpu_check.json").read_text())
    unexpected = [f for f in res["failures"] if not (f["check"] == "capture" and "cublas" in f.get("case", ""))]
    assert unexpected == [], unexpected[:3]
    assert res["wgmma_validated"] == {
        "wgmma|nn": True,
        "wgmma|nt": True,
        "wgmma|tn": True,
        "wgmma_tf32|nt": True,
        "wgmma_tf32|nn": True,
        "wgmma_tf32|tn": True,
    }
    assert res["wgmma_auto_self_test"] and all(ok for ok, _why in res["wgmma_auto_self_test"].values())
    bench = json.loads((out / "blublas_gemm_h200.json").read_text())
    assert bench["command"].endswith("gpu_check.py OUTDIR")
    assert {r["precision"] for r in bench["shapes"] if "ratio" in r} == {"fp32", "tf32", "bf16"}
    for r in bench["shapes"]:
        assert {"ours_ms", "ours_tflops", "ours_kernel", "cublaslt_ms", "cublaslt_tflops", "ratio"} <= set(r), r
    for prec, s in bench["summary"].items():
        assert s["min_ratio"] <= s["geomean_ratio"] and s["target_min"] == 0.6, (prec, s)
    assert {r["precision"] for r in res["bench"] if "ratio" in r} == {"fp32", "tf32", "bf16"}
    assert set(res["bench_summary"]) == {"fp32", "tf32", "bf16"}
