"""GPT-2 and the Trainer on a CUDA GPU against the CPU: forward/backward on the same weights, the fused AdamW the
Trainer uses on CUDA against the eager one, bit-exact resume, top-k sampling (each a `cuda` twin of a CPU test:
test_gpt2.py, test_trainer.py, test_generate.py)."""

from __future__ import annotations

import json

import blutensor as bt
import numpy as np
import pytest
from blumodels.config import ModelConfig, from_dict
from blumodels.gpt2 import build_model
from models_helpers import micro_data

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not bt.cuda.is_available(), reason="needs CuPy and a GPU")]
CFG = dict(n_layer=2, n_head=4, d_model=128, block_size=64, vocab_size=1000)


@pytest.fixture(autouse=True)
def strict_fp32():
    prev = bt.get_matmul_precision()
    bt.set_matmul_precision("fp32")
    yield
    bt.set_matmul_precision(prev)


def _batch(seed: int, device: str):
    rng = np.random.default_rng(seed)
    idx, tgt = rng.integers(0, 1000, (4, 64)), rng.integers(0, 1000, (4, 64))
    return bt.tensor(idx, dtype=bt.int64, device=device), bt.tensor(tgt, dtype=bt.int64, device=device)


def test_forward_backward_on_cuda_equals_cpu_on_the_same_weights():
    cfg = ModelConfig(**CFG)
    res = {}
    for dev in ("cpu", "cuda"):
        m = build_model(cfg, seed=5).to(dev)
        _, loss = m(*_batch(0, dev))
        loss.backward()
        res[dev] = float(loss.item()), {n: p.grad.to("cpu").numpy().astype(np.float64) for n, p in m.named_parameters()}
    assert abs(res["cpu"][0] - res["cuda"][0]) < 1e-4
    for n, g in res["cpu"][1].items():
        assert np.abs(g - res["cuda"][1][n]).max() <= 1e-3 * (np.abs(g).max() + 1e-12), n


def test_fused_adamw_follows_the_eager_adamw_on_cuda():
    cfg = ModelConfig(**CFG)
    res = {}
    for fused in (False, True):
        m = build_model(cfg, seed=2).to("cuda")
        opt = bt.optim.AdamW(m.param_groups(0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                             fused=fused)
        losses = []
        for _ in range(5):
            _, loss = m(*_batch(1, "cuda"))
            loss.backward()
            bt.optim.clip_grad_norm_(list(m.parameters()), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.item()))
        res[fused] = losses, {n: p.to("cpu").numpy() for n, p in m.named_parameters()}
    assert max(abs(a - b) for a, b in zip(res[True][0], res[False][0])) < 1e-5
    assert max(float(np.abs(res[True][1][n] - res[False][1][n]).max()) for n in res[True][1]) < 1e-5


def test_resume_on_cuda_is_bit_exact(tmp_path):
    from blumodels.trainer import Trainer

    cfg = from_dict({"model": {"n_layer": 2, "n_head": 4, "d_model": 128, "block_size": 128, "dropout": 0.1},
                     "train": {"steps": 8, "batch_tokens": 2048, "micro_batch": 8, "seq_len": 128, "device": "cuda",
                               "warmup_steps": 2, "eval_interval": 4, "eval_steps": 2, "checkpoint_interval": 0,
                               "plot": False, "precision": "fp32", "lr": 1e-3, "deterministic": True},
                     "data": {"dir": str(micro_data())}})
    ref = Trainer(cfg, tmp_path / "ref", quiet=True)
    ref.fit()
    ref.close()
    a = Trainer(cfg, tmp_path / "split", quiet=True)
    a.fit(steps=3)
    a.close()
    b = Trainer(cfg, tmp_path / "split", resume=True, quiet=True)
    b.fit()
    b.close()

    def losses(d):
        return [r["loss"] for r in map(json.loads, (d / "log.jsonl").read_text().splitlines()) if "loss" in r]

    assert losses(tmp_path / "ref") == losses(tmp_path / "split")
    pa = {n: p.to("cpu").numpy() for n, p in ref.model.named_parameters()}
    for n, p in b.model.named_parameters():
        np.testing.assert_array_equal(pa[n], p.to("cpu").numpy(), err_msg=n)


def test_top_k_sampling_on_cuda_is_in_range_and_repeatable():
    from blumodels.sampling import generate

    cfg = ModelConfig(n_layer=2, n_head=4, d_model=64, block_size=32, vocab_size=100)
    m = build_model(cfg, device="cuda", seed=1)
    a = generate(m, [1, 2, 3], 20, top_k=5, seed=3)
    assert len(a) == 23 and a[:3] == [1, 2, 3] and all(0 <= t < 100 for t in a)
    assert generate(m, [1, 2, 3], 20, top_k=5, seed=3) == a
