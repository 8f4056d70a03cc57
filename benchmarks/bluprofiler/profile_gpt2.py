"""GPT-2 124M training step profiled with bluprofiler on a CUDA GPU: the trace and summary of one step, and the
profiler's overhead (step time never profiled vs off after a session vs on: timing+memory, timing only).

    python3 benchmarks/bluprofiler/profile_gpt2.py OUTDIR      # < 3 min

GPT-2 124M-shaped model (blumodels.gpt2 if usable, else bluprofiler.demo.GPT: 12 layers, d=768, T=1024, B=4,
fp32, AdamW) -> OUTDIR/gpt2_124m/{trace.json, summary.txt, summary.json, events.jsonl, memory.png (with
matplotlib), overhead.json}; everything in OUTDIR/profile_gpt2.json. The profiler's correctness on the GPU (its
CUDA-event times against raw events, ...) is the `cuda`-marked tests of packages/bluprofiler/tests.
``BLUPROFILER_BENCH_DRY=1`` runs the same sections on the CPU with a tiny model.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

T_START = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T_START:6.1f}s] {msg}", flush=True)


def blumodels_step(bt, dry: bool):
    """GPT-2 124M from blumodels.gpt2 (B=4, T=1024, AdamW with the shipped recipe) or None if unavailable."""
    from blumodels.config import ModelConfig
    from blumodels.gpt2 import build_model
    from bluprofiler import record_function

    cfg = ModelConfig(vocab_size=50257)
    B, dev = 4, "cuda"
    if dry:
        cfg, B, dev = ModelConfig(vocab_size=96, n_layer=2, n_head=2, d_model=32, block_size=16), 2, "cpu"
    model = build_model(cfg, device=dev, seed=0)
    opt = bt.optim.AdamW(model.param_groups(0.1), lr=6e-4, betas=(0.9, 0.95))
    idx = bt.randint(0, cfg.vocab_size, (B, cfg.block_size + 1), device=dev)
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

    def step() -> float:
        with record_function("forward"):
            _, loss = model(x, y)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()
            model.zero_grad()
        return loss.item()

    step()  # fails here rather than in the timed part
    desc = {"model": "blumodels.gpt2.GPT2", "n_layer": cfg.n_layer, "n_embd": cfg.d_model, "n_head": cfg.n_head,
            "T": cfg.block_size, "B": B, "vocab": cfg.vocab_size, "padded_vocab": cfg.padded_vocab_size,
            "params": sum(p.numel() for p in model.parameters()), "dtype": "float32"}
    return step, desc


def build_step(bt, dry: bool = False):
    """(step_fn, description) for GPT-2 124M-shaped training, B=4, T=1024 (dry: tiny, on CPU):
    blumodels.gpt2 when it imports and runs, else bluprofiler.demo.GPT (blutensor.nn only)."""
    try:
        return blumodels_step(bt, dry)
    except Exception as e:
        log(f"blumodels.gpt2 not usable ({type(e).__name__}: {e}); using bluprofiler.demo.GPT")
        err = f"{type(e).__name__}: {e}"
    from bluprofiler.demo import GPTConfig, make_gpt_step

    c = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768, batch_size=4)
    if dry:
        c = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32, batch_size=2)
    step, model = make_gpt_step(c, device="cpu" if dry else "cuda")
    n_params = sum(p.numel() for p in model.parameters())
    return step, {"model": "bluprofiler.demo.GPT (blutensor.nn)", "blumodels_error": err,
                  "n_layer": c.n_layer, "n_embd": c.n_embd, "n_head": c.n_head, "T": c.block_size,
                  "B": c.batch_size, "vocab": c.vocab_size, "params": n_params, "dtype": "float32"}


def timed_steps(step, n: int, sync) -> list[float]:
    out = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        step()
        sync()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "profile_gpt2_out")
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    dry = os.environ.get("BLUPROFILER_BENCH_DRY") == "1"  # exercise sections 3-4 on CPU (tiny model)
    import blutensor as bt

    if dry:
        cp = None
        res["dry_run"] = True

        def sync():
            return None
    else:
        import cupy as cp

        def sync():
            cp.cuda.Device().synchronize()

        props = cp.cuda.runtime.getDeviceProperties(0)
        res["gpu"] = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        res["cupy"] = cp.__version__
        log(f"GPU {res['gpu']}, CuPy {res['cupy']}")

    try:
        from bluprofiler import profile
        from bluprofiler.run import profile_steps

        step, desc = build_step(bt, dry)

        desc["matmul_precision"] = bt.get_matmul_precision()
        res["gpt2"] = desc
        t = time.perf_counter()
        step()
        sync()
        first = time.perf_counter() - t
        step()
        sync()
        log(f"GPT-2 124M: first step {first:.1f} s, {desc['params'] / 1e6:.1f} M params")
        probe = timed_steps(step, 1, sync)[0]
        n = 3 if probe < 1500 else (2 if probe < 4000 else 1)
        res["gpt2"]["probe_step_ms"] = probe
        # never-profiled steps, then one profiled step written out (the committed trace)
        never = timed_steps(step, n, sync)
        summary = profile_steps(step, 1, out / "gpt2_124m", warmup=0, meta={"workload": "GPT-2 124M shape"})
        log("profiled step written to gpt2_124m/")
        # interleaved blocks: off (after a session), on (profile(): timing+memory, NVTX only under Nsight), timing-only
        off, on, on_t = [], [], []
        for _ in range(2):
            off += timed_steps(step, n, sync)
            with profile():
                on += timed_steps(step, n, sync)
            with profile(memory=False):
                on_t += timed_steps(step, n, sync)
        med = statistics.median
        res["overhead"] = {
            "steps_per_mode": len(off), "never_ms": never, "off_ms": off, "on_ms": on,
            "on_timing_only_ms": on_t,
            "off_vs_never_median": med(off) / med(never), "on_vs_off_median": med(on) / med(off),
            "on_vs_off_min": min(on) / min(off), "on_timing_only_vs_off_median": med(on_t) / med(off),
        }
        res["gpt2"]["profiled_step_ms"] = summary["step_ms"]
        res["gpt2"]["sum_gpu_op_ms"] = sum(r["total_ms"] for r in summary["rows"])
        res["gpt2"]["peak_memory_MiB"] = summary["memory"]["peak_bytes"] / 2**20
        res["gpt2"]["top_rows"] = [{k: r[k] for k in ("name", "calls", "total_ms", "mean_us", "share")}
                                   for r in summary["rows"][:12]]
        (out / "gpt2_124m" / "overhead.json").write_text(json.dumps(res["overhead"], indent=1))
        o = res["overhead"]
        log(f"step ms: never {med(never):.1f}, off {med(off):.1f}, on {med(on):.1f}, "
            f"timing-only {med(on_t):.1f}; on/off {o['on_vs_off_median']:.3f}, "
            f"off/never {o['off_vs_never_median']:.3f}")
        print((out / "gpt2_124m" / "summary.txt").read_text()[:3500])
    except Exception:
        res["gpt2_error"] = traceback.format_exc()[-3000:]
        log("GPT-2 profile FAILED:\n" + res["gpt2_error"])

    res["elapsed_s"] = time.time() - T_START
    (out / "profile_gpt2.json").write_text(json.dumps(res, indent=1, default=str))
    verdict = "dry run (CPU)" if dry else ("done" if "overhead" in res else "FAILED (see profile_gpt2.json)")
    log(f"done in {res['elapsed_s']:.0f} s; {verdict}")


if __name__ == "__main__":
    main()
