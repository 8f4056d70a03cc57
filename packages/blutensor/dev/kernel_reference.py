"""NumPy float64 references of the CUDA kernels (used by tests/test_cuda_kernels.py, tests/kernel_checks.py
and benchmarks) plus the tolerances each kernel is held to.

Error metric everywhere: max |out - ref| / max(max |ref|, 1e-30)  ("relative to the largest value").
bf16 results are compared against the float64 reference computed FROM the bf16-rounded inputs, so the
tolerance covers fp32 math plus the final rounding to bf16 (2^-8 relative), not input quantisation.
"""

from __future__ import annotations

import math

import numpy as np

#: kernel -> {storage/variant: tolerance}
TOL = {
    "layer_norm.fwd": {"f32": 2e-6, "bf16": 8e-3},
    "layer_norm.bwd": {"f32": 2e-5, "bf16": 1.6e-2},
    "gelu.fwd": {"f32": 2e-6, "bf16": 8e-3},
    "gelu.bwd": {"f32": 5e-6, "bf16": 8e-3},
    "cross_entropy.loss": {"f32": 1e-5, "bf16": 8e-3},
    "cross_entropy.grad": {"f32": 2e-5, "bf16": 8e-3},
    "embedding.fwd": {"f32": 0.0, "bf16": 0.0},
    "embedding.bwd": {"f32": 1e-5, "bf16": 8e-3},  # fp32 sums of runs up to ~1000 rows: n * 2^-24
    # f32: rel. error of the update p - p0; bf16: ulps of max(|p|, |p0|, 3 lr) (a wrong update is >= 13)
    "adamw": {"f32": 1e-4, "bf16": 4.0},
    "grad_norm": {"f32": 1e-5, "bf16": 1e-5},
    "sdpa.fwd": {"f32": 1e-5, "tf32": 4e-3, "bf16": 2e-2},
    "sdpa.bwd": {"f32": 5e-5, "tf32": 1e-2, "bf16": 4e-2},
}


def rel_err(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"shape {out.shape} != reference shape {ref.shape}")
    if ref.size == 0:
        return 0.0
    scale = max(float(np.max(np.abs(ref))), 1e-30)
    if not np.all(np.isfinite(out)):
        return math.inf
    return float(np.max(np.abs(out - ref))) / scale


# ---- bf16 bits <-> float (round to nearest even), NumPy ----
def bf16_round(x):
    """float64/32 -> float64 values exactly representable in bf16 (RNE)."""
    return bf16_bits_to_f64(f32_to_bf16_bits(np.asarray(x, dtype=np.float32)))


def f32_to_bf16_bits(x):
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), r)


def bf16_bits_to_f64(b):
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# ---- layer norm ----
def layer_norm(x, w, b, eps=1e-5, resid=None):
    """(y, mean, rstd, s) over the last axis; s = x + resid (or x)."""
    s = x if resid is None else x + resid
    mu = s.mean(-1, keepdims=True)
    var = ((s - mu) ** 2).mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    y = (s - mu) * rstd
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y, mu[..., 0], rstd[..., 0], s


def layer_norm_backward(g, s, w, eps=1e-5):
    """(dx, dw, db) of LayerNorm at input s (2-D)."""
    mu = s.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((s - mu) ** 2).mean(-1, keepdims=True) + eps)
    xh = (s - mu) * rstd
    gw = g * (w if w is not None else 1.0)
    dx = rstd * (gw - gw.mean(-1, keepdims=True) - xh * (gw * xh).mean(-1, keepdims=True))
    return dx, (g * xh).sum(0), g.sum(0)


# ---- gelu ----
def _erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def gelu(x, approximate="tanh"):
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + _erf(x / math.sqrt(2)))


def gelu_backward(g, x, approximate="tanh"):
    if approximate == "tanh":
        c = math.sqrt(2 / math.pi)
        t = np.tanh(c * (x + 0.044715 * x**3))
        d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)
    else:
        d = 0.5 * (1 + _erf(x / math.sqrt(2))) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return g * d


# ---- cross entropy ----
def cross_entropy(z, t, ignore_index=-100, reduction="mean", ls=0.0):
    """(loss, grad for an upstream grad of 1, lse) of logits z (N, C) and targets t (N,)."""
    N, C = z.shape
    m = z.max(1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(1))
    valid = t != ignore_index
    tt = np.where(valid, t, 0)
    loss = lse - z[np.arange(N), tt]
    if ls:
        loss = (1 - ls) * loss + ls * (lse - z.mean(1))
    loss = np.where(valid, loss, 0.0)
    count = int(valid.sum())
    p = np.exp(z - lse[:, None]) - ls / C
    p[np.arange(N), tt] -= 1 - ls
    p *= valid[:, None]
    if reduction == "mean":
        return loss.sum() / count if count else np.nan, p / max(count, 1), lse
    if reduction == "sum":
        return loss.sum(), p, lse
    return loss, p, lse


# ---- embedding ----
def embedding_backward(idx, g, V):
    dw = np.zeros((V, g.shape[1]))
    np.add.at(dw, idx, g)
    return dw


# ---- AdamW (PyTorch order) ----
def adamw(p, g, m, v, step, lr, b1, b2, eps, wd):
    p = p * (1 - lr * wd)
    m = m + (1 - b1) * (g - m)
    v = v * b2 + (1 - b2) * g * g
    bc1 = 1 - b1**step
    bc2 = math.sqrt(1 - b2**step)
    p = p - (lr / bc1) * m / (np.sqrt(v) / bc2 + eps)
    return p, m, v


def grad_norm(grads):
    return math.sqrt(sum(float((np.asarray(g, np.float64) ** 2).sum()) for g in grads))


# ---- attention ----
def sdpa(q, k, v, causal=False, scale=None):
    """(out, lse) of softmax(q k^T * scale) v over (..., L, E); causal = tril(ones(L, S))."""
    sc = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = q @ np.swapaxes(k, -1, -2) * sc
    if causal:
        L, S = s.shape[-2:]
        s = np.where(np.tril(np.ones((L, S), dtype=bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    lse = m[..., 0] + np.log(e.sum(-1))
    p = e / e.sum(-1, keepdims=True)
    return p @ v, lse


def sdpa_backward(q, k, v, do, causal=False, scale=None):
    sc = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = q @ np.swapaxes(k, -1, -2) * sc
    if causal:
        L, S = s.shape[-2:]
        s = np.where(np.tril(np.ones((L, S), dtype=bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dv = np.swapaxes(p, -1, -2) @ do
    dp = do @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * sc
    return ds @ k, np.swapaxes(ds, -1, -2) @ q, dv


def gpt2_param_shapes(layers: int = 12, d: int = 768, vocab: int = 50304, ctx: int = 1024) -> list[tuple[int, ...]]:
    """Parameter shapes of GPT-2 (124M by default) in model order: wte, wpe, per block ln_1, c_attn, attn c_proj,
    ln_2, c_fc, mlp c_proj (weights and biases), then ln_f: the tensor list the multi-tensor kernels run over."""
    block = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return [(vocab, d), (ctx, d)] + block * layers + [(d,), (d,)]
