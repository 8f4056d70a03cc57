"""Profiler overhead on GPT-2 124M, B=16, T=1024, on the GPU (issue #8: off costs nothing, on <= 5%).

    python3 packages/bluprofiler/dev/gpu_check_overhead.py $OUT     # PYTHONPATH=packages/*/src, < 150 s

The standard benchmark step (benchmarks/e2e_gpt2.py: blumodels.gpt2 with ``config(12)``, its
``batches``, cuBLAS GEMMs, fused AdamW, grad clipping at 1.0) runs in one subprocess per precision
(fp32; tf32 with CUPY_TF32=1 and ``set_matmul_precision('tf32')``; CuPy reads CUPY_TF32 at import).
Per process, step times (synchronised, wall) in modes:

* never: before any profiler session in the process (its first blocks);
* off: bluprofiler imported, a session made and stopped, nothing attached (asserted);
* timing: ``profile(memory=False)`` (CUDA events + NVTX + shapes);
* timing+memory: ``profile()`` (everything on: the default).

off / timing / timing+memory run in interleaved blocks (a discarded warm-up round first); the
ratios are of the medians of per-step times. Writes $OUT/overhead_b16.json and, from the fp32
process, one profiled step (bluprofiler.profile_steps) into $OUT/trace_b16/.
BLUPROFILER_GPU_CHECK_DRY=1 runs the same code on CPU with a 2-layer toy model (for CI machines).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DRY = os.environ.get("BLUPROFILER_GPU_CHECK_DRY") == "1"
B, T = (2, 32) if DRY else (16, 1024)
STEPS_PER_BLOCK = 4
ROUNDS = 4  # measured rounds of (off, timing, timing+memory); plus one warm-up round
NEVER_BLOCKS = 2


def build(precision: str):
    """(step_fn returning the loss tensor, sync, description) of the standard GPT-2 124M step."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import blutensor as bt
    from blumodels.gpt2 import build_model
    from e2e_gpt2 import batches, config

    dev = "cpu" if DRY else "cuda"
    if DRY:
        from blumodels.config import ModelConfig

        cfg = ModelConfig(n_layer=2, n_head=2, d_model=64, block_size=T, vocab_size=50257)
        sync = lambda: None  # noqa: E731
    else:
        import cupy

        bt.set_gemm_provider("cublas")
        bt.set_matmul_precision(precision)
        cfg = config(12)
        sync = cupy.cuda.Device().synchronize
    model = build_model(cfg, device=dev, seed=0)
    opt = bt.optim.AdamW(model.param_groups(0.1), lr=6e-4, betas=(0.9, 0.95), eps=1e-8,
                         fused=None if DRY else True)
    data = [(bt.tensor(x, device=dev), bt.tensor(y, device=dev)) for x, y in batches(B, T, 4)]
    params = list(model.parameters())
    it = [0]

    def step():
        x, y = data[it[0] % len(data)]
        it[0] += 1
        _, loss = model(x, y)
        loss.backward()
        bt.optim.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    desc = {"model": "blumodels.gpt2 config(12)" if not DRY else "toy (dry run)", "B": B, "T": T,
            "precision": precision, "params": sum(p.numel() for p in params), "gemm": "cublas",
            "optimizer": "AdamW fused", "cupy_tf32": os.environ.get("CUPY_TF32", "")}
    return step, sync, desc


