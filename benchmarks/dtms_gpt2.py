"""GPT-2 124M under dtms's DDP, FSDP, TP (sync/async) and CP (three rotators) on several GPUs, checked against
the single-device run and measured beside PyTorch (DDP, FSDP2, context parallel): one JSON per call.

    python3 benchmarks/dtms_gpt2.py --part equivalence \\
        --nproc 2 --out benchmarks/results/dtms_gpt2_equivalence_h200.json

Parts: ``equivalence`` (every BluTrain strategy, fp32, per-step losses vs the single-device run at the same
global batch; CP also at --long-seq), ``bench`` (tokens/s and peak memory per GPU: BluTrain strategies,
single device at the per-GPU batch for DDP scaling efficiency, PyTorch single/DDP/FSDP2/CP), ``sweep``
(BluTrain DDP bucket size), ``recovery`` (the orchestrator kills a rank of a DDP GPT-2 job; the gang restarts
and ends bit-identical to an uninterrupted run), ``all``. Every child has a timeout; a failure is recorded,
and the JSON is rewritten after every run. BluTrain ranks start through ``blurun`` (one process per GPU,
NCCL; on CPU: mpiexec and the MPI backend); PyTorch ranks get torch.distributed's environment (NCCL; gloo
on CPU). Runs are sequential, each owning the GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RANK_SCRIPT = HERE / "dtms_gpt2_rank.py"
sys.path.insert(0, str(HERE))
from dtms_gpt2_report import Interrupted, derive, pdeathsig, stop  # noqa: E402

ROTATORS = ("p2p", "allgather", "alltoall")


def plan(part: str, a, steps: int) -> list[dict]:
    """The runs of one part: name, framework, strategy, ranks and per-run options."""
    W, B = a.nproc, a.batch
    runs: list[dict] = []

    def add(name, fw, strategy, nproc, **kw):
        kw.setdefault("batch", B)
        kw.setdefault("seq", a.seq)
        kw.setdefault("steps", steps)
        runs.append(dict(name=name, framework=fw, strategy=strategy, nproc=nproc, **kw))

    if part == "equivalence":
        add("bt_single", "blutrain", "single", 1, ref=None)
        add("bt_ddp", "blutrain", "ddp", W, ref="bt_single")
        add("bt_fsdp", "blutrain", "fsdp", W, ref="bt_single")
        add("bt_tp", "blutrain", "tp", W, ref="bt_single")
        add("bt_tp_async", "blutrain", "tp", W, tp_chunks=a.tp_chunks, ref="bt_single")
        for r in ROTATORS:
            add(f"bt_cp_{r}", "blutrain", "cp", W, rotator=r, ref="bt_single")
        if a.long_seq:
            lb = a.long_batch
            add("bt_single_long", "blutrain", "single", 1, batch=lb, seq=a.long_seq, steps=a.long_steps, ref=None)
            for r in a.long_rotators.split(","):
                add(f"bt_cp_{r}_long", "blutrain", "cp", W, rotator=r, batch=lb, seq=a.long_seq,
                    steps=a.long_steps, ref="bt_single_long")
    elif part == "bench":
        per_gpu = max(1, B // W)
        add("bt_single_per_gpu", "blutrain", "single", 1, batch=per_gpu)
        add("bt_ddp", "blutrain", "ddp", W)
        add("bt_fsdp", "blutrain", "fsdp", W)
        add("bt_tp", "blutrain", "tp", W)
        add("bt_tp_async", "blutrain", "tp", W, tp_chunks=a.tp_chunks)
        add("bt_cp_p2p", "blutrain", "cp", W, rotator="p2p")
        if not a.no_torch:
            add("torch_single_per_gpu", "torch", "single", 1, batch=per_gpu)
            add("torch_ddp", "torch", "ddp", W)
            add("torch_fsdp2", "torch", "fsdp", W)
            add("torch_cp", "torch", "cp", W)
    elif part == "layouts":  # every strategy and combination through the [parallel] config (the Trainer's path)
        add("bt_single", "blutrain", "single", 1, ref=None)
        for lay in layouts(W):
            add("bt_" + lay.replace("=", "").replace(",", "_"), "blutrain", "layout", W, layout=lay, ref="bt_single")
        if not a.no_torch:
            add("torch_tp", "torch", "tp", W, ref="bt_single")
    elif part == "sweep":
        for mb in a.buckets.split(","):
            add(f"bt_ddp_bucket{mb}", "blutrain", "ddp", W, bucket_mb=float(mb))
    else:
        raise SystemExit(f"unknown part {part!r}")
    return runs


def layouts(W: int) -> list[str]:
    """[parallel] layouts of W ranks: each strategy alone, then the 2 x (W/2) combinations."""
    out = [f"fsdp={W}", f"tp={W}", f"tp={W},tp_async=4"] + [f"cp={W},cp_rotator={r}" for r in ROTATORS]
    if W >= 4 and W % 2 == 0:
        h = W // 2
        out += ["tp=2", f"fsdp={h},tp=2", "cp=2", f"fsdp={h},cp=2", f"tp=2,cp={h}",  # dp x tp, fsdp x tp, ...
                f"dp=2,fsdp={h}"]  # hybrid sharding (HSDP)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def visible_gpus() -> list[str]:
    """$CUDA_VISIBLE_DEVICES, else CUDA ordinals 0..n-1 for the n GPUs nvidia-smi lists (device-node numbers
    inside a container need not be ordinals), else blurun's view."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") is None:
        try:
            q = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
            n = sum(ln.startswith("GPU ") for ln in q.stdout.splitlines())
            if n:
                os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(n)))  # blurun and children see it
        except (OSError, subprocess.TimeoutExpired):
            pass
    from dtms.run import visible_gpus as v

    return v()


