"""Run by test_fault_matrix.py under ``python -m dtms.orchestrate``: one Trainer rank with an injected fault.

argv: data out mode; mode nan (non-finite loss at step 0), oom (MemoryError at step 2 of the first attempt),
slow (steps take 50 ms: the test sends SIGTERM), slow-nospace (the same, no interval checkpoints, and every save
after SIGTERM fails with ENOSPC), data (the train shard being read is truncated at step 2), ok.
"""

import os
import sys
import time

import numpy as np
from blumodels.lifecycle import EXIT_PREEMPT_UNSAVED, EXIT_PREEMPTED, PreemptionError
from blumodels.trainer import Trainer
from models_helpers import micro_config

data, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
if mode == "data":  # a private copy of the data, read window by window: its shard is cut short at step 2
    import shutil

    os.environ["BLUTRAIN_SHARD_MEMORY_BYTES"] = "0"
    data = shutil.copytree(data, out + "-data", dirs_exist_ok=True)
cfg = micro_config(data, steps=200 if mode.startswith("slow") else 6, eval_interval=0, keep_checkpoints=2,
                   checkpoint_interval=0 if mode == "slow-nospace" else 1)
tr = Trainer(cfg, out, resume=True, quiet=True)
step = tr.train_step
first = not os.path.exists(os.path.join(out, "oom-injected"))


def faulty():
    if mode == "oom" and tr.step == 2 and first:
        open(os.path.join(out, "oom-injected"), "w").close()
        raise MemoryError("injected: cannot allocate the activations")
    if mode.startswith("slow"):
        time.sleep(0.05)
    if mode == "data" and tr.step == 2:
        with open(tr.train_loader.shards[tr.train_loader._cur], "r+b") as f:
            f.truncate(100)
    return step()


tr.train_step = faulty
if mode == "slow-nospace":  # SIGTERM arrives, then the save of the stop step meets a full disk
    import errno

    from blumodels import lifecycle
    from blumodels.checkpoint import manager as mgr

    orig_save, orig_on, state = mgr.save_checkpoint, lifecycle.Preemption._on_sigterm, {"term": False}

    def on_sigterm(self, signum, frame):
        state["term"] = True
        orig_on(self, signum, frame)

    def save(path, tensors, meta):
        if state["term"]:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return orig_save(path, tensors, meta)

    lifecycle.Preemption._on_sigterm, mgr.save_checkpoint = on_sigterm, save
if mode == "nan":
    tr.model.ln_f.weight._data[0] = np.inf
try:
    with np.errstate(all="ignore"):
        summary = tr.fit()
except PreemptionError as e:
    print(e, file=sys.stderr)
    sys.exit(EXIT_PREEMPT_UNSAVED)
finally:
    tr.close()
sys.exit(EXIT_PREEMPTED if summary["preempted"] else 0)