def timed(step, sync, n: int) -> list[float]:
    out = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        step()
        sync()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def child(precision: str, trace_dir: str) -> dict:
    t_start = time.time()
    step, sync, desc = build(precision)
    t = time.perf_counter()
    for _ in range(3):
        loss = step()
    sync()
    desc["warmup_s"] = time.perf_counter() - t
    desc["loss_after_warmup"] = float(loss.item())
    # never: no session has run in this process (the plugin host may have imported bluprofiler's sinks)
    from blutensor.autograd import engine
    from blutensor.ops import dispatch

    assert not dispatch.observers and not engine.backward_observers
    never = []
    for _ in range(NEVER_BLOCKS):
        never += timed(step, sync, STEPS_PER_BLOCK)

    import bluprofiler as bp
    from blutensor.autograd.node import Node

    apply_fn = Node.apply
    modes = {"off": None, "timing": {"memory": False}, "timing+memory": {}}
    times: dict[str, list[float]] = {m: [] for m in modes}
    blocks: dict[str, list[float]] = {m: [] for m in modes}
    counts = {}
    for r in range(ROUNDS + 1):
        for m, kw in modes.items():
            if kw is None:
                assert not dispatch.observers and not engine.backward_observers and Node.apply is apply_fn
                ts = timed(step, sync, STEPS_PER_BLOCK)
            else:
                with bp.profile(**kw) as prof:
                    ts = timed(step, sync, STEPS_PER_BLOCK)
                res = prof.result
                counts[m] = {"spans_per_step": len(res.ops()) / STEPS_PER_BLOCK,
                             "mem_events_per_step": len(res.mem_events) / STEPS_PER_BLOCK,
                             "allocs_per_step": sum(e.kind == "alloc" for e in res.mem_events) / STEPS_PER_BLOCK,
                             "memory_source": res.meta.get("memory_source")}
                del prof, res
            if r > 0:  # round 0 warms up the event pool and the CuPy hook path
                times[m] += ts
                blocks[m].append(statistics.median(ts))
    med = statistics.median
    base = med(never)
    out = {**desc, "steps_per_block": STEPS_PER_BLOCK, "rounds": ROUNDS, "never_ms": never,
           **{f"{m}_ms": v for m, v in times.items()}, "block_medians_ms": blocks, "counts": counts,
           "median_ms": {"never": base, **{m: med(v) for m, v in times.items()}},
           "min_ms": {"never": min(never), **{m: min(v) for m, v in times.items()}}}
    off = med(times["off"])
    out["ratio_median"] = {"off_vs_never": off / base, "timing_vs_off": med(times["timing"]) / off,
                           "timing+memory_vs_off": med(times["timing+memory"]) / off,
                           "timing+memory_vs_never": med(times["timing+memory"]) / base}
    if trace_dir:
        summary = bp.profile_steps(lambda: float(step().item()), 1, trace_dir, warmup=1,
                                   meta={"workload": f"GPT-2 124M B={B} T={T} {precision}", **desc})
        out["trace"] = {"dir": trace_dir, "step_ms": summary["step_ms"],
                        "peak_memory_MiB": summary["memory"]["peak_bytes"] / 2**20,
                        "spans": sum(r["calls"] for r in summary["rows"])}
    out["elapsed_s"] = time.time() - t_start
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        r = child(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "")
        print("RESULT " + json.dumps(r), flush=True)
        return
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu_check_overhead_out")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    res: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dry_run": DRY, "runs": {}}
    for prec, tf32, trace in (("fp32", "0", str(out / "trace_b16")), ("tf32", "1", "")):
        env = dict(os.environ, CUPY_TF32=tf32)
        cmd = [sys.executable, __file__, "--child", prec] + ([trace] if trace else [])
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            res["runs"][prec] = {"error": f"rc={p.returncode}", "tail": (p.stdout + p.stderr)[-3000:]}
            print(f"{prec}: FAILED rc={p.returncode}\n{(p.stdout + p.stderr)[-3000:]}", flush=True)
            continue
        r = res["runs"][prec] = json.loads(line[7:])
        m, q = r["median_ms"], r["ratio_median"]
        print(f"[{time.time() - t0:5.1f}s] {prec}: median step ms never {m['never']:.1f}, off {m['off']:.1f}, "
              f"timing {m['timing']:.1f}, timing+memory {m['timing+memory']:.1f} | off/never "
              f"{q['off_vs_never']:.3f}, timing/off {q['timing_vs_off']:.3f}, timing+memory/off "
              f"{q['timing+memory_vs_off']:.3f} | {r['counts'].get('timing+memory')}", flush=True)
    res["elapsed_s"] = time.time() - t0
    ok = all("ratio_median" in r and r["ratio_median"]["timing+memory_vs_off"] <= 1.05
             and r["ratio_median"]["off_vs_never"] <= 1.02 for r in res["runs"].values()) and len(res["runs"]) == 2
    res["target_met"] = ok
    (out / "overhead_b16.json").write_text(json.dumps(res, indent=1))
    print(f"done in {res['elapsed_s']:.0f} s; 5% target {'MET' if ok else 'NOT met'} "
          f"(off/never <= 1.02 and timing+memory/off <= 1.05, both precisions)", flush=True)


if __name__ == "__main__":
    main()
