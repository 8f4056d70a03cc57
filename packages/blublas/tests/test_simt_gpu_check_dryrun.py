"""dev/gpu_check_simt.py end to end on fake_cupy with tiny shapes: every correctness check passes, every
benchmark row has cuBLASLt and candidate timings (split-K included), and the JSON summary is written."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import fake_cupy
import pytest
from blublas import cublas, loader
from test_gpu_check_dryrun import _fake_matmul

GPU_CHECK = Path(__file__).resolve().parents[1] / "dev" / "gpu_check_simt.py"


@pytest.mark.slow
def test_gpu_check_simt_runs_end_to_end_on_fake_cupy(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setenv("BLUBLAS_CHECK_QUICK", "1")
    for name in ("_modules", "_functions", "_smem_set", "_workspaces"):
        monkeypatch.setattr(loader, name, {})
    monkeypatch.setattr(cublas, "_matmul", _fake_matmul)
    monkeypatch.setattr(cublas, "_state", lambda dev: None)
    monkeypatch.setattr(cublas, "load_library", lambda: None)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["gpu_check_simt.py", str(out)])
    monkeypatch.setenv("BLUBLAS_CACHE_DIR", str(tmp_path / "cache"))
    spec = importlib.util.spec_from_file_location("gpu_check_simt_under_test", GPU_CHECK)
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    monkeypatch.setattr(gc, "GPT2_SHAPES", [("fwd", "nt", 256, 192, 64), ("dw", "tn", 192, 64, 4096)])
    gc.main()
    res = json.loads((out / "blublas_simt_check.json").read_text())
    assert res["failures"] == [], res["failures"][:3]
    assert {"sweep", "epilogue", "split_k", "batched", "misaligned"} <= set(res["checks"])
    assert all(v["fail"] == 0 and v["pass"] > 0 for v in res["checks"].values())
    assert len(res["bench"]) == 2 and all("ratio" in r and "cublaslt_ms" in r for r in res["bench"])
    names = {c.split("/s")[0] for r in res["bench"] for c in r["candidates_ms"]}
    assert {"128x128x8_s2", "128x128x8_s4"} <= names
    assert any(c.endswith("/s7") for c in res["bench"][1]["candidates_ms"])  # split-K candidates on the dW shape
    assert all(r["default"].startswith("128x128x8_s2/") and r["default_ratio"] > 0 for r in res["bench"])
    s = res["summary"]
    assert s["shapes"] == 2 and "128x128x8_s2" in s["per_config"] and s["best_geomean_ratio"] > 0
    assert s["default_geomean_ratio"] > 0
