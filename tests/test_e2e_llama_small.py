"""benchmarks/e2e_llama.py runs end to end on the CPU at a tiny size (--small): BluTrain's bf16 llama step and the
same weights in PyTorch (transformers' LlamaForCausalLM) give the same losses, and the JSON holds the ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
