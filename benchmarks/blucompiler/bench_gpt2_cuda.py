"""Eager vs blucompiler-compiled GPT-2 124M training step on a CUDA GPU: median step time, launch counts and the
compiled losses against eager's (same init, same batches).

    python benchmarks/blucompiler/bench_gpt2_cuda.py [--B 4] [--T 1024] [--iters 8] [--cuda-graph] [--out r.json]

One JSON row per run (B, T, eager_ms, compiled_ms, speedup, launches, the report summary); the correctness
of the compiled step itself is the `cuda`-marked tests of packages/blucompiler/tests.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

os.environ.setdefault("BLU_COMPILER_CACHE", tempfile.mkdtemp(prefix="blucompiler-cache-"))

import blucompiler  # noqa: E402
import blutensor as bt  # noqa: E402
from blucompiler.report import format_report  # noqa: E402


def sync() -> None:
    bt.cuda.synchronize()


def model(cfg, seed: int = 0, fused=None):
    from blumodels.gpt2 import GPT2

    bt.manual_seed(seed)
    m = GPT2(cfg, device="cuda")
    opt = bt.optim.AdamW(m.param_groups(0.1), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    return m, opt


def train_step(m, opt):
    def step(x, y):
        opt.zero_grad()
        _, loss = m(x, y)
        loss.backward()
        opt.step()
        return loss

    return step


def batch(rng, B: int, T: int, V: int):
    x = bt.tensor(rng.integers(0, V, (B, T)), dtype=bt.int64, device="cuda")
    y = bt.tensor(rng.integers(0, V, (B, T)), dtype=bt.int64, device="cuda")
    return x, y


def maxdiff(a, b) -> float:
    import cupy

    return float(cupy.abs(a.astype(cupy.float64) - b.astype(cupy.float64)).max())


def bench(cfg, B: int, T: int, iters: int, cuda_graph: bool = False, fused_context: bool = False) -> dict:
    """Eager vs compiled step time (median) on GPT-2 ``cfg``; kernel counts from the compiler report."""
    m_e, o_e = model(cfg)
    m_c, o_c = model(cfg)
    eager, comp = train_step(m_e, o_e), blucompiler.compile(train_step(m_c, o_c), cuda_graph=cuda_graph)
    rng = np.random.default_rng(1)
    data = [batch(rng, B, T, cfg.vocab_size) for _ in range(4)]
    rows, t_first = [], []
    for i in range(5 if cuda_graph else 3):  # graph mode: warm call, then capture
        x, y = data[i % len(data)]
        le = eager(x, y).item()
        t = time.time()
        lc = comp(x, y).item()
        t_first.append(round(time.time() - t, 2))  # trace / interpret+NVRTC / first compiled
        gd = max(maxdiff(pe.grad._data, pc.grad._data) for pe, pc in zip(m_e.parameters(), m_c.parameters()))
        rows.append({"loss_eager": le, "loss_compiled": lc, "loss_diff": abs(le - lc), "grad_maxdiff": gd})

    def timeit(fn):
        ts = []
        for i in range(iters):
            x, y = data[i % len(data)]
            sync()
            t = time.perf_counter()
            fn(x, y)
            sync()
            ts.append(time.perf_counter() - t)
        return float(np.median(ts)), [round(t * 1e3, 2) for t in ts]

    te, te_all = timeit(eager)
    tc, tc_all = timeit(comp)
    extra = {}
    if fused_context:  # context: eager with the multi-tensor AdamW kernel (not the trainer default)
        del m_e, o_e, eager
        m_f, o_f = model(cfg, fused=True)
        tf, _ = timeit(train_step(m_f, o_f))
        extra = {"eager_fused_adamw_ms": round(tf * 1e3, 2), "speedup_vs_eager_fused_adamw": round(tf / tc, 3)}
    rep = comp.report()
    k = rep.get("kernels", {})
    return {
        "B": B, "T": T, "first_calls_s": t_first, "correctness": rows,
        "match": all(r["loss_diff"] <= 1e-4 * max(1.0, abs(r["loss_eager"])) for r in rows),
        "eager_ms": round(te * 1e3, 2), "compiled_ms": round(tc * 1e3, 2), "speedup": round(te / tc, 3),
        "eager_ms_all": te_all, "compiled_ms_all": tc_all,
        "launches_eager": k.get("eager_primitive_ops"), "launches_compiled": k.get("compiled_launches"),
        "fused_kernels": k.get("fused_kernels"), "generated_kernels": k.get("generated_kernels"),
        "library_calls": k.get("library_calls"), "eager_calls": k.get("eager_calls"),
        "fallback_ops": rep.get("fallback_ops"), "passes": rep.get("passes"), "buffer_plan": rep.get("buffer_plan"),
        "summary": format_report(rep), "cuda_graph": rep.get("cuda_graph"), **extra,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--cuda-graph", action="store_true", help="compile with cuda_graph=True")
    ap.add_argument("--fused-context", action="store_true", help="also time eager with the fused AdamW kernel")
    ap.add_argument("--out", default=None, help="write the JSON row here (else print it)")
    a = ap.parse_args()
    if not bt.cuda.is_available():
        raise SystemExit("bench_gpt2_cuda.py needs CuPy and a CUDA GPU")
    from blumodels.config import ModelConfig

    cfg = ModelConfig(n_layer=a.layers, n_head=12, d_model=768, block_size=a.T, vocab_size=50257)
    row = {"command": "python benchmarks/blucompiler/bench_gpt2_cuda.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else f"--{k.replace('_', '-')}"
        for k, v in vars(a).items() if v not in (None, False)),
        "device": bt.cuda.get_device_name(), **bench(cfg, a.B, a.T, a.iters, a.cuda_graph, a.fused_context)}
    text = json.dumps(row, indent=1, default=str)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