def child_env(device: str = "auto") -> dict:
    env = dict(os.environ)
    if device == "cpu":  # CPU ranks even on a GPU machine: blurun then starts them under mpiexec (MPI backend)
        env["CUDA_VISIBLE_DEVICES"] = ""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "BLUTRAIN_RUN_ID",
              "CUPY_TF32", "BLUTRAIN_FP32_GEMM"):
        env.pop(k, None)
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on the shared machines
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
                                        + [env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def launch(run: dict, a, work: Path) -> dict:
    """Start one run's ranks, wait up to --timeout, and merge their JSON files (or record the failure)."""
    name, W = run["name"], run["nproc"]
    args = ["--framework", run["framework"], "--strategy", run["strategy"], "--name", name, "--out-dir", str(work),
            "--rotator", run.get("rotator", "p2p"), "--tp-chunks", str(run.get("tp_chunks", 1)),
            "--bucket-mb", str(run.get("bucket_mb", 25.0)), "--batch", str(run["batch"]), "--seq", str(run["seq"]),
            "--steps", str(run["steps"]), "--layout", run.get("layout", ""), "--layers", str(a.layers),
            "--d-model", str(a.d_model),
            "--heads", str(a.heads), "--vocab", str(a.vocab), "--allocator", a.allocator, "--device", a.device]
    env = child_env(a.device)
    gpus = visible_gpus() if a.device != "cpu" else []
    log = work / f"{name}.log"
    logf = open(log, "w")
    procs: list[subprocess.Popen] = []
    if W == 1:
        e = dict(env, **({"CUDA_VISIBLE_DEVICES": gpus[0]} if gpus else {}))
        procs.append(subprocess.Popen([sys.executable, str(RANK_SCRIPT), *args], env=e, stdout=logf,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=pdeathsig))
    elif run["framework"] == "blutrain":
        cmd = [sys.executable, "-m", "dtms.run", "--nproc-per-node", str(W), "--log-dir", str(work / f"{name}.logs"),
               "--grace-period", "3", str(RANK_SCRIPT), *args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=pdeathsig))
    else:  # torch.distributed's environment, one process per rank (one GPU each)
        port = free_port()
        for r in range(W):
            e = dict(env, RANK=str(r), WORLD_SIZE=str(W), LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(W),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
            if gpus:
                e["CUDA_VISIBLE_DEVICES"] = gpus[r % len(gpus)]
            procs.append(subprocess.Popen([sys.executable, str(RANK_SCRIPT), *args], env=e, stdout=logf,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=pdeathsig))
    t0 = time.time()
    timed_out = False
    try:
        while any(p.poll() is None for p in procs):
            if time.time() - t0 > a.timeout:
                timed_out = True
                break
            if any(p.poll() not in (None, 0) for p in procs):  # one torch rank failed: do not wait on its peers
                time.sleep(2.0)
                break
            time.sleep(0.1)
    finally:
        stop(procs)
        logf.close()
    wall = time.time() - t0
    ranks = []
    for r in range(W):
        f = work / f"{name}.rank{r}.json"
        ranks.append(json.loads(f.read_text()) if f.exists() else None)
    res = {k: v for k, v in run.items() if k != "name"}
    res.update(wall_s=round(wall, 1), returncodes=[p.returncode for p in procs])
    tail = log.read_text(errors="replace")[-2500:]
    errors = [r["error"] for r in ranks if r and "error" in r]
    if timed_out:
        res["error"] = f"timeout after {a.timeout:g}s"
    elif errors:
        res["error"] = errors[0]
    elif any(r is None for r in ranks) or any(p.returncode for p in procs):
        res["error"] = f"ranks ended with {res['returncodes']}, result files missing for " \
                       f"{[i for i, r in enumerate(ranks) if r is None]}"
    if "error" in res:
        res["log_tail"] = tail
        return res
    r0 = ranks[0]
    steps = r0["step_s"]
    timed = sorted(steps[a.warmup:] if len(steps) > a.warmup else steps)
    med = timed[len(timed) // 2]
    tokens = run["batch"] * run["seq"]
    res.update(losses=r0["losses"], step_s=steps, median_step_ms=med * 1e3, tokens_per_s=tokens / med,
               tokens_per_s_per_gpu=tokens / med / W, device=r0.get("device"), backend=r0.get("backend"),
               memory_source=r0.get("memory_source"),
               peak_memory_gib_per_gpu=[r.get("peak_reserved_gib") for r in ranks],
               peak_allocated_gib_per_gpu=[r.get("peak_allocated_gib") for r in ranks],
               device_used_gib_per_gpu=[r.get("device_used_gib") for r in ranks])
    if len({json.dumps(r["losses"]) for r in ranks}) > 1:
        res["ranks_disagree_on_loss"] = True
    return res


def machine(a) -> dict:
    info = {"python": platform.python_version(), "host": platform.node(), "nproc": a.nproc}
    gpus = visible_gpus() if a.device != "cpu" else []
    info["visible_gpus"] = gpus  # CUDA_VISIBLE_DEVICES as the ranks get it
    if gpus:  # asked of nvidia-smi: a CUDA context in this process would sit on GPU 0 during every run
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
            info["gpus"] = [ln.strip() for ln in q.stdout.splitlines() if ln.strip()]
        except (OSError, subprocess.TimeoutExpired) as e:
            info["gpu_error"] = str(e)
    for mod in ("cupy", "torch"):
        try:
            info[mod] = __import__("importlib.metadata").metadata.version(mod if mod == "torch" else "cupy-cuda13x")
        except Exception:  # noqa: BLE001 - other wheel names: the ranks report what they import
            pass
    return info


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", default="all",
                   help="equivalence | layouts | bench | sweep | recovery | all (comma list)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (one GPU each)")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: 50 equivalence, 20 bench/sweep)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timing median")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--tp-chunks", type=int, default=4, help="async TP: token chunks per row-parallel all-reduce")
    p.add_argument("--long-seq", type=int, default=16384, help="CP at this length too (0: skip)")
    p.add_argument("--long-batch", type=int, default=1)
    p.add_argument("--long-steps", type=int, default=5)
    p.add_argument("--long-rotators", default="p2p", help="rotators run at --long-seq (comma list)")
    p.add_argument("--buckets", default="5,10,25,50,100", help="DDP bucket sizes (MB) for --part sweep")
    p.add_argument("--only", default="", help="comma list of run names")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--tol", type=float, default=1e-4, help="equivalence: max |loss - single-device loss|")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per run")
    p.add_argument("--allocator", default="cupy", help="BluTrain GPU memory: cupy (pool) | caching (bluallocator)")
    p.add_argument("--device", default="auto", help="auto | cpu")
    p.add_argument("--recovery-steps", type=int, default=12)
    p.add_argument("--recovery-kill-step", type=int, default=7)
    p.add_argument("--out", default=str(HERE / "results" / "dtms_gpt2.json"))
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    parts = ["equivalence", "layouts", "bench", "sweep", "recovery"] if a.part == "all" else a.part.split(",")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.parent / (out.stem + "_work")
    work.mkdir(parents=True, exist_ok=True)
    doc = {"command": "python3 benchmarks/dtms_gpt2.py "
                      + " ".join(sys.argv[1:] if argv is None else argv),
           "machine": machine(a),
           "config": {"model": "gpt2" if a.layers == 12 and a.d_model == 768 else "gpt2-small-test",
                      "layers": a.layers, "d_model": a.d_model, "heads": a.heads, "vocab": a.vocab,
                      "global_batch": a.batch, "seq": a.seq, "warmup": a.warmup, "precision": "fp32 (TF32 off)",
                      "optimizer": "AdamW lr 6e-4 betas (0.9, 0.95) eps 1e-8 wd 0.1, clip 1.0",
                      "tp_chunks": a.tp_chunks, "tol": a.tol},
           "runs": {}, "derived": {}, "verdicts": {}}

    def write():
        doc["derived"], doc["verdicts"] = derive(doc["runs"], a.nproc, a.tol)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(out)

    only = set(filter(None, a.only.split(",")))

    def on_term(signum, frame):  # `timeout` stops the driver: stop the running gang, keep what was measured
        raise Interrupted(f"driver stopped by signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    try:
        run_parts(a, parts, only, doc, work, write)
    except Interrupted as e:
        doc["interrupted"] = str(e)
        write()
        print(f"interrupted: {e}", flush=True)
        return 124
    d = doc["derived"]
    brief = {k: (round(x, 4) if isinstance(x, float) else x) for k, x in d.items() if not isinstance(x, dict)}
    if "equivalence" in d:
        brief["max_abs_loss_diff"] = {k: e.get("max_abs_loss_diff", e.get("why")) for k, e in d["equivalence"].items()}
    if "ddp_bucket_sweep_tokens_per_s_per_gpu" in d:
        brief["ddp_bucket_sweep"] = d["ddp_bucket_sweep_tokens_per_s_per_gpu"]
    print("derived " + json.dumps(brief, default=str))
    print("verdicts " + json.dumps(doc["verdicts"]))
    return 0


def run_parts(a, parts: list[str], only: set[str], doc: dict, work: Path, write) -> None:
    """Every run of every part in turn, the JSON rewritten after each."""
    for part in parts:
        doc["runs"][part] = {}
        if part == "recovery":
            from dtms_gpt2_report import run_recovery

            t0 = time.time()
            # bit-identical replay needs bitwise-repeatable kernels (the fused attention backward's atomics are not)
            renv = dict(child_env(a.device), BLUTRAIN_DETERMINISTIC="1")
            doc["runs"][part]["orchestrator_kill_rank"] = run_recovery(a, work, renv)
            print(f"[recovery] {json.dumps(doc['runs'][part]['orchestrator_kill_rank'])[:300]} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            write()
            continue
        runs = plan(part, a, a.steps or (50 if part == "equivalence" else 20))
        for run in runs:
            if only and run["name"] not in only:
                continue
            doc["running"] = f"{part}/{run['name']}"
            res = launch(run, a, work)
            doc.pop("running")
            doc["runs"][part][run["name"]] = res
            write()
            keys = ("tokens_per_s_per_gpu", "median_step_ms", "peak_memory_gib_per_gpu", "wall_s", "error")
            print(f"[{part}] {run['name']}: " + ", ".join(f"{k}={res[k]}" for k in keys if k in res), flush=True)
    write()


if __name__ == "__main__":
    sys.exit(main())
