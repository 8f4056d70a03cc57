"""Run by test_ddp_trainer.py under mpiexec: the DDP Trainer (accumulation, small buckets) recording, for every
synchronised backward, the position of each bucket all-reduce launch among the backward nodes that ran.

With a fifth argument ``capture`` the Trainer takes its captured path through the CPU capture twin (EagerCapture:
'capture' records the step, 'replay' runs the recorded body), as it does on CUDA with NCCL: two eager warm-up
steps, then the micro-step and last-micro-step graphs replayed, the bucketed all-reduces inside them."""

import json
import sys

import blumodels.dist as bdist
from blumodels.trainer import Trainer
from blutensor.ext import add_backward_observer
from models_helpers import micro_config, record_all_reduces

data, out, result = sys.argv[1], sys.argv[2], sys.argv[3]
capture = len(sys.argv) > 4 and sys.argv[4] == "capture"
events: list = []


def observe(node, grad, run):
    events.append("node")
    return run()


def wrap(self, model, cfg=None):  # DDP with ~8 KB buckets: a 2-layer d_model 32 GPT-2 fills several
    from dtms.parallel.ddp import DistributedDataParallel

    ddp = DistributedDataParallel(model, self.pg, bucket_cap_mb=0.008)
    record_all_reduces(ddp, lambda: events.append("launch"))
    return ddp


bdist.Dist.wrap = wrap
cfg = micro_config(data, micro_batch=4, world_size=2, batch_tokens=4 * 32 * 2 * 2, steps=4, eval_interval=0,
                   checkpoint_interval=0)
if capture:
    from blumodels import graph_step

    graph_step.config_refusal = lambda cfg: None  # the capture twin runs where CUDA would capture
    graph_step.runtime_refusal = lambda device, world_size=1: None
tr = Trainer(cfg, out, quiet=True)
if capture:
    from blumodels.graph_step import EagerCapture

    tr._make_capture = EagerCapture
add_backward_observer(observe)
steps = []
for _ in range(cfg.train.steps):
    events.clear()
    tr.fit(tr.step + 1, save_final=False)
    # the synchronised backward is the last micro-step's: its nodes follow the last micro-step's first launch
    nodes = [i for i, e in enumerate(events) if e == "node"]
    launches = [i for i, e in enumerate(events) if e == "launch"]
    half = len(nodes) // 2  # two micro-steps, the same graph: the second half of the nodes is the synced backward
    synced = nodes[half:]
    steps.append({"launches": [sum(1 for n in synced if n < li) for li in launches], "nodes": len(synced)})
tr.close()
if tr.dist.is_main:
    json.dump({"steps": steps, "history": tr.history,
               "captures": tr._captured.last.captures if getattr(tr, "_captured", None) is not None else 0},
              open(result, "w"))
