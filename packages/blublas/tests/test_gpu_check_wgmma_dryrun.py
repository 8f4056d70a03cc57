"""dev/gpu_check_wgmma.py's correctness and benchmark sections run end to end on fake CuPy (whose TMA kernels
read through the fake-encoded tensor maps), so a run on an H200 cannot die of a Python error."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import fake_cupy
import pytest
from blublas import cublas
from test_gpu_check_dryrun import _fake_matmul

SCRIPT = Path(__file__).resolve().parents[1] / "dev" / "gpu_check_wgmma.py"


@pytest.mark.slow
def test_gpu_check_wgmma_sections_on_fake_cupy(monkeypatch, tmp_path):
    fake_cupy.install(monkeypatch, tmp_path, sm90=True)
    monkeypatch.setattr(cublas, "_matmul", _fake_matmul)
    monkeypatch.setattr(cublas, "_state", lambda dev: None)
    monkeypatch.setattr(cublas, "load_library", lambda: None)
    monkeypatch.setenv("BLUBLAS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("BLUBLAS_WGMMA", "auto")  # the sections set it to 1: restored at teardown
    monkeypatch.setenv("BLUBLAS_WGMMA_CHECK_T0", "")
    monkeypatch.setattr(sys, "argv", ["gpu_check_wgmma.py", str(tmp_path / "out")])
    spec = importlib.util.spec_from_file_location("gpu_check_wgmma_under_test", SCRIPT)
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    monkeypatch.setattr(
        gc, "GPT2_SHAPES", [("fwd", "nt", 256, 192, 64), ("dx", "nn", 256, 64, 192), ("dw", "tn", 192, 64, 2048)]
    )
    for prec, lay in gc.GROUPS:
        part: dict = {}
        gc.sec_correct(part, prec, lay)
        assert part and all(v["fail"] == 0 for v in part.values()), (prec, lay, part)
    for prec, validated in (("bf16", ["nn", "nt", "tn"]), ("tf32", ["nt", "tn"])):
        part = {}
        gc.sec_bench(part, prec, validated)
        rows = part["rows"]
        assert len(rows) == 3 and all("ratio" in r for r in rows), rows
        for r in rows:
            want = ("wgmma" if prec == "bf16" else "wgmma_tf32") if r["layout"] in validated else prec
            assert any(c.startswith(want + ":") for c in r["candidates_ms"]), r  # (fake timings pick any)
            assert all(isinstance(v, float) for v in r["candidates_ms"].values()), r
            assert "ratio_graph" in r and "heuristic_ratio" in r, r  # CUDA-graph timing, the library's own pick
        gc.RESULT["sections"][f"bench_{prec}"] = part
    monkeypatch.setattr(gc, "GPT2_SHAPES", [("fwd_fc", "nt", 256, 192, 64), ("dw_fc", "tn", 192, 64, 256)])
    part = {}
    gc.sec_diag(part)
    assert set(part) == {"no_epilogue_flag", "fwd_fc", "dw_fc"} and len(part["fwd_fc"]) == 6, part
    gc.summarize()
    assert set(gc.RESULT["summary"]) == {"bf16", "tf32"}
