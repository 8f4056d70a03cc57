"""benchmarks/kernels/bench_decoder.py on the CPU: every row (RMSNorm, residual add + RMSNorm, RoPE, SwiGLU; fp32,
bf16 and the autocast mix; forward and backward) runs through blutensor's public API and PyTorch, passes its
float64 check and lands in the JSON; the torch.compile columns' plumbing (with compiling stubbed out), a wrong
result failing its check, and bad arguments refused with a clear message."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "kernels" / "bench_decoder.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_decoder", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.DOC.update(rows=[], errors=[], graph_errors=[], torch_graph_errors=[])
    return mod


def test_cpu_plumbing_every_row_checked(tmp_path):
    out = tmp_path / "dec.json"
    p = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--size", "tiny", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["errors"] == [] and doc["commit"] and "bench_decoder.py --out OUT.json" in doc["command"]
    names = {r["name"] for r in doc["rows"]}
    expected = {f"{op}.{ps} {dt}" for op in ("rms_norm", "swiglu") for ps in ("fwd", "bwd") for dt in ("f32", "bf16")}
    expected |= {f"add_rms_norm.{ps} {dt}" for ps in ("fwd", "bwd") for dt in ("f32", "bf16", "autocast")}
    expected |= {f"rope.{ps} {h} {dt}" for ps in ("fwd", "bwd") for h in ("q", "k") for dt in ("f32", "bf16")}
    assert names == expected
    assert doc["checks"] == f"{len(expected)} of {len(expected)} passed"
    by = {r["name"]: r for r in doc["rows"]}
    assert set(by["add_rms_norm.bwd autocast"]["err"]) == {"dx", "dres", "dw"}
    assert set(by["rms_norm.bwd bf16"]["err"]) == {"dx", "dw"} and set(by["swiglu.bwd f32"]["err"]) == {"dgate", "dup"}
    for r in doc["rows"]:
        assert r["ok"] and r["torch_ms"] > 0 and r["blutrain_ms"] > 0 and set(r["torch_err"]) == set(r["err"]), r
        assert "compile_ms" not in r  # no torch.compile on the CPU
    assert by["rope.fwd q f32"]["shape"] == "2x16x4x16" and by["rope.fwd k f32"]["shape"] == "2x16x2x16"


def test_compile_columns_and_a_failing_check(monkeypatch):
    mod = _module()
    ctx = mod.Ctx("cpu", False, 1)
    ctx.compile = True  # the CUDA-only columns, with torch.compile stubbed by the eager function
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=None: fn)
    mod.bench_swiglu(ctx, mod.SIZES["tiny"], "f32")
    fwd, bwd = mod.DOC["rows"]
    assert fwd["ok"] and bwd["ok"] and fwd["compile_ms"] > 0 and bwd["compile_ms"] > 0
    assert fwd["speedup_vs_compile"] == pytest.approx(fwd["compile_ms"] / fwd["blutrain_kernel_ms"])
    ref = np.ones((2, 3))
    mod.row(ctx, "x.fwd f32", "x", "fwd", "f32", "2x3", 1, lambda: None, {"y": ref * (1 + 1e-3)}, {"y": ref},
            {"y": "f32"})
    bad = mod.DOC["rows"][-1]
    assert not bad["ok"] and bad["err"]["y"] == pytest.approx(1e-3) and bad["tol"]["y"] == mod.TOL[("fwd", "f32")]
    mod.row(ctx, "y.fwd f32", "y", "fwd", "f32", "2x3", 1, lambda: None, {"y": ref * np.nan}, {"y": ref},
            {"y": "f32"})
    assert mod.DOC["rows"][-1]["err"]["y"] == float("inf") and not mod.DOC["rows"][-1]["ok"]


@pytest.mark.parametrize("args, message", [
    (["--device", "cpu"], "use --size tiny"),
    (["--device", "cpu", "--size", "tiny", "--only", "rms_norm,layer_norm"], "unknown kernel families ['layer_norm']"),
    (["--device", "cpu", "--size", "tiny", "--reps", "0"], "--reps must be at least 1"),
])
def test_bad_arguments(tmp_path, args, message):
    p = subprocess.run([sys.executable, str(BENCH), "--out", str(tmp_path / "x.json"), *args], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and message in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "x.json").exists()


def test_cuda_without_a_gpu_says_how_to_check_the_plumbing(tmp_path):
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0 and torch.cuda.is_available():
            pytest.skip("a GPU is present")
    except Exception:  # noqa: BLE001 - no CuPy or no device: the case under test
        pass
    p = subprocess.run([sys.executable, str(BENCH), "--out", str(tmp_path / "x.json")], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "--device cpu --size tiny" in p.stderr, p.stderr[-2000:]
