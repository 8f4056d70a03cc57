"""Eager vs blucompiler-compiled GPT-2 training step on the CPU (C backend): time and launch counts.

    python benchmarks/blucompiler/bench_step.py [--layers 2 --d 128 --T 64 --B 4] [--out results.json]

The GPU measurement (GPT-2 124M at B=4/16, T=1024) is benchmarks/blucompiler/bench_gpt2_cuda.py.
"""

from __future__ import annotations

import argparse
import json
import time

import blucompiler
import blutensor as bt
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--backend", default="c")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from blumodels.config import ModelConfig
    from blumodels.gpt2 import GPT2

    cfg = ModelConfig(n_layer=a.layers, n_head=a.heads, d_model=a.d, block_size=a.T, vocab_size=a.vocab)

    def make():
        bt.manual_seed(0)
        m = GPT2(cfg)
        opt = bt.optim.AdamW(m.param_groups(0.1), lr=3e-4, weight_decay=0.1)

        def step(x, y):
            opt.zero_grad()
            _, loss = m(x, y)
            loss.backward()
            opt.step()
            return loss

        return step

    eager, comp = make(), blucompiler.compile(make(), backend=a.backend)
    rng = np.random.default_rng(0)
    data = [(bt.tensor(rng.integers(0, a.vocab, (a.B, a.T)), dtype=bt.int64),
             bt.tensor(rng.integers(0, a.vocab, (a.B, a.T)), dtype=bt.int64)) for _ in range(4)]
    t = time.perf_counter()
    for i in range(2):
        comp(*data[i])
    first = time.perf_counter() - t

    def timeit(fn):
        ts = []
        for i in range(a.iters):
            t = time.perf_counter()
            fn(*data[i % 4])
            ts.append(time.perf_counter() - t)
        return float(np.median(ts))

    te, tc = timeit(eager), timeit(comp)
    k = comp.report()["kernels"]
    res = {"config": vars(a), "eager_ms": te * 1e3, "compiled_ms": tc * 1e3, "speedup": te / tc,
           "first_two_calls_s": first, "launches_eager": k["eager_primitive_ops"],
           "launches_compiled": k["compiled_launches"], "fused_kernels": k["fused_kernels"]}
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
