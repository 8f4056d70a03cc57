"""nanoGPT's unmodified model.py on blutensor, against the same file on PyTorch CPU.

Training loop as nanoGPT's train.py writes it: DataLoader batches, configure_optimizers (AdamW, decay and
no-decay groups), a warmup + cosine SequentialLR, clip_grad_norm_, and a checkpoint saved with
``blutensor.save`` mid-run and loaded into a fresh model/optimizer/scheduler that continues. Losses must
match PyTorch step for step; greedy ``generate()`` must produce PyTorch's tokens. A second run executes the
file with no edit at all under ``python -m blutensor.compat``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import blutensor as bt
import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent
MODEL = HERE / "nanogpt_model.py"
IMPORTS = {"import torch\n": "import blutensor as torch\n",
           "import torch.nn as nn\n": "import blutensor.nn as nn\n",
           "from torch.nn import functional as F\n": "from blutensor.nn import functional as F\n"}
CFG = dict(block_size=16, vocab_size=48, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True)
STEPS, SAVE_AT, BATCH = 10, 5, 4


def _module(name: str, src: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__file__ = str(MODEL)
    sys.modules[name] = mod  # dataclasses look their module up
    exec(compile(src, str(MODEL), "exec"), mod.__dict__)
    return mod


def blutensor_model_module() -> types.ModuleType:
    """model.py with only its three torch import lines pointed at blutensor."""
    src = MODEL.read_text()
    for old, new in IMPORTS.items():
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    return _module("nanogpt_model_blutensor", src)


def torch_model_module() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("nanogpt_model_torch", MODEL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _windows(n_tokens: int = 400):
    toks = (np.arange(n_tokens) * 5 + np.random.default_rng(0).integers(0, 2, n_tokens)) % CFG["vocab_size"]
    t = CFG["block_size"]
    starts = np.arange(0, n_tokens - t - 1, 8)
    x = np.stack([toks[s:s + t] for s in starts])
    y = np.stack([toks[s + 1:s + 1 + t] for s in starts])
    return x, y


def _loop(lib, data, model, opt, sched, steps, losses):
    for xb, yb in data:
        if len(losses) == steps:
            return
        _, loss = model(xb, yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        lib.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())


def _opt_sched(lib, model):
    opt = model.configure_optimizers(weight_decay=0.1, learning_rate=3e-3, betas=(0.9, 0.95), device_type="cpu")
    sl = lib.optim.lr_scheduler
    sched = sl.SequentialLR(opt, [sl.LinearLR(opt, 0.1, 1.0, total_iters=3),
                                  sl.CosineAnnealingLR(opt, T_max=STEPS, eta_min=3e-4)], milestones=[3])
    return opt, sched


def test_training_loop_with_checkpoint_matches_torch(tmp_path):
    bm, tm = blutensor_model_module(), torch_model_module()
    bt.manual_seed(0)
    model = bm.GPT(bm.GPTConfig(**CFG))
    ref = tm.GPT(tm.GPTConfig(**CFG))
    ref.load_state_dict({k: torch.tensor(v.numpy().copy()) for k, v in model.state_dict().items()})
    assert ref.transformer.wte.weight is ref.lm_head.weight and model.transformer.wte.weight is model.lm_head.weight
    x, y = _windows()
    from blutensor.utils.data import DataLoader, TensorDataset

    data = DataLoader(TensorDataset(bt.tensor(x), bt.tensor(y)), batch_size=BATCH, drop_last=True)
    tdata = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y)),
                                        batch_size=BATCH, drop_last=True)
    assert len(data) == len(tdata) >= STEPS + 1
    opt, sched = _opt_sched(bt, model)
    topt, tsched = _opt_sched(torch, ref)
    ours, theirs = [], []
    _loop(bt, data, model, opt, sched, SAVE_AT, ours)
    path = tmp_path / "ckpt.safetensors"
    bt.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "iter_num": SAVE_AT, "config": CFG}, path)
    _loop(torch, tdata, ref, topt, tsched, STEPS, theirs)

    ckpt = bt.load(path)  # resume in fresh objects, as train.py's init_from='resume' does
    bt.manual_seed(123)
    model2 = bm.GPT(bm.GPTConfig(**ckpt["config"]))
    res = model2.load_state_dict(ckpt["model"])
    assert res.missing_keys == [] and res.unexpected_keys == []
    opt2, sched2 = _opt_sched(bt, model2)
    opt2.load_state_dict(ckpt["optimizer"])
    sched2.load_state_dict(ckpt["scheduler"])
    assert sched2.get_last_lr() == sched.get_last_lr() and ckpt["iter_num"] == SAVE_AT
    rest = iter(data)
    for _ in range(SAVE_AT):
        next(rest)
    _loop(bt, rest, model2, opt2, sched2, STEPS, ours)
    assert len(ours) == len(theirs) == STEPS
    rel = np.abs(np.array(ours) - np.array(theirs)) / np.abs(np.array(theirs))
    assert rel.max() < 2e-6, (rel.max(), ours, theirs)
    print(f"max relative loss difference {rel.max():.2e}")
    assert theirs[-1] < theirs[0] - 0.1  # it trains


def test_generate_greedy_matches_torch():
    if not hasattr(bt, "topk") or not hasattr(bt, "multinomial"):
        pytest.skip("blutensor.topk / multinomial are not in this build")
    bm, tm = blutensor_model_module(), torch_model_module()
    bt.manual_seed(1)
    model = bm.GPT(bm.GPTConfig(**CFG)).eval()
    ref = tm.GPT(tm.GPTConfig(**CFG)).eval()
    ref.load_state_dict({k: torch.tensor(v.numpy().copy()) for k, v in model.state_dict().items()})
    idx = np.random.default_rng(2).integers(0, CFG["vocab_size"], (2, 5))
    out = model.generate(bt.tensor(idx), max_new_tokens=20, top_k=1)  # top-1: sampling is the argmax
    tout = ref.generate(torch.tensor(idx), max_new_tokens=20, top_k=1)
    assert out.shape == (2, 25)  # longer than block_size: the context is cropped, as nanoGPT does
    np.testing.assert_array_equal(out.numpy(), tout.numpy())
    sampled = model.generate(bt.tensor(idx), max_new_tokens=6, temperature=0.8, top_k=5)
    assert sampled.shape == (2, 11) and 0 <= int(sampled.numpy().min()) and int(sampled.numpy().max()) < 48


SCRIPT = """
import json, sys
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
assert torch.__name__ == "blutensor" and nn.__name__ == "blutensor.nn"
sys.path.insert(0, {here!r})
import nanogpt_model as m
torch.manual_seed(0)
model = m.GPT(m.GPTConfig(**{cfg!r}))
x, y = {xy!r}
opt = model.configure_optimizers(0.1, 3e-3, (0.9, 0.95), "cpu")
losses = []
with torch.inference_mode():
    assert not torch.is_grad_enabled()
