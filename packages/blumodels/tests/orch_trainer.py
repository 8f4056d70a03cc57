"""Run by test_fault_matrix.py under ``python -m dtms.orchestrate``: one Trainer rank with an injected fault.

argv: data out mode; mode nan (non-finite loss at step 0), oom (MemoryError at step 2 of the first attempt),
slow (steps take 50 ms: the test sends SIGTERM), ok.
"""

import os
import sys
import time

import numpy as np
from blumodels.lifecycle import EXIT_PREEMPTED
from blumodels.trainer import Trainer
from models_helpers import micro_config

data, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
cfg = micro_config(data, steps=200 if mode == "slow" else 6, checkpoint_interval=1, eval_interval=0,
                   keep_checkpoints=2)
tr = Trainer(cfg, out, resume=True, quiet=True)
step = tr.train_step
first = not os.path.exists(os.path.join(out, "oom-injected"))


def faulty():
    if mode == "oom" and tr.step == 2 and first:
        open(os.path.join(out, "oom-injected"), "w").close()
        raise MemoryError("injected: cannot allocate the activations")
    if mode == "slow":
        time.sleep(0.05)
    return step()


tr.train_step = faulty
if mode == "nan":
    tr.model.ln_f.weight._data[0] = np.inf
with np.errstate(all="ignore"):
    summary = tr.fit()
tr.close()
sys.exit(EXIT_PREEMPTED if summary["preempted"] else 0)
