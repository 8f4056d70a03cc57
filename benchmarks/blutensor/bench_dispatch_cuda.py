"""Per-op time of small CUDA ops (8x8 float32: dispatch + launch bound), blutensor vs PyTorch on the same GPU.

    python benchmarks/blutensor/bench_dispatch_cuda.py [--json out.json]

Best of 5 rounds of 500 calls each, the libraries alternating so that load hits both alike (the CPU companion
is bench_dispatch.py).
"""

from __future__ import annotations

import json
import math
import sys
import timeit

import blutensor as bt
import numpy as np


def measure(number: int = 500, rounds: int = 5) -> dict:
    import torch

    x = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    a, b = bt.tensor(x, device="cuda"), bt.tensor(x + 1, device="cuda")
    ta, tb = torch.tensor(x, device="cuda"), torch.tensor(x + 1, device="cuda")
    ops = {"add": (lambda: a + b, lambda: ta + tb), "exp": (lambda: a.exp(), lambda: ta.exp()),
           "matmul": (lambda: a @ b, lambda: ta @ tb), "sum_dim": (lambda: a.sum(dim=1), lambda: ta.sum(dim=1)),
           "softmax": (lambda: bt.softmax(a, -1), lambda: torch.softmax(ta, -1)),
           "view": (lambda: a.view(64), lambda: ta.view(64))}
    out = {}
    for name, (fb, ft) in ops.items():
        fb(), ft()
        bt.cuda.synchronize()
        t_bt = t_torch = float("inf")
        for _ in range(rounds):
            t_bt = min(t_bt, timeit.timeit(fb, number=number) / number * 1e6)
            bt.cuda.synchronize()
            t_torch = min(t_torch, timeit.timeit(ft, number=number) / number * 1e6)
            torch.cuda.synchronize()
        out[name] = {"blutensor_us": round(t_bt, 2), "torch_us": round(t_torch, 2), "ratio": round(t_bt / t_torch, 2)}
    return out


if __name__ == "__main__":
    if not bt.cuda.is_available():
        raise SystemExit("bench_dispatch_cuda.py needs CuPy and a CUDA GPU (and PyTorch with CUDA)")
    res = measure()
    geo = math.exp(sum(math.log(v["ratio"]) for v in res.values()) / len(res))
    for op, v in res.items():
        print(f"{op:8s} blutensor {v['blutensor_us']:8.2f} us  torch {v['torch_us']:8.2f} us  ratio {v['ratio']:.2f}")
    print(f"geometric-mean ratio blutensor/torch: {geo:.2f} ({bt.cuda.get_device_name()})")
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as fh:
            json.dump({"command": "python benchmarks/blutensor/bench_dispatch_cuda.py", "ops": res,
                       "geomean_ratio": geo, "gpu": bt.cuda.get_device_name()}, fh, indent=1)
