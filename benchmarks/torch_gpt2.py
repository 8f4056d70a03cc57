"""The same GPT-2 in PyTorch (the benchmark and test reference only; never imported by src/ code).

Architecture identical to blumodels.gpt2: pre-LN blocks, fused QKV, causal SDPA, tanh-GELU MLP,
tied embeddings, vocabulary padded to a multiple of 64; weights are copied from a BluTrain model.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, h, eps):
        super().__init__()
        self.h = h  # heads computed here (tensor parallelism lowers it to h / tp)
        self.hd = d // h
        self.ln_1 = nn.LayerNorm(d, eps=eps)
        self.c_attn = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d, eps=eps)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).view(B, T, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, self.h * self.hd)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class TorchGPT2(nn.Module):
    def __init__(self, vocab_padded, block_size, d, n_layer, n_head, eps=1e-5):
        super().__init__()
        self.wte = nn.Embedding(vocab_padded, d)
        self.wpe = nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList([Block(d, n_head, eps) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d, eps=eps)

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(B * T, -1).float(), targets.view(B * T))


_RENAME = {"attn.c_attn": "c_attn", "attn.c_proj": "attn_proj", "mlp.c_fc": "c_fc", "mlp.c_proj": "mlp_proj"}


def from_blutrain(bt_model, device="cuda") -> TorchGPT2:
    """A TorchGPT2 holding exactly the BluTrain model's weights."""
    c = bt_model.config
    m = TorchGPT2(c.padded_vocab_size, c.block_size, c.d_model, c.n_layer, c.n_head, c.ln_eps)
    sd = {}
    for name, t in bt_model.state_dict().items():
        for a, b in _RENAME.items():
            name = name.replace(a, b)
        sd[name] = torch.from_numpy(t.numpy().copy())
    m.load_state_dict(sd, strict=True)
    return m.to(device)


def train_torch(model: TorchGPT2, batches, lr: float, compile: bool = False, precision: str = "fp32",
                accum: int = 1) -> dict:
    """The reference training loop (BluTrain's default AdamW recipe, clip 1.0; ``accum`` micro-batches per step,
    each loss scaled by 1/accum, as nanoGPT does), timed per step with CUDA syncs; returns per-step losses (the
    mean over the micro-steps) and times and PyTorch's peak memory."""
    import time

    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    step_model = torch.compile(model) if compile else model
    losses, times = [], []
    torch.cuda.reset_peak_memory_stats()
    it = iter(batches)
    while True:
        micro = [b for _, b in zip(range(accum), it)]
        if len(micro) < accum:
            break
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        total = torch.zeros((), device="cuda")
        for x, y in micro:
            xi, yi = torch.from_numpy(x).cuda(non_blocking=True), torch.from_numpy(y).cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = step_model(xi, yi)
            (loss / accum if accum > 1 else loss).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(total.item()) / accum)
    return {"losses": losses, "step_s": times, "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30, "torch": torch.__version__}
