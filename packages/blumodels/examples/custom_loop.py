"""A training loop without the Trainer: model, loader, AdamW, LR schedule, checkpoints (resumable).

Usage: python custom_loop.py DATA_DIR OUT_DIR [STOP_AT]   (DATA_DIR from `blutrain prepare`)
"""
import json
import sys
from pathlib import Path

import blutensor as bt
from blumodels.checkpoint.manager import CheckpointManager
from blumodels.config import ModelConfig
from blumodels.data.loader import TokenLoader
from blumodels.gpt2 import build_model
from blumodels.state import restore_training_state, training_state
from blutensor.optim.lr_scheduler import warmup_cosine

data_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
steps = 20  # length of the LR schedule
stop_at = int(sys.argv[3]) if len(sys.argv) > 3 else steps  # stop early (and resume later)
vocab = json.loads((data_dir / "meta.json").read_text())["vocab_size"]
cfg = ModelConfig(n_layer=2, n_head=2, d_model=64, block_size=64, vocab_size=vocab)
model = build_model(cfg, seed=0)  # on "cpu"; build_model(cfg, device="cuda") on a GPU
opt = bt.optim.AdamW(model.param_groups(weight_decay=0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
loader = TokenLoader(data_dir, "train", 8, 64)
ckpt = CheckpointManager(out / "checkpoints", keep=2)
step = 0
if (found := ckpt.latest_good()) is not None:  # resume: params, moments, RNG, loader position
    step = restore_training_state(found[1], found[2], model, opt, loader)
while step < stop_at:
    for g in opt.param_groups:
        g["lr"] = warmup_cosine(step, 1e-3, 1e-4, 5, steps)
    x, y = loader.next_batch()
    _, loss = model(x, y)
    opt.zero_grad()
    loss.backward()
    bt.optim.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    step += 1
    print(json.dumps({"step": step - 1, "loss": loss.item()}), flush=True)
    if step % 10 == 0 or step == stop_at:
        ckpt.save(step, *training_state(model, opt, step, loader))
ckpt.close()