for xb, yb in DataLoader(TensorDataset(torch.tensor(x), torch.tensor(y)), batch_size=4):
    _, loss = model(xb, yb)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    losses.append(loss.item())
print("LOSSES" + json.dumps(losses[:3]))
"""


def test_unmodified_file_runs_under_the_torch_alias(tmp_path):
    x, y = _windows(60)
    script = tmp_path / "train_alias.py"
    script.write_text(SCRIPT.format(here=str(HERE), cfg=CFG, xy=(x.tolist(), y.tolist())))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-m", "blutensor.compat", str(script)], capture_output=True, text=True,
                       env=env, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    alias = json.loads(r.stdout.split("LOSSES")[1])
    bm = blutensor_model_module()  # the same run in this process, imports edited instead
    bt.manual_seed(0)
    model = bm.GPT(bm.GPTConfig(**CFG))
    opt = model.configure_optimizers(0.1, 3e-3, (0.9, 0.95), "cpu")
    losses = []
    from blutensor.utils.data import DataLoader, TensorDataset

    for xb, yb in DataLoader(TensorDataset(bt.tensor(x), bt.tensor(y)), batch_size=4):
        _, loss = model(xb, yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        bt.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    assert alias == losses[:3]


def test_alias_refuses_when_real_torch_is_imported():
    from blutensor import compat

    assert "torch" in sys.modules and not compat.is_torch_alias_installed()
    with pytest.raises(RuntimeError, match="the real PyTorch is already imported"):
        compat.install_torch_alias()


def test_alias_names_what_blutensor_lacks():
    code = ("import sys; from blutensor import compat; compat.install_torch_alias(); import torch.nn.functional as F; "
            "import torch.optim.lr_scheduler as sl; from torch.utils.data import DataLoader; "
            "assert F is sys.modules['blutensor.nn.functional'] and sl.OneCycleLR and DataLoader.__module__ == "
            "'blutensor.utils.data.dataloader'\n"
            "import torch.cuda.amp as ca; from torch.amp import GradScaler; assert ca.GradScaler is GradScaler\n"
            "try:\n    import torch.distributions\nexcept ModuleNotFoundError as e:\n    print('ERR', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ERR No module named 'torch.distributions': blutensor has no 'blutensor.distributions'" in r.stdout
