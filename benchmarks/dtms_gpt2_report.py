"""benchmarks/dtms_gpt2.py's derived numbers and verdicts (pure functions of the runs), and its recovery part.

``derive(runs, W, tol)`` -> (derived, verdicts): per-strategy max |loss - single-device loss|, tokens/s and
peak memory per GPU, DDP scaling efficiency (tokens/s on W GPUs / (W x single-GPU tokens/s at the per-GPU
batch)), BluTrain / PyTorch ratios, async / sync TP, the bucket sweep, and the targets.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAULT_WORKER = ROOT / "tests" / "workers" / "fault_gpt2_worker.py"

class Interrupted(Exception):
    """The driver was asked to stop (SIGTERM from `timeout`): the running gang is stopped, results kept."""


def pdeathsig() -> None:
    """In a child before exec: SIGKILL it when the driver dies, so no rank outlives a killed driver."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass


def stop(procs: list[subprocess.Popen], grace: float = 8.0) -> None:
    """SIGTERM (blurun and the orchestrator tear their gang down), then SIGKILL to each process group left."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    t_end = time.time() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, t_end - time.time()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


TARGETS = {"ddp_over_torch_ddp": 1.0, "ddp_scaling_efficiency": 0.90, "tp_async_over_sync": 1.05}


def _ok(r: dict | None) -> bool:
    return bool(r) and "error" not in r and bool(r.get("losses"))


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def equivalence(eq: dict, tol: float) -> dict:
    """Every run with a reference: max |loss - reference loss| over its steps, and whether it is within tol."""
    out = {}
    for name, r in eq.items():
        ref = r.get("ref")
        if not ref:
            continue
        base = eq.get(ref)
        if not _ok(r) or not _ok(base):
            out[name] = {"ok": False, "why": (r or {}).get("error") or f"reference {ref} failed or missing"}
            continue
        d = [abs(x - y) for x, y in zip(r["losses"], base["losses"])]
        finite = all(math.isfinite(x) for x in r["losses"])
        full = len(d) == len(base["losses"]) == r.get("steps", len(d))
        worst = max(d) if finite else float("inf")
        out[name] = {"ref": ref, "steps": len(d), "max_abs_loss_diff": worst,
                     "first_step_over_tol": next((i for i, x in enumerate(d) if x > tol), None),
                     "ok": finite and full and worst <= tol}
    return out


def per_gpu_table(part: dict) -> dict:
    """tokens/s per GPU and the largest peak memory over the ranks, per run."""
    t = {}
    for name, r in part.items():
        if not _ok(r):
            t[name] = {"error": (r or {}).get("error", "missing")}
            continue
        mem = [m for m in r.get("peak_memory_gib_per_gpu", []) if m is not None]
        used = [m for m in r.get("device_used_gib_per_gpu", []) if m is not None]
        t[name] = {"tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"], "median_step_ms": r["median_step_ms"],
                   "peak_memory_gib_per_gpu_max": max(mem) if mem else None,
                   "device_used_gib_per_gpu_max": max(used) if used else None,
                   "memory_source": r.get("memory_source")}
    return t


def derive(runs: dict, W: int, tol: float) -> tuple[dict, dict]:
    """(derived numbers, verdicts against the targets); a verdict is None when its runs are missing."""
    d: dict = {}
    v: dict = {}
    eq = runs.get("equivalence") or {}
    if eq:
        e = equivalence(eq, tol)
        d["equivalence"] = e
        d["equivalence_table"] = per_gpu_table(eq)
        v["equivalence_all_within_tol"] = bool(e) and all(x["ok"] for x in e.values())
    lay = runs.get("layouts") or {}
    if lay:
        e = equivalence(lay, tol)
        d["layouts"] = e
        v["layouts_all_within_tol"] = bool(e) and all(x["ok"] for x in e.values())
    bench = runs.get("bench") or {}
    if bench:
        tab = per_gpu_table(bench)
        d["bench_table"] = tab

        def tps(n):
            return tab.get(n, {}).get("tokens_per_s_per_gpu")

        d["ddp_scaling_definition"] = ("tokens/s of DDP on W GPUs / (W x tokens/s of one GPU at the per-GPU batch "
                                       "global_batch/W); tokens/s per GPU = global tokens per step / median step / W")
        d["ddp_scaling_efficiency"] = _ratio(tps("bt_ddp"), tps("bt_single_per_gpu"))
        d["torch_ddp_scaling_efficiency"] = _ratio(tps("torch_ddp"), tps("torch_single_per_gpu"))
        d["ddp_over_torch_ddp"] = _ratio(tps("bt_ddp"), tps("torch_ddp"))
        d["fsdp_over_torch_fsdp2"] = _ratio(tps("bt_fsdp"), tps("torch_fsdp2"))
        d["cp_over_torch_cp"] = _ratio(tps("bt_cp_p2p"), tps("torch_cp"))
        d["single_over_torch_single"] = _ratio(tps("bt_single_per_gpu"), tps("torch_single_per_gpu"))
        d["tp_async_over_sync"] = _ratio(tps("bt_tp_async"), tps("bt_tp"))
        refs = {"bt_ddp": "torch_ddp", "bt_fsdp": "torch_fsdp2", "bt_cp_p2p": "torch_cp",
                "bt_single_per_gpu": "torch_single_per_gpu"}
        d["loss_vs_torch_max_abs_diff"] = {
            f"{a}/{b}": max(abs(x - y) for x, y in zip(bench[a]["losses"], bench[b]["losses"]))
            for a, b in refs.items() if _ok(bench.get(a)) and _ok(bench.get(b))}
        for key in TARGETS:
            v[f"{key}>={TARGETS[key]}"] = None if d[key] is None else d[key] >= TARGETS[key]
    sweep = runs.get("sweep") or {}
    if sweep:
        s = {name.removeprefix("bt_ddp_bucket"): (r.get("tokens_per_s_per_gpu") if _ok(r) else None)
             for name, r in sweep.items()}
        d["ddp_bucket_sweep_tokens_per_s_per_gpu"] = s
        good = {k: x for k, x in s.items() if x}
        d["ddp_best_bucket_mb"] = max(good, key=good.get) if good else None
    rec = (runs.get("recovery") or {}).get("orchestrator_kill_rank")
    if rec:
        v["recovery_bit_identical"] = bool(rec.get("ok"))
    return d, v


# ---------------------------------------------------------------- recovery (orchestrator kills a rank)

FAST = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "30", "--progress-timeout", "60",
        "--startup-timeout", "120", "--grace-period", "5"]


def _orchestrate(run: Path, a, env: dict, fault: list) -> dict:
    cmd = [sys.executable, "-m", "dtms.orchestrate", "--run-dir", str(run), "--nproc-per-node", str(a.nproc),
           "--max-restarts", "2", *FAST, str(FAULT_WORKER), "--out", str(run / "job"), "--steps",
           str(a.recovery_steps), "--ckpt-every", "3", "--device", "cpu" if a.device == "cpu" else "auto"]
    t0 = time.time()
    run.mkdir(parents=True, exist_ok=True)
    log = run / "orchestrate.log"
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, env=dict(env, FAULT_SPEC=json.dumps(fault)), stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True, preexec_fn=pdeathsig)
        try:
            rc = p.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            rc = f"timeout after {a.timeout:g}s"
        finally:
            stop([p])
    tail = log.read_text(errors="replace")[-2000:]
    res: dict = {"rc": rc, "seconds": round(time.time() - t0, 1)}
    try:
        st = json.loads((run / "orchestrator_state.json").read_text())
        res.update(restarts=st.get("restarts"), incidents=[(i.get("fault"), i.get("rank"), i.get("step"))
                                                           for i in st.get("incidents", [])])
    except (OSError, ValueError) as e:
        res["state_error"] = str(e)
    if rc != 0:
        res["tail"] = tail
    return res


def _final(run: Path, rank: int):
    from blumodels.checkpoint.manager import CheckpointManager

    _, tensors, meta = CheckpointManager(run / "job" / "ckpt", rank=rank).latest_good()
    return meta.get("step"), tensors


def run_recovery(a, work: Path, env: dict) -> dict:
    """A clean orchestrated DDP GPT-2 run, and one where rank W-1 is SIGKILLed mid-run: losses and final
    weights/optimizer state must be identical (==)."""
    import shutil

    import numpy as np

    base = work / "recovery"
    shutil.rmtree(base, ignore_errors=True)
    kill = {"kind": "kill", "rank": a.nproc - 1, "step": a.recovery_kill_step}
    res = {"clean": _orchestrate(base / "clean", a, env, []),
           "killed": _orchestrate(base / "killed", a, env, [kill]), "fault": kill}
    if res["clean"]["rc"] != 0 or res["killed"]["rc"] != 0:
        res["ok"] = False
        return res
    same_losses, same_state, worst = True, True, 0.0
    for r in range(a.nproc):
        la = (base / "clean" / "job" / f"losses.rank{r}.jsonl").read_text()
        lb = (base / "killed" / "job" / f"losses.rank{r}.jsonl").read_text()
        same_losses &= la == lb
        sa, ta = _final(base / "clean", r)
        sb, tb = _final(base / "killed", r)
        same_state &= sa == sb == a.recovery_steps and ta.keys() == tb.keys()
        for k in ta:
            if k in tb and np.asarray(ta[k]).dtype.kind == "f":
                worst = max(worst, float(np.max(np.abs(np.asarray(ta[k], np.float64) - np.asarray(tb[k], np.float64)))))
            same_state &= k in tb and np.array_equal(ta[k], tb[k])
    bk = base / "killed" / "job" / "backend.rank0"
    res.update(losses_identical=same_losses, final_state_identical=same_state, max_abs_state_diff=worst,
               backend=bk.read_text() if bk.exists() else None)
    res["ok"] = same_losses and same_state and res["killed"].get("restarts") == 1 \
        and any(i[0] == "RANK_DEAD" for i in res["killed"].get("incidents", []))
    return res


if __name__ == "__main__":  # re-derive a written JSON: python3 benchmarks/dtms_gpt2_report.py result.json
    doc = json.loads(Path(sys.argv[1]).read_text())
    doc["derived"], doc["verdicts"] = derive(doc["runs"], doc["machine"].get("nproc", 2), doc["config"]["tol"])
    print(json.dumps({"derived": doc["derived"], "verdicts": doc["verdicts"]}, indent=1, default=str))
    sys.exit(0)
