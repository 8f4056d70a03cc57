"""A 2-layer transformer language model in blutensor and the same model in PyTorch, from identical
weights and batches: per-step losses agree within 1e-5 relative for 20 AdamW steps (float32)."""

from __future__ import annotations

import math

import blutensor as bt
import blutensor.nn as nn
import blutensor.nn.functional as F
import numpy as np
import pytest
import torch

CFG = dict(vocab=64, d=32, heads=4, layers=2, seq=16, batch=4, steps=20, lr=1e-2, warmup=3, wd=0.1, clip=1.0)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.act = nn.GELU("tanh")

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.out(self.act(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied embeddings, as in GPT-2

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(bt.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class TBlock(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.act = torch.nn.GELU("tanh")

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.out(self.act(self.fc(self.ln2(x))))


class TTinyLM(torch.nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, d), torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList([TBlock(d, heads) for _ in range(layers)])
        self.ln_f = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def run_pair(device: str = "cpu", cfg: dict = CFG) -> tuple[list[float], list[float]]:
    """Train both models side by side; returns (blutensor losses, torch losses)."""
    bt.manual_seed(1234)
    model = TinyLM(cfg["vocab"], cfg["d"], cfg["heads"], cfg["layers"], cfg["seq"])
    with bt.no_grad():  # GPT-2-like init so that the loss moves
        for n, p in model.named_parameters():
            if n.endswith("weight") and p.ndim == 2:
                bt.nn.init.normal_(p, 0.0, 0.02)
    ref = TTinyLM(cfg["vocab"], cfg["d"], cfg["heads"], cfg["layers"], cfg["seq"])
    ref.load_state_dict({k: torch.tensor(v.numpy().copy()) for k, v in model.state_dict().items()})
    model.to(device)
    params = list(model.parameters())
    decay = [p for p in params if p.ndim >= 2]
    nodecay = [p for p in params if p.ndim < 2]
    opt = bt.optim.AdamW([{"params": decay, "weight_decay": cfg["wd"]}, {"params": nodecay, "weight_decay": 0.0}],
                         lr=cfg["lr"], betas=(0.9, 0.95), eps=1e-8)
    tparams = dict(ref.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    tdecay = [tparams[n] for n, p in zip(names, params) if p.ndim >= 2]
    tnodecay = [tparams[n] for n, p in zip(names, params) if p.ndim < 2]
    topt = torch.optim.AdamW([{"params": tdecay, "weight_decay": cfg["wd"]},
                              {"params": tnodecay, "weight_decay": 0.0}], lr=cfg["lr"], betas=(0.9, 0.95),
                             eps=1e-8, foreach=False)
    sched = bt.optim.lr_scheduler.WarmupCosineLR(opt, cfg["warmup"], cfg["steps"], min_lr=cfg["lr"] * 0.1)
    # learnable batches: each row counts up by a random stride from a random start (mod vocab)
    r = np.random.default_rng(0)
    start = r.integers(0, cfg["vocab"], (cfg["steps"], cfg["batch"], 1))
    stride = r.integers(1, 4, (cfg["steps"], cfg["batch"], 1))
    data = (start + stride * np.arange(cfg["seq"] + 1)) % cfg["vocab"]
    ours, theirs = [], []
    for s in range(cfg["steps"]):
        x, y = data[s, :, :-1], data[s, :, 1:]
        loss = model(bt.tensor(x, device=device), bt.tensor(y, device=device))
        opt.zero_grad()
        loss.backward()
        bt.optim.clip_grad_norm_(model.parameters(), cfg["clip"])
        for g in topt.param_groups:
            g["lr"] = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        tloss = ref(torch.tensor(x), torch.tensor(y))
        topt.zero_grad()
        tloss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg["clip"])
        topt.step()
        ours.append(loss.item())
        theirs.append(tloss.item())
    return ours, theirs


@pytest.fixture(autouse=True)
def _torch_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_transformer_losses_match_torch(device):
    ours, theirs = run_pair(device)
    assert len(ours) == CFG["steps"] and all(math.isfinite(v) for v in ours)
    assert theirs[-1] < theirs[0] - 0.05, "the reference model must actually learn over 20 steps"
    rel = [abs(a - b) / abs(b) for a, b in zip(ours, theirs)]
    assert max(rel) < 1e-5, f"per-step relative loss differences {rel}"


@pytest.mark.cuda
@pytest.mark.skipif(not bt.cuda.is_available(), reason="needs CuPy and a CUDA GPU")
def test_transformer_losses_match_torch_with_every_available_gemm_provider():
    """Whatever registered GEMM provider runs the CUDA matmuls (chosen by availability, not by name), the
    20-step losses stay within 1e-5 of PyTorch's (tells a provider's fault from blutensor's)."""
    from blutensor import ext

    provs = [p for p in ext.gemm_providers() if getattr(p, "is_available", lambda: True)()]
    try:
        for p in provs:
            bt.set_gemm_provider(p.PLUGIN_NAME)
            ours, theirs = run_pair("cuda")
            rel = [abs(a - b) / abs(b) for a, b in zip(ours, theirs)]
            assert max(rel) < 1e-5, (p.PLUGIN_NAME, rel)
    finally:
        bt.set_gemm_provider(None)
