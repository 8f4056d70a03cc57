"""blucompiler GPU check: compiled == eager on CUDA, and compiled vs eager speed for GPT-2 124M.

Run from the repo root on the GPU machine:
    python3 packages/blucompiler/dev/gpu_check.py OUTDIR
Writes OUTDIR/blucompiler_gpu.json (and benchmarks/results/blucompiler_h200.json when writable).
Sections fail independently: an error is recorded in the JSON and the next section runs.
Runs in about 2-3 minutes (two traces + NVRTC compiles of GPT-2 124M, ~10 timed steps per size).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

os.environ.setdefault("BLU_COMPILER_CACHE", tempfile.mkdtemp(prefix="blucompiler-gpu-cache-"))

import blucompiler  # noqa: E402
import blutensor as bt  # noqa: E402
from blucompiler.report import format_report  # noqa: E402

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "out")
OUT.mkdir(parents=True, exist_ok=True)
RESULTS: dict = {"device": None, "sections": {}}
T0 = time.time()


def sync():
    import cupy

    cupy.cuda.Device().synchronize()


def model(cfg, seed=0, fused=None):
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


def batch(rng, B, T, V):
    x = bt.tensor(rng.integers(0, V, (B, T)), dtype=bt.int64, device="cuda")
    y = bt.tensor(rng.integers(0, V, (B, T)), dtype=bt.int64, device="cuda")
    return x, y


def maxdiff(a, b) -> float:
    import cupy

    return float(cupy.abs(a.astype(cupy.float64) - b.astype(cupy.float64)).max())


def section(name):
    def deco(fn):
        t = time.time()
        try:
            RESULTS["sections"][name] = {"ok": True, **fn()}
        except Exception as e:  # noqa: BLE001 - record and go on
            RESULTS["sections"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                         "traceback": traceback.format_exc()[-3000:]}
        RESULTS["sections"][name]["seconds"] = round(time.time() - t, 2)
        print(f"[{name}] {json.dumps({k: v for k, v in RESULTS['sections'][name].items() if k != 'traceback'})[:900]}",
              flush=True)
        return fn

    return deco


def compare_steps(cfg, B, T, steps, tol, backend="auto"):
    """Same init, same batches: eager vs compiled losses and gradients for ``steps`` steps."""
    m_e, o_e = model(cfg)
    m_c, o_c = model(cfg)
    eager, comp = train_step(m_e, o_e), blucompiler.compile(train_step(m_c, o_c), backend=backend)
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(steps):
        x, y = batch(rng, B, T, cfg.vocab_size)
        le, lc = eager(x, y).item(), comp(x, y).item()
        gd = max(maxdiff(pe.grad._data, pc.grad._data) for pe, pc in zip(m_e.parameters(), m_c.parameters()))
        gs = max(float(abs(pe.grad._data).max()) for pe in m_e.parameters())
        rows.append({"loss_eager": le, "loss_compiled": lc, "loss_diff": abs(le - lc), "grad_maxdiff": gd,
                     "grad_maxabs": gs})
    ok = all(r["loss_diff"] <= tol * max(1.0, abs(r["loss_eager"]))
             and r["grad_maxdiff"] <= tol * max(1.0, r["grad_maxabs"]) for r in rows)
    return ok, rows, comp


@section("env")
def _env():
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    RESULTS["device"] = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return {"cupy": cupy.__version__, "cc": cupy.cuda.Device().compute_capability, "device": RESULTS["device"],
            "matmul_precision": __import__("blutensor.gemm", fromlist=["x"]).get_matmul_precision()}


@section("tiny_gpt2_correctness")
def _tiny():
    from blumodels.config import ModelConfig

    cfg = ModelConfig(n_layer=2, n_head=2, d_model=64, block_size=32, vocab_size=128)
    out = {}
    # "numpy" interprets every kernel with CuPy (tracing + runtime only); "auto" runs the NVRTC kernels
    for backend in ("numpy", "auto"):
        ok, rows, comp = compare_steps(cfg, 4, 32, 4, 1e-5, backend)
        rep = comp.report()
        out[backend] = {"match": ok, "steps": rows,
                        "report": {k: rep.get(k) for k in ("backend", "kernels", "fallback_ops", "eager_steps")}}
    out["match"] = all(v["match"] for v in out.values() if isinstance(v, dict))
    return out


def bench(cfg, B, T, iters, cuda_graph=False):
    """Eager vs compiled step time (median) on GPT-2 ``cfg``; kernel counts from the compiler report."""
    m_e, o_e = model(cfg)
    m_c, o_c = model(cfg)
    eager, comp = train_step(m_e, o_e), blucompiler.compile(train_step(m_c, o_c), cuda_graph=cuda_graph)
    rng = np.random.default_rng(1)
    data = [batch(rng, B, T, cfg.vocab_size) for _ in range(4)]
    # correctness on the first 3 steps (same init, same batches)
    rows = []
    t_first = []
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
    if B == 4 and not cuda_graph:  # context: eager with the multi-tensor AdamW kernel (not the trainer default)
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


def _cfg124():
    from blumodels.config import ModelConfig

    return ModelConfig(n_layer=12, n_head=12, d_model=768, block_size=1024, vocab_size=50257)


@section("gpt2_124m_B4_T1024")
def _b4():
    r = bench(_cfg124(), 4, 1024, 8)
    r["target_speedup"] = 1.10
    r["meets_target"] = r["speedup"] >= 1.10 and r["launches_compiled"] < r["launches_eager"]
    return r


@section("gpt2_124m_B16_T1024")
def _b16():
    if time.time() - T0 > 110:
        return {"skipped": "time limit (over 110 s used before this section)"}
    r = bench(_cfg124(), 16, 1024, 4)
    r["target_speedup"] = 1.0
    r["meets_target"] = r["speedup"] >= 1.0 and r["launches_compiled"] < r["launches_eager"]
    return r


@section("gpt2_124m_B4_T1024_cuda_graph")
def _b4g():
    if time.time() - T0 > 130:
        return {"skipped": "time limit (over 130 s used before this section)"}
    return bench(_cfg124(), 4, 1024, 6, cuda_graph=True)


RESULTS["total_seconds"] = round(time.time() - T0, 1)
text = json.dumps(RESULTS, indent=1, default=str)
(OUT / "blucompiler_gpu.json").write_text(text)
try:
    if not RESULTS["sections"].get("env", {}).get("ok"):
        raise OSError("no GPU: results stay in the output directory only")
    res = Path("benchmarks/results")
    res.mkdir(parents=True, exist_ok=True)
    (res / "blucompiler_h200.json").write_text(text)
except OSError:
    pass
print(f"blucompiler gpu_check done in {RESULTS['total_seconds']} s -> {OUT / 'blucompiler_gpu.json'}")
