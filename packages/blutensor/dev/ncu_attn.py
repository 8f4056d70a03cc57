"""Launch one GPT-2 attention layer (B=4, H=12, T=1024, HD=64, causal, fused-qkv entries) once per kernel, for
Nsight Compute: ours (variant tf32x3 by default: forward, backward preprocess, fused backward) or PyTorch's fp32
SDPA (mem-efficient cutlass kernels).

    ncu -k regex:blu_sdpa python3 packages/blutensor/dev/ncu_attn.py ours [variant]
    ncu -k regex:fmha python3 packages/blutensor/dev/ncu_attn.py torch
"""

from __future__ import annotations

import sys

import numpy as np

B, H, T, HD = 4, 12, 1024, 64


def main() -> None:
    who = sys.argv[1]
    rng = np.random.default_rng(0)
    qkv_h = rng.standard_normal((B, T, 3, H, HD), dtype=np.float32)
    do_h = rng.standard_normal((B, T, H, HD), dtype=np.float32)
    if who == "torch":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        qkv = torch.tensor(qkv_h, device="cuda", requires_grad=True)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        y.backward(torch.tensor(do_h, device="cuda").transpose(1, 2))
        torch.cuda.synchronize()
        return
    import cupy as cp
    from blutensor.backends.cupy.sdpa import qkv_attention_backward, qkv_attention_forward

    variant = sys.argv[2] if len(sys.argv) > 2 else "tf32x3"
    qkv, do = cp.asarray(qkv_h), cp.asarray(do_h)
    o, lse = qkv_attention_forward(qkv, True, None, variant)
    qkv_attention_backward(qkv, o, lse, do, True, None, variant)
    cp.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
