"""Orchestrated micro GPT-2 under DDP on MPI ranks, with blumodels checkpoints and fault injection.

Every rank trains the same model (dtms DDP averages the gradients) on its own batch, a function of
(step, rank) so a replayed step sees the same data; dropout is on, so the RNG state restored from the
checkpoint matters. Per-rank checkpoints through blumodels' CheckpointManager (sync or async); on start
each rank verifies its checkpoints, reports the bad ones and the gang resumes from the newest step every
rank verified. Faults come from $FAULT_SPEC: a JSON list of {kind, rank, step, attempt (default 0)}:
kill | stop | raise | oom | nan | kill_in_save (SIGKILL inside the save of ``step``, before its rename) |
flip | truncate | delete (damage this rank's newest checkpoint, then SIGKILL).

argv: --steps N --ckpt-every K --out DIR [--async] [--nan-policy P] [--keep K] [--device auto|cpu|cuda]
(auto: CUDA when blutensor sees a GPU; under blurun on GPUs the ranks then use NCCL, as in
benchmarks/dtms_gpt2.py --part recovery).
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import blutensor as bt
import dtms
import numpy as np
from blumodels.checkpoint import format as ckfmt
from blumodels.checkpoint.format import CheckpointError, load_checkpoint
from blumodels.checkpoint.manager import CheckpointManager
from blumodels.config import ModelConfig
from blumodels.gpt2 import build_model
from blumodels.state import StateError, restore_training_state, training_state
from dtms.orchestrator import EXIT_REQUEUE, CheckpointLoadError, WorkerAgent
from dtms.parallel.ddp import DistributedDataParallel as DDP

CFG = dict(n_layer=2, n_head=2, d_model=32, block_size=16, vocab_size=64, vocab_multiple=64, dropout=0.1)
B, T = 4, 16


def batch(step, rank, device="cpu"):
    rng = np.random.default_rng(7919 * step + rank)
    x = rng.integers(0, 64, (B, T + 1))
    return bt.tensor(x[:, :-1], device=device), bt.tensor(x[:, 1:], device=device)


def injected(agent, rank, step):
    for f in json.loads(os.environ.get("FAULT_SPEC", "[]")):
        if f["rank"] == rank and f["step"] == step and f.get("attempt", 0) == agent.attempt:
            yield f["kind"]


def damage(ck: CheckpointManager, how: str) -> None:
    p = ck.list()[-1]
    if how == "flip":
        data = bytearray(p.read_bytes())
        data[len(data) - 100] ^= 0x01
        p.write_bytes(bytes(data))
    elif how == "truncate":
        with open(p, "r+b") as f:
            f.truncate(p.stat().st_size // 2)
    else:
        p.unlink()
    os.kill(os.getpid(), signal.SIGKILL)


def kill_before_rename(step_to_kill: int):
    real = ckfmt.os.replace

    def replace(src, dst, *a, **k):
        if f"step_{step_to_kill:08d}." in str(dst):
            os.kill(os.getpid(), signal.SIGKILL)  # the temporary file is written, the rename never happens
        return real(src, dst, *a, **k)

    ckfmt.os.replace = replace


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ckpt-every", type=int, default=3)
    p.add_argument("--out", required=True)
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--nan-policy", default="stop")
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    a = p.parse_args()
    dev = ("cuda" if bt.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    xp = np
    if dev == "cuda":
        import cupy as xp
    agent = WorkerAgent.from_env()
    pg = dtms.init_process_group()
    rank = dtms.get_rank()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"backend.rank{rank}").write_text(pg.backend)
    log = out / f"losses.rank{rank}.jsonl"
    with agent.guard():
        model = build_model(ModelConfig(**CFG), seed=1, device=dev)
        ddp = DDP(model)
        opt = bt.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
        ck = CheckpointManager(out / "ckpt", rank=rank, keep=a.keep, async_save=a.async_save)
        good = []
        for c in ck.list():
            try:
                load_checkpoint(c)
                good.append(ck.step_of(c))
            except (CheckpointError, OSError) as e:
                agent.report_corrupt(str(c), str(e), ck.step_of(c))
        start = agent.agree_resume_step(good)
        if start is not None:
            path, tensors, meta = ck.load(start)
            try:
                restore_training_state(tensors, meta, model, opt)
            except (StateError, KeyError, ValueError) as e:
                raise CheckpointLoadError(f"{path} verified but cannot be restored: {e}") from e
        start = start or 0
        keep = [ln for ln in (log.read_text().splitlines() if log.exists() else []) if json.loads(ln)["step"] < start]
        log.write_text("".join(ln + "\n" for ln in keep))
        f = open(log, "a")

        def save(step):
            tensors, meta = training_state(model, opt, step)
            with agent.phase("checkpoint"):
                ck.save(step, tensors, meta)
                if not a.async_save:
                    agent.checkpoint_committed(step)

        pending = None
        for step in range(start, a.steps):
            kinds = list(injected(agent, rank, step))
            for kind in kinds:
                (out / f"fault.a{agent.attempt}.rank{rank}.{kind}").write_text(repr(time.time()))
                if kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif kind == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                elif kind == "raise":
                    raise RuntimeError(f"injected failure at step {step}")
                elif kind == "oom":
                    raise MemoryError(f"injected allocation failure at step {step}")
                elif kind in ("flip", "truncate", "delete"):
                    damage(ck, kind)
                elif kind == "kill_in_save":
                    kill_before_rename(step + 1)
                elif kind == "slow":  # pace the run so a signal from outside lands mid-run
                    time.sleep(0.5)
            x, y = batch(step, rank, dev)
            _, loss = ddp(x, y)
            if "nan" in kinds:
                loss = loss * float("nan")
            with agent.phase("collective"):
                loss.backward()  # DDP all-reduces the gradients during backward
            lv = xp.array([loss.item()])  # NCCL moves device arrays only
            with agent.phase("collective"):
                dtms.all_reduce(lv, "avg")
            gn = float(np.sqrt(sum(float((p.grad.to("cpu").numpy().astype(np.float64) ** 2).sum())
                                   for p in model.parameters())))
            if agent.check_finite(gn, step, a.nan_policy, "gradient norm"):
                opt.step()
            opt.zero_grad()
            f.write(json.dumps({"step": step, "loss": float(lv[0]).hex()}) + "\n")
            f.flush()
            agent.step_done(step + 1, loss=float(lv[0]), tokens_per_s=float(B * T))
            if pending is not None and not ck.in_flight:
                ck.wait()
                agent.checkpoint_committed(pending)
                pending = None
            if (step + 1) % a.ckpt_every == 0 or step + 1 == a.steps:
                save(step + 1)
                pending = step + 1 if a.async_save else None
            if agent.should_stop():
                if (step + 1) % a.ckpt_every != 0 and step + 1 != a.steps:
                    save(step + 1)
                ck.wait()
                agent.checkpoint_committed(step + 1)
                dtms.barrier()
                agent.finish("preempted", step + 1)
                f.close()
                sys.exit(EXIT_REQUEUE)
        ck.wait()
        agent.checkpoint_committed(a.steps)
        f.close()
        dtms.barrier()
        agent.finish("ok", a.steps)
    dtms.destroy_process_group()


if __name__ == "__main__":
    main()
