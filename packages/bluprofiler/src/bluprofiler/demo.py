"""Demo workloads built from blutensor.nn only: a GPT-2-shaped model and its training step.

Used by ``bluprofile --demo``, the tests and ``benchmarks/bluprofiler/profile_gpt2.py`` (GPT-2 124M: 12 layers, d=768).
Names follow nanoGPT/Hugging Face (``transformer.h.<i>.attn.c_attn`` ...), so
:func:`bluprofiler.compare.gpt2_adapter` applies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import blutensor as bt
import blutensor.nn as nn
import blutensor.nn.functional as F

from bluprofiler.profiler import record_function


@dataclass
class GPTConfig:
    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    batch_size: int = 4
    lr: float = 3e-4


PRESETS = {
    "gpt2-124m": GPTConfig(),
    "tiny": GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32, batch_size=2),
    "small": GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=128, batch_size=4),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig, device=None, dtype=None):
        super().__init__()
        self.n_head, self.n_embd = c.n_head, c.n_embd
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, device=device, dtype=dtype)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, device=device, dtype=dtype)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        hd = C // self.n_head
        q, k, v = (t.view(B, T, self.n_head, hd).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, c: GPTConfig, device=None, dtype=None):
        super().__init__()
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd, device=device, dtype=dtype)
        self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd, device=device, dtype=dtype)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, c: GPTConfig, device=None, dtype=None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd, device=device, dtype=dtype)
        self.attn = CausalSelfAttention(c, device, dtype)
        self.ln_2 = nn.LayerNorm(c.n_embd, device=device, dtype=dtype)
        self.mlp = MLP(c, device, dtype)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 with tied input/output embeddings; ``forward(idx)`` returns logits (B, T, V)."""

    def __init__(self, c: GPTConfig, device=None, dtype=None):
        super().__init__()
        self.config = c
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(c.vocab_size, c.n_embd, device=device, dtype=dtype),
            "wpe": nn.Embedding(c.block_size, c.n_embd, device=device, dtype=dtype),
            "h": nn.ModuleList([Block(c, device, dtype) for _ in range(c.n_layer)]),
            "ln_f": nn.LayerNorm(c.n_embd, device=device, dtype=dtype),
        })
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False, device=device, dtype=dtype)
        self.lm_head.weight = self.transformer.wte.weight
        for n, p in self.named_parameters():
            if n.endswith("weight") and p.ndim == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx):
        B, T = idx.shape
        pos = bt.arange(T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def make_gpt_step(config: GPTConfig | str = "tiny", device: str = "cpu", seed: int = 0,
                  dtype=None) -> tuple[Callable[[], float], Any]:
    """(step_fn, model): one AdamW training step on a fixed random batch; step_fn returns the loss
    as a Python float (which synchronises)."""
    c = PRESETS[config] if isinstance(config, str) else config
    bt.manual_seed(seed)
    model = GPT(c, device=device, dtype=dtype)
    opt = bt.optim.AdamW(model.parameters(), lr=c.lr, weight_decay=0.1)
    idx = bt.randint(0, c.vocab_size, (c.batch_size, c.block_size + 1), device=device)
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

    def step() -> float:
        with record_function("forward"):
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, c.vocab_size), y.view(-1))
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()
            model.zero_grad()
        return loss.item()

    return step, model
