"""A tiny GPT-2-like PyTorch model (test reference only) in two naming styles.

``style="hf"``: Hugging Face names with Conv1D (weight stored (in, out)), i.e. what
``gpt2_adapter`` expects; ``style="custom"``: other names and nn.Linear, for a hand-written Adapter.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as tnn
import torch.nn.functional as TF


class Conv1D(tnn.Module):
    def __init__(self, nx, nf):
        super().__init__()
        self.weight = tnn.Parameter(torch.empty(nx, nf))
        self.bias = tnn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return x @ self.weight + self.bias


def _lin(style, i, o, bias=True):
    return Conv1D(i, o) if style == "hf" else tnn.Linear(i, o, bias=bias)


class Attn(tnn.Module):
    def __init__(self, c, style):
        super().__init__()
        self.h = c.n_head
        qkv, proj = ("c_attn", "c_proj") if style == "hf" else ("qkv", "proj")
        setattr(self, qkv, _lin(style, c.n_embd, 3 * c.n_embd))
        setattr(self, proj, _lin(style, c.n_embd, c.n_embd))
        self._n = (qkv, proj)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = getattr(self, self._n[0])(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = TF.scaled_dot_product_attention(q, k, v, is_causal=True)
        return getattr(self, self._n[1])(y.transpose(1, 2).contiguous().view(B, T, C))


class Mlp(tnn.Module):
    def __init__(self, c, style):
        super().__init__()
        fc, proj = ("c_fc", "c_proj") if style == "hf" else ("fc", "proj")
        setattr(self, fc, _lin(style, c.n_embd, 4 * c.n_embd))
        setattr(self, proj, _lin(style, 4 * c.n_embd, c.n_embd))
        self._n = (fc, proj)

    def forward(self, x):
        return getattr(self, self._n[1])(TF.gelu(getattr(self, self._n[0])(x), approximate="tanh"))


class Blk(tnn.Module):
    def __init__(self, c, style):
        super().__init__()
        n = ("ln_1", "attn", "ln_2", "mlp") if style == "hf" else ("norm1", "attention", "norm2", "ffn")
        self._n = n
        setattr(self, n[0], tnn.LayerNorm(c.n_embd))
        setattr(self, n[1], Attn(c, style))
        setattr(self, n[2], tnn.LayerNorm(c.n_embd))
        setattr(self, n[3], Mlp(c, style))

    def forward(self, x):
        g = lambda i: getattr(self, self._n[i])  # noqa: E731
        x = x + g(1)(g(0)(x))
        return x + g(3)(g(2)(x))


class TorchGPT(tnn.Module):
    def __init__(self, c, style="hf"):
        super().__init__()
        self.style = style
        if style == "hf":
            self.transformer = tnn.ModuleDict({
                "wte": tnn.Embedding(c.vocab_size, c.n_embd), "wpe": tnn.Embedding(c.block_size, c.n_embd),
                "h": tnn.ModuleList([Blk(c, style) for _ in range(c.n_layer)]), "ln_f": tnn.LayerNorm(c.n_embd)})
            self.lm_head = tnn.Linear(c.n_embd, c.vocab_size, bias=False)
            self.lm_head.weight = self.transformer.wte.weight
        else:
            self.tok = tnn.Embedding(c.vocab_size, c.n_embd)
            self.pos = tnn.Embedding(c.block_size, c.n_embd)
            self.blocks = tnn.ModuleList([Blk(c, style) for _ in range(c.n_layer)])
            self.norm = tnn.LayerNorm(c.n_embd)
            self.head = tnn.Linear(c.n_embd, c.vocab_size, bias=False)
            self.head.weight = self.tok.weight

    def forward(self, idx):
        T = idx.shape[1]
        if self.style == "hf":
            t = self.transformer
            x = t.wte(idx) + t.wpe(torch.arange(T))
            for b in t.h:
                x = b(x)
            return self.lm_head(t.ln_f(x))
        x = self.tok(idx) + self.pos(torch.arange(T))
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


#: Adapter rules for style="custom" -> our (nanoGPT) names, applied in order
CUSTOM_RULES = [
    (r"^(module|grad):tok", r"\1:transformer.wte"),
    (r"^(module|grad):pos", r"\1:transformer.wpe"),
    (r"^(module|grad):norm\b", r"\1:transformer.ln_f"),
    (r"^(module|grad):head", r"\1:lm_head"),
    (r"^(module|grad):blocks\.", r"\1:transformer.h."),
    (r"\.norm1", ".ln_1"), (r"\.norm2", ".ln_2"), (r"\.attention", ".attn"), (r"\.ffn", ".mlp"),
    (r"attn\.qkv", "attn.c_attn"), (r"attn\.proj", "attn.c_proj"), (r"mlp\.fc", "mlp.c_fc"),
    (r"mlp\.proj", "mlp.c_proj"),
]


def custom_key_map(key: str) -> str:
    import re

    for a, b in CUSTOM_RULES:
        key = re.sub(a, b, key)
    return key


def load_from_ours(tmodel: TorchGPT, ours) -> None:
    """Copy our model's weights into the torch model (transposing Conv1D weights)."""
    sd = {k: np.array(v.numpy()) for k, v in ours.state_dict().items()}
    with torch.no_grad():
        for name, p in tmodel.named_parameters():
            k = ("grad:" + name)
            k = k if tmodel.style == "hf" else custom_key_map(k)
            k = k[len("grad:"):]
            a = sd[k]
            if tmodel.style == "hf" and a.ndim == 2 and any(s in name for s in ("c_attn", "c_proj", "c_fc")):
                a = a.T
            p.copy_(torch.from_numpy(np.ascontiguousarray(a)))
