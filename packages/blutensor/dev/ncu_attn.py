"""Launch one GPT-2 attention layer (B=4 by default, H=12, T=1024, HD=64, causal, fused-qkv entries) once per
kernel, for Nsight Compute: ours (forward, backward preprocess, backward; variant tf32x3 by default, bf16_wgmma the
Hopper bf16 kernels) or PyTorch's SDPA (fp32: the mem-efficient cutlass kernels; bf16: its choice, or a pinned
backend).

    ncu -k regex:blu_sdpa python3 packages/blutensor/dev/ncu_attn.py ours [--variant bf16_wgmma] [--batch 16]
        [--seq 16384]
    ncu -k regex:'fmha|cudnn|flash' python3 packages/blutensor/dev/ncu_attn.py torch [--dtype bf16]
        [--backend CUDNN_ATTENTION|FLASH_ATTENTION] [--batch 16]
"""

from __future__ import annotations

import argparse
import contextlib

import numpy as np

H, SEQ, HD = 12, 1024, 64


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("who", choices=("ours", "torch"))
    p.add_argument("--variant", default="tf32x3", help="ours: the kernel variant (tf32x3, tf32, bf16, bf16_wgmma...)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="torch: the tensors' dtype")
    p.add_argument("--backend", default=None, help="torch: a torch.nn.attention.SDPBackend member to pin")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=SEQ, help="sequence length (T=16384: the long-context shape)")
    a = p.parse_args()
    B, T = a.batch, a.seq
    rng = np.random.default_rng(0)
    qkv_h = rng.standard_normal((B, T, 3, H, HD), dtype=np.float32)
    do_h = rng.standard_normal((B, T, H, HD), dtype=np.float32)
    if a.who == "torch":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
        qkv = torch.tensor(qkv_h, device="cuda").to(dt).requires_grad_(True)
        pinned = contextlib.nullcontext()
        if a.backend:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            pinned = sdpa_kernel(getattr(SDPBackend, a.backend))
        with pinned:
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            y.backward(torch.tensor(do_h, device="cuda").to(dt).transpose(1, 2))
        torch.cuda.synchronize()
        return
    import cupy as cp
    from blutensor.backends import f32_to_bf16_bits
    from blutensor.backends.cupy.sdpa import qkv_attention_backward, qkv_attention_forward

    qkv, do = cp.asarray(qkv_h), cp.asarray(do_h)
    if a.variant.startswith("bf16"):
        qkv, do = f32_to_bf16_bits(qkv, cp), f32_to_bf16_bits(do, cp)
    o, lse = qkv_attention_forward(qkv, True, None, a.variant)
    qkv_attention_backward(qkv, o, lse, do, True, None, a.variant)
    cp.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
