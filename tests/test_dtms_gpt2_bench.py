"""benchmarks/dtms_gpt2.py end to end on 2 CPU processes (MPI for BluTrain, gloo for PyTorch) with a tiny GPT-2:
every part runs, every BluTrain strategy matches the single-process losses, the PyTorch runs train the same
losses, the orchestrator's kill-a-rank recovery is bit-identical, failures and timeouts are recorded (never a
hang); and the derived numbers and verdicts on synthetic runs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("blumodels")
from dtms.mpi import find_mpiexec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "benchmarks" / "dtms_gpt2.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
from dtms_gpt2_report import derive  # noqa: E402

TINY = ["--layers", "2", "--d-model", "64", "--heads", "4", "--vocab", "512", "--seq", "32", "--batch", "4",
        "--steps", "3", "--warmup", "1", "--device", "cpu"]
needs_mpi = pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec (pip install dtms[mpi])")


def drive(tmp: Path, *args: str, timeout: float = 170) -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp / "r.json"
    p = subprocess.run([sys.executable, str(DRIVER), *TINY, "--out", str(out), *args], capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text()), p


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> dict:
    if find_mpiexec() is None:
        pytest.skip("no mpiexec (pip install dtms[mpi])")
    doc, _ = drive(tmp_path_factory.mktemp("dtms_gpt2"), "--part", "all", "--long-seq", "64", "--long-batch", "2",
                   "--long-steps", "2", "--buckets", "5,100", "--recovery-steps", "9", "--recovery-kill-step", "5",
                   "--timeout", "90")
    return doc


@needs_mpi
@pytest.mark.mpi
@pytest.mark.slow  # the shared dry run: ~60-85 s on 2 cores
def test_every_strategy_matches_single_process(dry_run):
    eq = dry_run["derived"]["equivalence"]
    expected = {"bt_ddp", "bt_fsdp", "bt_tp", "bt_tp_async", "bt_cp_p2p", "bt_cp_allgather", "bt_cp_alltoall",
                "bt_cp_p2p_long"}
    assert set(eq) == expected
    for name, e in eq.items():
        assert e["ok"] and e["steps"] == (2 if name.endswith("_long") else 3), (name, e)
        assert e["max_abs_loss_diff"] <= 1e-5, (name, e)
    assert dry_run["verdicts"]["equivalence_all_within_tol"] is True
    runs = dry_run["runs"]["equivalence"]
    assert runs["bt_ddp"]["backend"] == "mpi" and len(runs["bt_ddp"]["peak_memory_gib_per_gpu"]) == 2
    assert runs["bt_single"]["losses"][-1] < runs["bt_single"]["losses"][0]  # it learns


@needs_mpi
@pytest.mark.mpi
@pytest.mark.slow  # the shared dry run
def test_every_layout_from_the_config_matches_single_process(dry_run):
    lay = dry_run["derived"]["layouts"]
    assert set(lay) == {"bt_fsdp2", "bt_tp2", "bt_tp2_tp_async4", "bt_cp2_cp_rotatorp2p", "bt_cp2_cp_rotatorallgather",
                        "bt_cp2_cp_rotatoralltoall", "torch_tp"}
    for name, e in lay.items():
        assert e["ok"] and e["steps"] == 3 and e["max_abs_loss_diff"] <= 1e-5, (name, e)
    assert dry_run["verdicts"]["layouts_all_within_tol"] is True


@needs_mpi
@pytest.mark.mpi
@pytest.mark.slow  # the shared dry run: ~60-85 s on 2 cores
def test_bench_sweep_and_torch(dry_run):
    bench, d = dry_run["runs"]["bench"], dry_run["derived"]
    for name in ("bt_single_per_gpu", "bt_ddp", "bt_fsdp", "bt_tp", "bt_tp_async", "bt_cp_p2p",
                 "torch_single_per_gpu", "torch_ddp", "torch_fsdp2"):
        assert "error" not in bench[name], (name, bench[name].get("error"), bench[name].get("log_tail"))
        assert bench[name]["tokens_per_s_per_gpu"] > 0 and len(bench[name]["losses"]) == 3
        assert all(m > 0 for m in bench[name]["peak_memory_gib_per_gpu"])
    # PyTorch's context parallel has no CPU attention sharding: then its failure is recorded, not fatal
    assert "error" in bench["torch_cp"] or bench["torch_cp"]["tokens_per_s_per_gpu"] > 0
    # the same model, weights and batches in PyTorch: the same losses
    for pair, diff in d["loss_vs_torch_max_abs_diff"].items():
        assert diff < 1e-5, pair
    assert set(d["loss_vs_torch_max_abs_diff"]) >= {"bt_ddp/torch_ddp", "bt_fsdp/torch_fsdp2"}
    for key in ("ddp_scaling_efficiency", "ddp_over_torch_ddp", "tp_async_over_sync"):
        assert d[key] > 0
    assert set(dry_run["verdicts"]) >= {"ddp_over_torch_ddp>=1.0", "ddp_scaling_efficiency>=0.9",
                                        "tp_async_over_sync>=1.05"}
    assert set(d["ddp_bucket_sweep_tokens_per_s_per_gpu"]) == {"5", "100"}
    assert all(v > 0 for v in d["ddp_bucket_sweep_tokens_per_s_per_gpu"].values())
    assert dry_run["command"].startswith("python3 benchmarks/dtms_gpt2.py ") and "--part all" in dry_run["command"]


@needs_mpi
@pytest.mark.mpi
@pytest.mark.slow  # the shared dry run: ~60-85 s on 2 cores
def test_orchestrator_kill_a_rank_recovers_bit_identically(dry_run):
    rec = dry_run["runs"]["recovery"]["orchestrator_kill_rank"]
    assert rec["ok"] and rec["losses_identical"] and rec["final_state_identical"], rec
    assert rec["killed"]["restarts"] == 1 and [i[:2] for i in rec["killed"]["incidents"]] == [["RANK_DEAD", 1]]
    assert rec["backend"] == "mpi" and rec["max_abs_state_diff"] == 0.0
    assert dry_run["verdicts"]["recovery_bit_identical"] is True


@needs_mpi
def test_failure_and_timeout_are_recorded(tmp_path):
    # 3 heads cannot be split over tp=2: the mesh refuses before any collective, the driver records it
    doc, _ = drive(tmp_path, "--part", "equivalence", "--only", "bt_single,bt_tp", "--heads", "3", "--d-model", "48",
                   "--timeout", "60")
    r = doc["runs"]["equivalence"]
    assert "error" not in r["bt_single"] and "n_head=3" in r["bt_tp"]["error"], r["bt_tp"]
    assert doc["derived"]["equivalence"]["bt_tp"]["ok"] is False
    assert doc["verdicts"]["equivalence_all_within_tol"] is False
    t0 = time.time()
    doc, _ = drive(tmp_path, "--part", "sweep", "--buckets", "25", "--timeout", "0.5")
    assert doc["runs"]["sweep"]["bt_ddp_bucket25"]["error"] == "timeout after 0.5s"
    assert time.time() - t0 < 30


@needs_mpi
def test_sigterm_stops_the_gang_and_keeps_the_json(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.Popen([sys.executable, str(DRIVER), *TINY, "--out", str(out), "--part", "sweep", "--buckets", "5",
                          "--steps", "500"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    work = tmp_path / "r_work"
    t0 = time.time()
    while not list(work.glob("bt_ddp_bucket5.logs/rank*.out")) and time.time() - t0 < 60:
        time.sleep(0.2)
    time.sleep(1.0)
    p.terminate()  # as `timeout` does
    assert p.wait(timeout=30) == 124, p.stdout.read()
    doc = json.loads(out.read_text())
    assert doc["interrupted"] == "driver stopped by signal 15" and doc["running"] == "sweep/bt_ddp_bucket5"
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not left, left  # no rank outlives the driver


def run(name, tps=None, losses=(3.0, 2.9), ref=None, steps=2, error=None, mem=(1.0, 1.5)):
    if error:
        return {"error": error, "ref": ref}
    return {"losses": list(losses), "tokens_per_s_per_gpu": tps, "median_step_ms": 1.0, "ref": ref, "steps": steps,
            "peak_memory_gib_per_gpu": list(mem), "device_used_gib_per_gpu": [None, None], "memory_source": "x"}


def test_derive_on_synthetic_runs():
    runs = {"equivalence": {"bt_single": run("s", 100.0), "bt_ddp": run("d", 50.0, (3.0, 2.9 + 5e-5), "bt_single"),
                            "bt_fsdp": run("f", 40.0, (3.0, 2.9 + 2e-4), "bt_single"),
                            "bt_tp": run("t", 30.0, (3.0,), "bt_single"),
                            "bt_cp_p2p": run("c", error="boom", ref="bt_single"),
                            "bt_cp_p2p_long": run("cl", 1.0, ref="bt_single_long")},
            "bench": {"bt_single_per_gpu": run("s", 1000.0), "bt_ddp": run("d", 950.0),
                      "torch_single_per_gpu": run("ts", 1100.0), "torch_ddp": run("td", 940.0),
                      "bt_tp": run("t", 400.0), "bt_tp_async": run("ta", 428.0),
                      "bt_fsdp": run("f", 800.0), "torch_fsdp2": run("tf", error="nope")},
            "sweep": {"bt_ddp_bucket5": run("a", 900.0), "bt_ddp_bucket25": run("b", 960.0),
                      "bt_ddp_bucket100": run("c", error="timeout after 9s")},
            "recovery": {"orchestrator_kill_rank": {"ok": True}}}
    d, v = derive(runs, 2, 1e-4)
    e = d["equivalence"]
    assert e["bt_ddp"]["ok"] and e["bt_ddp"]["max_abs_loss_diff"] == pytest.approx(5e-5)
    assert not e["bt_fsdp"]["ok"] and e["bt_fsdp"]["first_step_over_tol"] == 1
    assert not e["bt_tp"]["ok"]  # fewer steps than the reference
    assert not e["bt_cp_p2p"]["ok"] and e["bt_cp_p2p"]["why"] == "boom"
    assert not e["bt_cp_p2p_long"]["ok"] and "missing" in e["bt_cp_p2p_long"]["why"]
    assert v["equivalence_all_within_tol"] is False
    assert d["ddp_scaling_efficiency"] == pytest.approx(0.95)
    assert d["torch_ddp_scaling_efficiency"] == pytest.approx(940 / 1100)
    assert d["ddp_over_torch_ddp"] == pytest.approx(950 / 940)
    assert d["tp_async_over_sync"] == pytest.approx(1.07)
    assert d["fsdp_over_torch_fsdp2"] is None and d["cp_over_torch_cp"] is None
    assert d["bench_table"]["bt_ddp"]["peak_memory_gib_per_gpu_max"] == 1.5
    assert d["bench_table"]["torch_fsdp2"] == {"error": "nope"}
    assert v == {"equivalence_all_within_tol": False, "ddp_over_torch_ddp>=1.0": True,
                 "ddp_scaling_efficiency>=0.9": True, "tp_async_over_sync>=1.05": True,
                 "recovery_bit_identical": True}
    assert d["ddp_bucket_sweep_tokens_per_s_per_gpu"] == {"5": 900.0, "25": 960.0, "100": None}
    assert d["ddp_best_bucket_mb"] == "25"
    runs["bench"]["bt_ddp"] = run("d", 850.0)  # below PyTorch and below 90% scaling
    runs["bench"]["bt_tp_async"] = run("ta", 410.0)
    _, v = derive(runs, 2, 1e-4)
    assert v["ddp_over_torch_ddp>=1.0"] is False and v["ddp_scaling_efficiency>=0.9"] is False
    assert v["tp_async_over_sync>=1.05"] is False
    del runs["bench"]["torch_ddp"]
    _, v = derive(runs, 2, 1e-4)
    assert v["ddp_over_torch_ddp>=1.0"] is None  # missing runs: no verdict
