"""benchmarks/e2e_llama.py runs end to end on the CPU at a tiny size (--small): BluTrain's bf16 llama step and the
same weights in PyTorch (transformers' LlamaForCausalLM) give the same losses, and the JSON holds the ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_e2e_llama_small(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "e2e.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "e2e_llama.py"), "--small", "--only",
                        "blutrain_bf16,torch_eager_bf16", "--steps", "3", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    ours, ref = r["runs"]["blutrain_bf16"], r["runs"]["torch_eager_bf16"]
    assert "error" not in ours and "error" not in ref, (ours, ref)
    assert len(ours["losses"]) == 3 and ours["tokens_per_s"] > 0 and ref["tokens_per_s"] > 0
    assert ours["captured_steps"] == 1  # 2 eager warm-up steps, then the captured step (its CPU twin)
    assert r["max_loss_diff_vs_torch_eager"] < 2e-3  # bf16 autocast on both sides, same weights and batches
    assert r["speedup_vs_torch_eager_bf16"] == pytest.approx(ours["tokens_per_s"] / ref["tokens_per_s"])


def test_e2e_llama_bad_arguments():
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "e2e_llama.py"), "--small", "--only", "nope"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--only: unknown run(s) nope" in p.stderr


def test_e2e_llama_small_fp32_curve_reports_its_noise_floor(tmp_path):
    """The curve in fp32 (--curve-precision fp32): BluTrain's captured step and PyTorch eager agree per step to
    float32 rounding, and the JSON sets the difference beside the noise floor (PyTorch with nudged gradients)."""
    pytest.importorskip("transformers")
    out = tmp_path / "curve.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "e2e_llama.py"), "--small", "--only", "curve",
                        "--curve-precision", "fp32", "--curve-steps", "6", "--curve-floor", "perturb", "--out",
                        str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    c = json.loads(out.read_text())["curve"]
    assert c["errors"] == {} and c["precision"] == "fp32"
    ours, ref, pert = (np.array(c[k]) for k in ("blutrain_losses", "torch_eager_losses", "torch_perturbed_losses"))
    assert ours.shape == ref.shape == pert.shape == (6,) and ref[-1] < ref[0]
    np.testing.assert_allclose(ours, ref, rtol=1e-5)  # same semantics: only float32 rounding apart
    assert np.max(np.abs(pert - ref)) < 1e-4  # gradients nudged by one rounding: a curve within rounding
    pair = c["vs_torch_eager"]["blutrain"]
    assert pair["mean_last_6_diff"] == pytest.approx(ours.mean() - ref.mean(), abs=1e-7)
    assert pair["first_step_above_1e-3"] is None and len(pair["block_50_mean_diffs"]) == 1
    assert c["noise_floor"]["torch_perturbed"] == pytest.approx(abs(pert.mean() - ref.mean()), abs=1e-7)
    assert c["within_3e-3"] and c["meets_criterion"]
    assert c["within_noise_floor"] == (c["mean_last_6_diff"] <= c["noise_floor"]["max"])


def test_e2e_llama_bad_curve_floor():
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "e2e_llama.py"), "--small", "--curve-floor",
                        "perturb,nope"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--curve-floor: unknown floor(s) nope" in p.stderr
