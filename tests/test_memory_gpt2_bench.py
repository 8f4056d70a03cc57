"""benchmarks/memory_gpt2.py's long-context runs on the CPU with a tiny GPT-2: case b in bf16 (the Trainer's step,
captured and eager, beside PyTorch bf16 autocast) and fp32's captured Trainer step run and train the same losses;
bad arguments are refused before any run; the ratios, loss differences and verdicts follow from the runs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("blumodels")
pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "memory_gpt2.py"


def _module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("memory_gpt2", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _drive(tmp: Path, *args: str) -> dict:
    out = tmp / "mem.json"
    p = subprocess.run([sys.executable, str(BENCH), "--tiny", "--timeout", "240", "--out", str(out), *args],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text())


def test_bf16_long_context_plumbing(tmp_path):
    doc = _drive(tmp_path, "--only", "b", "--precision", "bf16", "--steps", "4")
    assert doc["precision"] == "bf16" and "memory_gpt2.py --tiny" in doc["command"] and doc["commit"]
    assert doc["cases"]["b"]["steps"] == 4
    b = doc["results"]["b"]
    assert set(b) == {"torch_eager", "blutrain", "blutrain_eager"}  # torch.compile is left out on the CPU
    for name, r in b.items():
        assert "error" not in r, (name, r)
        assert len(r["losses"]) == 4 and r["precision"] == "bf16" and r["tokens_per_s"] > 0, name
    assert b["blutrain"]["captured"] and b["blutrain"]["timed_from"] == 2 and b["blutrain"]["capture_s"] is not None
    assert not b["blutrain_eager"]["captured"]
    assert b["blutrain"]["losses"] == b["blutrain_eager"]["losses"]  # the captured step is the eager step
    diff = doc["loss_diff"]["b:blutrain/torch_eager"]
    assert diff["steps"] == 4 and diff["max_abs"] <= 1e-2  # bf16 autocast on both sides, same weights and batches
    assert set(doc["ratios"]) == {"b:tokens_per_s:blutrain/torch_eager", "b:tokens_per_s:blutrain_eager/torch_eager"}
    assert doc["targets"] == {}  # the bf16 target is against torch.compile, which did not run


def test_fp32_captured_trainer_step_matches_the_eager_loop(tmp_path):
    doc = _drive(tmp_path, "--only", "b", "--runs", "torch_eager,blutrain,blutrain_graph")
    b = doc["results"]["b"]
    assert doc["precision"] == "fp32" and set(b) == {"torch_eager", "blutrain", "blutrain_graph"}
    assert b["blutrain_graph"]["captured"] and len(b["blutrain_graph"]["losses"]) == 3
    for name in ("blutrain", "blutrain_graph"):
        assert doc["loss_diff"][f"b:{name}/torch_eager"]["max_abs"] <= 1e-4, name


@pytest.mark.parametrize("args, message", [
    (["--precision", "bf16", "--only", "a"], "no runs at --precision bf16"),
    (["--only", "b", "--runs", "torch_eager,nope"], "no run named ['nope']"),
    (["--precision", "bf16", "--steps", "2"], "needs --steps > 2"),
    (["--precision", "fp16"], "invalid choice: 'fp16'"),
])
def test_bad_arguments_are_refused_before_any_run(tmp_path, args, message):
    p = subprocess.run([sys.executable, str(BENCH), "--tiny", "--out", str(tmp_path / "x.json"), *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and message in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "x.json").exists()


def test_ratios_loss_differences_and_the_bf16_target():
    mod = _module()
    results = {"b": {
        "torch_eager": {"tokens_per_s": 100.0, "peak_reserved_gib": 40.0, "peak_allocated_gib": 30.0,
                        "losses": [11.0, 9.0]},
        "torch_compile": {"tokens_per_s": 200.0, "peak_reserved_gib": 20.0, "peak_allocated_gib": 18.0,
                          "losses": [11.0, 9.5]},
        "blutrain": {"tokens_per_s": 230.0, "peak_reserved_gib": 10.0, "peak_allocated_gib": 9.0,
                     "losses": [11.0, 9.25]},
    }}
    ratios, targets, loss_diff = mod._verdicts(results, 80, "bf16")
    key = "b:tokens_per_s:blutrain/torch_compile"
    assert ratios[key] == pytest.approx(1.15) and targets[key]["met"] and targets[key]["bound"] == ">= 1.1"
    assert ratios["b:tokens_per_s:blutrain/torch_eager"] == pytest.approx(2.3)
    assert ratios["b:peak_reserved_gib:blutrain/torch_compile"] == pytest.approx(0.5)
    assert ratios["b:peak_allocated_gib:blutrain/torch_eager"] == pytest.approx(0.3)
    assert loss_diff["b:blutrain/torch_eager"]["per_step"] == [0.0, 0.25]
    assert loss_diff["b:torch_compile/torch_eager"]["max_abs"] == 0.5
    results["b"]["blutrain"]["tokens_per_s"] = 210.0
    assert not mod._verdicts(results, 80, "bf16")[1][key]["met"]  # 1.05x is below the bound
    assert key not in mod._verdicts(results, 80, "fp32")[1]  # the fp32 targets are against PyTorch eager


def test_gpu_runs_without_a_gpu_are_refused_with_the_cpu_alternative(tmp_path):
    if not _module()._no_gpu_reason():
        pytest.skip("a GPU is present")
    p = subprocess.run([sys.executable, str(BENCH), "--only", "b", "--precision", "bf16", "--out",
                        str(tmp_path / "x.json")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--tiny runs the same plumbing" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "x.json").exists()

