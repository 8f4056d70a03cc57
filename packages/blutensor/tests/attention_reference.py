"""float64 NumPy references of the flash-attention kernels' tests: bf16 rounding and softmax attention with its
log-sum-exp and gradients (shared by test_sdpa_wgmma.py and test_sdpa_wgmma_vs_mma.py)."""

from __future__ import annotations

import numpy as np


def bf16_round(x):
    """float -> (bf16 bits as uint16, the float64 values they hold), round to nearest even."""
    u = np.asarray(x, np.float32).view(np.uint32)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return u, (u.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def bf16_to_f64(bits):
    """bf16 bits (uint16) -> the float64 values they hold."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def sdpa_reference(q, k, v, do, causal, sc) -> dict:
    """float64 {o, lse, dq, dk, dv} of softmax(q k^T sc [causal: key j <= query i]) v, q (BH, L, D)."""
    s = q @ k.transpose(0, 2, 1) * sc
    if causal:
        s = np.where(np.triu(np.ones(s.shape[1:], bool), 1), -np.inf, s)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    lse = (np.log(e.sum(-1, keepdims=True)) + m)[..., 0]
    p = e / e.sum(-1, keepdims=True)
    o = p @ v
    dp = do @ v.transpose(0, 2, 1)
    ds = p * (dp - (do * o).sum(-1, keepdims=True))
    return {"o": o, "lse": lse, "dq": ds @ k * sc, "dk": ds.transpose(0, 2, 1) @ q * sc,
            "dv": p.transpose(0, 2, 1) @ do}
