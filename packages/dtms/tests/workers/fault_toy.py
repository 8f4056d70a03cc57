"""Orchestrated toy data-parallel job for the fault tests (NumPy + dtms MPI, no blumodels).

Each rank computes a least-squares gradient on its own batch (a function of step and rank), the
gradients are averaged with dtms.all_reduce, and every rank applies the same update. Per-rank
checkpoints (JSON, float64 as hex, SHA-256, atomic rename) every --ckpt-every steps; resume from the
step every rank can verify. Faults come from $FAULT_SPEC (JSON list of {kind, rank, step, attempt}).

argv: --steps N --ckpt-every K --out DIR [--nan-policy stop|skip|restart] [--step-sleep S]
"""

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import dtms
import numpy as np
from dtms.orchestrator import EXIT_REQUEUE, WorkerAgent

DIM = 8


def batch(step, rank):
    rng = np.random.default_rng(1000 * step + rank)
    x = rng.standard_normal((16, DIM))
    y = x @ np.arange(1, DIM + 1, dtype=np.float64) + 0.01 * rng.standard_normal(16)
    return x, y


def ckpt_path(d, step, rank):
    return d / f"step_{step:08d}.rank{rank}.json"


def save(d, step, rank, w):
    body = json.dumps({"step": step, "w": [float(v).hex() for v in w]})
    text = json.dumps({"sha256": hashlib.sha256(body.encode()).hexdigest(), "body": body})
    tmp = d / f".tmp-{os.getpid()}"
    tmp.write_text(text)
    os.replace(tmp, ckpt_path(d, step, rank))


def load(p):
    d = json.loads(p.read_text())
    if hashlib.sha256(d["body"].encode()).hexdigest() != d["sha256"]:
        raise ValueError("SHA-256 mismatch")
    b = json.loads(d["body"])
    return b["step"], np.array([float.fromhex(v) for v in b["w"]])


def faults(agent, rank, step, where="step"):
    for f in json.loads(os.environ.get("FAULT_SPEC", "[]")):
        if f["rank"] == rank and f["step"] == step and f.get("attempt", 0) == agent.attempt \
                and f.get("where", "step") == where:
            yield f["kind"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--out", required=True)
    p.add_argument("--nan-policy", default="stop")
    p.add_argument("--step-sleep", type=float, default=0.03)
    p.add_argument("--slow-rank", type=int, default=-1, help="this rank computes --slow-s longer every step")
    p.add_argument("--slow-s", type=float, default=0.0)
    a = p.parse_args()
    agent = WorkerAgent.from_env()
    dtms.init_process_group()
    rank = dtms.get_rank()
    out = Path(a.out)
    ck = out / "ckpt"
    ck.mkdir(parents=True, exist_ok=True)
    log = out / f"losses.rank{rank}.jsonl"
    with agent.guard():
        good = []
        for c in sorted(ck.glob(f"step_*.rank{rank}.json")):
            try:
                good.append(load(c)[0])
            except Exception as e:
                agent.report_corrupt(str(c), str(e))
        start = agent.agree_resume_step(good)
        w = np.zeros(DIM)
        if start is not None:
            _, w = load(ckpt_path(ck, start, rank))
        start = start or 0
        keep = [ln for ln in (log.read_text().splitlines() if log.exists() else []) if json.loads(ln)["step"] < start]
        log.write_text("".join(ln + "\n" for ln in keep))
        f = open(log, "a")
        for step in range(start, a.steps):
            x, y = batch(step, rank)
            r = x @ w - y
            loss = np.array([np.mean(r * r)])
            grad = 2 * x.T @ r / len(y)
            for kind in faults(agent, rank, step):
                (out / f"fault.a{agent.attempt}.rank{rank}.{kind}").write_text(repr(time.time()))
                if kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif kind == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                elif kind == "raise":
                    raise RuntimeError(f"injected failure at step {step}")
                elif kind == "oom":
                    raise MemoryError(f"injected allocation failure at step {step}")
                elif kind == "nan":
                    loss[:] = np.nan
                    grad[:] = np.nan
                elif kind == "collective_hang":  # stuck inside a collective (as a hung NCCL kernel)
                    with agent.phase("collective"):
                        while True:
                            time.sleep(1)
                elif kind == "python_hang":
                    while True:
                        time.sleep(1)
            if rank == a.slow_rank:  # a straggler: more compute before the collective, which the others wait in
                time.sleep(a.slow_s)
            with agent.phase("collective"):
                dtms.all_reduce(grad, "avg")
                dtms.all_reduce(loss, "avg")
            if agent.check_finite(float(np.linalg.norm(grad)), step, a.nan_policy, "gradient norm"):
                w = w - 0.05 * grad
            f.write(json.dumps({"step": step, "loss": float(loss[0]).hex()}) + "\n")
            f.flush()
            time.sleep(a.step_sleep)
            agent.step_done(step + 1, loss=float(loss[0]), tokens_per_s=16 / max(a.step_sleep, 1e-3))
            if (step + 1) % a.ckpt_every == 0 or step + 1 == a.steps:
                save(ck, step + 1, rank, w)
                agent.checkpoint_committed(step + 1)
            if agent.should_stop():
                if (step + 1) % a.ckpt_every != 0:
                    save(ck, step + 1, rank, w)
                    agent.checkpoint_committed(step + 1)
                dtms.barrier()
                agent.finish("preempted", step + 1)
                f.close()
                sys.exit(EXIT_REQUEUE)
        f.close()
        np.save(out / f"final.rank{rank}.npy", w)
        agent.finish("ok", a.steps)
    dtms.destroy_process_group()


if __name__ == "__main__":
    main()
