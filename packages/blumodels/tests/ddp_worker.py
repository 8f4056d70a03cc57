"""Run by test_ddp_trainer.py under mpiexec: the Trainer with train.world_size=W (DDP over MPI)."""

import json
import sys

from blumodels.trainer import Trainer
from models_helpers import micro_config

# argv: data out world result fresh|resume stop_at(0 = none) dropout
data, out, world, result = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
resume, stop, dropout = sys.argv[5] == "resume", int(sys.argv[6]) or None, float(sys.argv[7])
cfg = micro_config(data, micro_batch=4, world_size=world, batch_tokens=4 * 32 * world * 2)
cfg.model.dropout = dropout
tr = Trainer(cfg, out, resume=resume, quiet=True)
tr.fit(stop)
tr.close()
if tr.dist.is_main:
    params = {n: p.numpy().ravel()[:64].tolist() for n, p in tr.model.named_parameters()}
    json.dump({"history": tr.history, "params": params, "step": tr.step}, open(result, "w"))
