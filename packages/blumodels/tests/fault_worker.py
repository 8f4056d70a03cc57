"""Run by test_fault_matrix.py under mpiexec: the Trainer on W ranks, optionally killed (SIGKILL, by itself) at
one point of one rank's save of one step.

argv[1]: JSON {data, out, result, world, resume, keep, interval, steps, kill: {rank, step, point} | null,
term: {rank, step} | null, fail_save: rank | null}. ``term``: run `blutrain train` with SIGTERM sent to that rank
before that step (``fail_save``: that rank's save of the stop step fails with ENOSPC). Kill points:
"write" (half-way through the file), "verify" (file renamed, not yet read back), "receipt" (verified, no receipt),
"commit" (receipt written, last rank, no commit record), "prune" (committed, before pruning).
"""

import json
import os
import signal
import sys
import time

from blumodels.checkpoint import format as fmt
from blumodels.checkpoint import manager as mgr
from blumodels.trainer import Trainer
from models_helpers import micro_config

a = json.loads(sys.argv[1])
cfg = micro_config(a["data"], micro_batch=4, world_size=a["world"], batch_tokens=4 * 32 * a["world"] * 2,
                   keep_checkpoints=a["keep"], checkpoint_interval=a["interval"], steps=a["steps"],
                   eval_interval=0, async_checkpoint=a.get("async", False))
kill = a.get("kill")


def die() -> None:
    time.sleep(0.5)  # the other rank finishes its part of the save (and prunes) first
    os.kill(os.getpid(), signal.SIGKILL)


if kill is not None and int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == kill["rank"]:
    step, point = kill["step"], kill["point"]
    state = {"step": None}
    orig_save, orig_load, orig_json, orig_prune = (mgr.save_checkpoint, mgr.verify_checkpoint,
                                                   mgr.CheckpointManager._write_json, mgr.CheckpointManager.prune)

    def save(path, tensors, meta):
        state["step"] = meta["step"]
        if point == "write" and meta["step"] == step:
            views = {"n": 0}
            orig_view = fmt._bytes_view

            def view(arr):
                views["n"] += 1
                if views["n"] == 3:
                    die()
                return orig_view(arr)

            fmt._bytes_view = view
        return orig_save(path, tensors, meta)

    def verify(path):
        if point == "verify" and state["step"] == step:
            die()
        return orig_load(path)

    def write_json(self, path, obj):
        if point == "commit" and state["step"] == step and path.name.endswith(".ok"):
            time.sleep(0.5)  # the other rank's receipt lands first: this rank is the one to write the record
        if state["step"] == step and ((point == "receipt" and path.name.endswith(".ok")) or
                                      (point == "commit" and path.name.endswith(".commit"))):
            die()
        return orig_json(self, path, obj)

    def prune(self):
        if point == "prune" and state["step"] == step:
            die()
        return orig_prune(self)

    mgr.save_checkpoint, mgr.verify_checkpoint = save, verify
    mgr.CheckpointManager._write_json, mgr.CheckpointManager.prune = write_json, prune

term, fail = a.get("term"), a.get("fail_save")
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
if term is not None:  # through `blutrain train` itself: SIGTERM on one rank before a step, exit 75 or 74
    import errno

    from blumodels import cli

    orig_step = Trainer.train_step

    def train_step(self):
        if rank == term["rank"] and self.step == term["step"]:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler only raises the flag: the step runs to its end
        return orig_step(self)

    Trainer.train_step = train_step
    if fail is not None and rank == fail:  # this rank's save at the stop step meets a full disk
        orig_save_fn = mgr.save_checkpoint

        def full_disk(path, tensors, meta):
            if meta["step"] == term["step"] + 1:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return orig_save_fn(path, tensors, meta)

        mgr.save_checkpoint = full_disk
    cli.resolve_config = lambda args: cfg
    sys.exit(cli.main(["train", "--out", a["out"], "--quiet"]))
tr = Trainer(cfg, a["out"], resume=a["resume"], quiet=True)
tr.fit()
tr.close()
if tr.dist.is_main:
    params = {n: p.numpy().ravel().tolist() for n, p in tr.model.named_parameters()}
    json.dump({"history": tr.history, "params": params, "step": tr.step, "resumed_from": tr.resumed_from},
              open(a["result"], "w"))
