"""Launch chosen GPT-2 GEMMs once each, for Nsight Compute: our bf16/tf32 TMA kernels per
config, or torch.matmul (cuBLAS) on the same shapes. Each kernel launches exactly once after compilation.

    ncu -k regex:blu_gemm_wgmma python3 packages/blublas/dev/ncu_wgmma.py ours bf16 fwd_fc,dx_fc_proj 128x128x64_pp_s6
    ncu -k regex:'sm90|gemm' python3 packages/blublas/dev/ncu_wgmma.py torch bf16 fwd_fc,dx_fc_proj
"""

from __future__ import annotations

import os
import sys

from blublas.testing import gpt2_gemm_shapes


def main() -> None:
    who, precision, names = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    cfgs = sys.argv[4].split(",") if len(sys.argv) > 4 else []
    shapes = [s for s in gpt2_gemm_shapes() if s[0] in names]
    if who == "torch":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
        dt = torch.bfloat16 if precision == "bf16" else torch.float32
        for name, lay, m, n, k in shapes:
            a = torch.randn((k, m) if lay[0] == "t" else (m, k), device="cuda", dtype=dt)
            b = torch.randn((n, k) if lay[1] == "t" else (k, n), device="cuda", dtype=dt)
            oa = a.t() if lay[0] == "t" else a
            ob = b.t() if lay[1] == "t" else b
            torch.cuda.synchronize()
            torch.matmul(oa, ob)
            torch.cuda.synchronize()
            print(f"torch {precision} {name} {lay} {m}x{n}x{k}", flush=True)
        return
    import cupy as cp
    from blublas import api

    os.environ["BLUBLAS_WGMMA"] = "1"
    for name, lay, m, n, k in shapes:
        ta, tb = lay[0] == "t", lay[1] == "t"
        a = cp.random.standard_normal((k, m) if ta else (m, k), dtype=cp.float32)
        b = cp.random.standard_normal((n, k) if tb else (k, n), dtype=cp.float32)
        dt = cp.float32
        if precision == "bf16":
            a = (a.view(cp.uint32) >> 16).astype(cp.uint16)
            b = (b.view(cp.uint32) >> 16).astype(cp.uint16)
            dt = cp.uint16
        out = cp.empty((m, n), dt)
        for c in cfgs:
            api.gemm(a, b, out, trans_a=ta, trans_b=tb, precision=precision, config=c, splits=1)
            cp.cuda.Device().synchronize()
            print(f"ours {precision} {name} {lay} {m}x{n}x{k} {c}", flush=True)


if __name__ == "__main__":
    main()
