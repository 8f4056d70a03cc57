"""GPU kernel time of one training step per precision mode, bucketed into GEMM / attention / other, beside
torch.compile's step of the same model from the same weights and batches: GPT-2 124M (B=16, T=1024) or the llama-1b
preset (B=4, T=2048, as benchmarks/e2e_llama.py trains it; PyTorch runs transformers' LlamaForCausalLM).

    python3 benchmarks/step_profile.py --out benchmarks/results/step_profile_h200.json            # bf16 and tf32
    python3 benchmarks/step_profile.py --modes bf16,tf32,fp32 --steps 3 --out /tmp/profile.json
    python3 benchmarks/step_profile.py --model llama-1b --modes bf16 --out /tmp/profile_llama.json
    python3 benchmarks/step_profile.py --modes bf16 --accum 8 --steps 1 --warm-s 15 --out /tmp/profile_accum.json

BluTrain runs the Trainer's step (blumodels.step.TrainStep: fused AdamW, clipping at 1.0, bf16 autocast reading
the bf16 weight copies the AdamW kernel writes) captured into a CUDA graph after two eager warm-up steps
(blumodels.graph_step), as ``blutrain train`` runs it; PyTorch runs its fused AdamW recipe under torch.compile
(benchmarks/torch_gpt2.py). Each (framework, mode) runs in its own subprocess (CuPy reads CUPY_TF32 at import;
torch.compile caches). torch.profiler (CUPTI) records every kernel of ``--steps`` profiled steps, graph-launched
ones included. Per run the JSON holds the kernel time per step and per category, launches per step, the casts and
elementwise adds among them (their counts are what a fused step removes), and the top kernels of the "other"
bucket; per mode the ratios BluTrain / torch.compile of the total and of "other". ``timeline`` says where the GPU
idles: per step the span from the first kernel to the last, the time some kernel ran, the idle rest by gap length
and the longest gaps with their neighbours. ``--accum N`` profiles steps of N micro-steps (BluTrain's micro-step graph
replayed, PyTorch's scaled-loss accumulation), ``--warm-s`` runs unprofiled steps first so that clocks and power are
at their steady state (nvidia-smi's clock, power and clock-event reasons are recorded before and after), and
``--frameworks`` profiles one side alone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

CATS = (("attention", ("sdpa", "fmha", "attention", "flash", "dot_do_o")),
        ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "splitk", "blu_gemm", "cublas", "sm90_", "sm80_")))
#: kernel-name fragments of dtype conversions (BluTrain's cast kernels, PyTorch's copy/convert kernels)
CAST_KEYS = ("blu_cast", "bf16_bits", "to_bf16", "to_f32", "convert", "copy_kernel")
#: kernel-name fragments of standalone elementwise adds (gradient accumulation outside the kernels)
ADD_KEYS = ("cupy_add", "add_kernel", "addkernel")
MODES = ("bf16", "tf32", "fp32")
#: model -> (micro-batch, sequence length, learning rate) of the profiled step
MODELS = {"gpt2-124m": (16, 1024, 6e-4), "llama-1b": (4, 2048, 3e-4)}


def _llama_args(model: str):
    """The arguments benchmarks/e2e_llama.py's model builders read, for the preset ``model``."""
    return argparse.Namespace(small=False, preset=model, lr=MODELS[model][2])


def _batches(model: str, steps: int) -> list:
    """``steps`` (x, y) int arrays of the model's shape, from the benchmarks' shared token source."""
    B, T, _ = MODELS[model]
    if model.startswith("llama"):
        from e2e_llama import batches
    else:
        from e2e_gpt2 import batches
    return list(batches(B, T, steps))


def category(name: str) -> str:
    n = name.lower()
    for cat, keys in CATS:
        if any(k in n for k in keys):
            return cat
    return "other"


def _profile(step, n: int) -> tuple[dict, dict]:
    """Per-kernel rows (launches and kernel milliseconds per step) and the timeline of ``n`` steps (see
    :func:`timeline`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    rows: dict = {}
    spans: list = []
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        r = rows.setdefault(e.name, {"count": 0.0, "us": 0.0})
        r["count"] += 1
        r["us"] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        spans.append((e.time_range.start, e.time_range.end, e.name))
    for r in rows.values():
        r["count"] /= n
        r["us"] /= n
    return rows, timeline(spans, n, wall)


def gpu_clocks() -> str | None:
    """nvidia-smi's SM clock, power draw and active clock-event reasons now (None without nvidia-smi)."""
    q = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
    try:
        p = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() or None


#: idle intervals between consecutive kernels, by length (us): the bins of :func:`timeline`
GAP_BINS = (2.0, 5.0, 20.0, 100.0, float("inf"))


def timeline(spans: list, n: int, wall_s: float) -> dict:
    """Where the GPU idles: from the kernels' (start, end, name) in us over ``n`` steps, per step the span from the
    first kernel's start to the last one's end, the time some kernel ran (the union of the intervals), the idle
    rest, the idle time by gap length (GAP_BINS), and the longest gaps with the kernels on either side. Kernel
    time (the rows' sum) above busy time means kernels overlapped; idle time is what no kernel used."""
    if not spans:
        return {}
    spans.sort()
    busy, gaps, end, last = 0.0, [], spans[0][0], spans[0][2]
    for a, b, name in spans:
        if a > end:
            gaps.append((a - end, last, name))
        if b > end:
            busy += b - max(a, end)
            end, last = b, name
    span = end - spans[0][0]
    bins: dict = {}
    lo = 0.0
    for hi in GAP_BINS:
        sel = [g for g, _, _ in gaps if lo <= g < hi]
        bins[f"{lo:g}-{hi:g}us"] = {"count": round(len(sel) / n, 1), "ms": round(sum(sel) / n / 1e3, 4)}
        lo = hi
    top = sorted(gaps, key=lambda g: -g[0])[:8]
    return {"wall_ms": wall_s / n * 1e3, "span_ms": span / n / 1e3, "busy_ms": busy / n / 1e3,
            "idle_ms": (span - busy) / n / 1e3, "idle_by_gap": bins,
            "longest_gaps": [{"us": round(g, 1), "after": x[:80], "before": y[:80]} for g, x, y in top]}


def blutrain_step(mode: str, steps: int, model_name: str = "gpt2-124m", accum: int = 1):
    import blutensor as bt
    import cupy
    from blumodels.graph_step import CapturedStep
    from blumodels.step import TrainStep

    B, T, LR = MODELS[model_name]
    bt.set_matmul_precision("tf32" if mode == "tf32" else "fp32")
    bt.set_gemm_provider("cublas")
    if model_name.startswith("llama"):
        from e2e_llama import blutrain_model

        model = blutrain_model(_llama_args(model_name), "cuda")
    else:
        from blumodels.gpt2 import build_model
        from e2e_gpt2 import config

        model = build_model(config(12), device="cuda", seed=0)
    model.lean_logits = True  # as the Trainer sets it on CUDA
    opt = bt.optim.AdamW(model.param_groups(0.1), lr=LR, betas=(0.9, 0.95), eps=1e-8, fused=True)
    amp = (lambda: bt.autocast("cuda", dtype=bt.bfloat16)) if mode == "bf16" else None
    data = [(bt.tensor(x, device="cuda"), bt.tensor(y, device="cuda"))
            for x, y in _batches(model_name, (steps + 4) * accum)]
    st = TrainStep(model, opt, list(model.parameters()), device="cuda", lr_schedule=[LR] * (steps + 4),
                   accum=accum, grad_clip=1.0, autocast=amp, fused=True)
    st.precast_accumulate = True  # the Trainer's setting on CUDA with static gradients
    nxt = itertools.cycle(data).__next__  # each step takes ``accum`` micro-batches
    for _ in range(2):
        st.run(nxt, LR)
    cap = CapturedStep(st, (B, T))
    cap.capture()
    cap.run(nxt, LR)
    cupy.cuda.Device().synchronize()
    losses: list = []

    def step():
        cap.run(nxt, LR)

    def read():
        losses.append(st.read().loss)
        return losses

    return step, read


def torch_step(mode: str, steps: int, model_name: str = "gpt2-124m", accum: int = 1):
    import torch

    B, T, LR = MODELS[model_name]
    torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    torch.backends.cudnn.allow_tf32 = mode == "tf32"
    llama = model_name.startswith("llama")
    if llama:  # transformers' LlamaForCausalLM with BluTrain's initial weights, loss as e2e_llama.py's torch rows
        from e2e_llama import torch_model

        model = torch_model(_llama_args(model_name), "cuda")
        model.train()
        V = model.config.vocab_size

        def forward_loss(x, y):
            logits = model(x).logits
            return torch.nn.functional.cross_entropy(logits.float().view(-1, V), y.view(-1))

        sm = torch.compile(forward_loss)
    else:
        from blumodels.gpt2 import build_model
        from e2e_gpt2 import config
        from torch_gpt2 import from_blutrain

        model = from_blutrain(build_model(config(12), device="cpu", seed=0))
        sm = torch.compile(model)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8, fused=True)
    data = itertools.cycle(_batches(model_name, (steps + 4) * accum))
    losses: list = []

    def step():
        for _ in range(accum):  # PyTorch's accumulation: each micro-step's scaled loss backward into .grad
            x, y = next(data)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "bf16"):
                loss = sm(torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda())
            (loss if accum == 1 else loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    for _ in range(3):
        step()

    def read():
        return [float(v) for v in losses]

    return step, read


def summarize(rows: dict, top: int) -> dict:
    cats: dict = {}
    for name, r in rows.items():
        c = category(name)
        cats[c] = cats.get(c, 0.0) + r["us"]

    def pick(keys):
        sel = [r for n, r in rows.items() if category(n) == "other" and any(k in n.lower() for k in keys)]
        return {"launches": round(sum(r["count"] for r in sel), 2), "ms": sum(r["us"] for r in sel) / 1e3}

    def top_of(cat):
        sel = sorted(((n, r) for n, r in rows.items() if category(n) == cat), key=lambda kv: -kv[1]["us"])
        return [{"name": n[:120], "count": round(r["count"], 2), "ms": round(r["us"] / 1e3, 4)} for n, r in sel[:top]]

    emb = [r for n, r in rows.items() if "embedding_backward" in n]
    return {
        "total_ms": sum(r["us"] for r in rows.values()) / 1e3,
        "category_ms": {k: v / 1e3 for k, v in sorted(cats.items())},
        "launches": round(sum(r["count"] for r in rows.values()), 2),
        "casts": pick(CAST_KEYS),
        "adds": pick(ADD_KEYS),
        "embedding_backward_ms": sum(r["us"] for r in emb) / 1e3 if emb else None,
        "top_other": top_of("other"),
        "top_attention": top_of("attention"),
        "top_gemm": top_of("gemm"),
    }


def child(a) -> None:
    try:
        import torch

        torch.zeros(1, device="cuda")  # one CUDA context for torch and CuPy
        make = blutrain_step if a.framework == "blutrain" else torch_step
        step, read = make(a.mode, a.steps, a.model, a.accum)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < a.warm_s:  # unprofiled steps: clocks and power at their steady state
            step()
        clocks = [gpu_clocks()]
        t0 = time.perf_counter()
        rows, tl = _profile(step, a.steps)
        clocks.append(gpu_clocks())
        r = summarize(rows, a.top)
        r["timeline"] = tl
        r["gpu_clocks_before_after"] = clocks
        r["profile_wall_s"] = time.perf_counter() - t0
        losses = read()
        r["losses"] = losses[-a.steps:]
        r["finite"] = all(v == v and abs(v) < 1e30 for v in r["losses"])
        r["torch"] = torch.__version__
    except Exception as e:  # noqa: BLE001 - the driver records the failure
        import traceback

        r = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(r), flush=True)


def run_child(framework: str, mode: str, a) -> dict:
    env = dict(os.environ)
    if framework == "blutrain" and mode == "tf32":
        env["CUPY_TF32"] = "1"
    cmd = [sys.executable, __file__, "--child", "--framework", framework, "--mode", mode, "--steps", str(a.steps),
           "--top", str(a.top), "--model", a.model, "--accum", str(a.accum), "--warm-s", str(a.warm_s)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    for line in p.stdout.splitlines()[::-1]:
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": f"exit {p.returncode}", "stderr": p.stderr[-3000:]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--framework", default="blutrain", choices=("blutrain", "torch_compile"))
    p.add_argument("--mode", default="bf16", choices=MODES)
    p.add_argument("--modes", default="bf16,tf32", help="comma-separated modes to profile (bf16, tf32, fp32)")
    p.add_argument("--model", default="gpt2-124m", choices=tuple(MODELS),
                   help="the profiled model: GPT-2 124M at 16x1024 or the llama-1b preset at 4x2048")
    p.add_argument("--steps", type=int, default=2, help="profiled steps per run (after warm-up)")
    p.add_argument("--accum", type=int, default=1,
                   help="micro-steps a profiled step (gradient accumulation; the micro-step graph replayed)")
    p.add_argument("--frameworks", default="blutrain,torch_compile",
                   help="comma-separated sides to profile (blutrain, torch_compile); ratios need both")
    p.add_argument("--warm-s", type=float, default=0.0,
                   help="seconds of unprofiled steps before the profiled ones (steady clocks and power)")
    p.add_argument("--top", type=int, default=12, help="'other' kernels listed per run")
    p.add_argument("--timeout", type=int, default=600, help="seconds per subprocess")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_profile.json"))
    a = p.parse_args()
    if a.steps < 1:
        p.error(f"--steps must be >= 1, got {a.steps}")
    if a.accum < 1:
        p.error(f"--accum must be >= 1, got {a.accum}")
    if a.child:
        child(a)
        return 0
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"--modes: unknown mode(s) {bad} (choose from {', '.join(MODES)})")
    sides = [f.strip() for f in a.frameworks.split(",") if f.strip()]
    if not sides or any(f not in ("blutrain", "torch_compile") for f in sides):
        p.error(f"--frameworks: choose from blutrain, torch_compile (got {a.frameworks!r})")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)  # fail on an unwritable path before the runs
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    doc = {"command": "python3 benchmarks/step_profile.py " + " ".join(sys.argv[1:]), "commit": commit,
           "date": time.strftime("%Y-%m-%d"), "host": platform.node(), "model": a.model,
           "batch": MODELS[a.model][0], "seq": MODELS[a.model][1], "steps": a.steps, "accum": a.accum,
           "modes": {}}
    for mode in modes:
        res = {fw: run_child(fw, mode, a) for fw in sides}
        bl, tc = res.get("blutrain", {}), res.get("torch_compile", {})
        if len(res) == 2 and "error" not in bl and "error" not in tc:
            res["ratios"] = {
                "total_blutrain_over_torch_compile": bl["total_ms"] / tc["total_ms"],
                "other_blutrain_over_torch_compile": bl["category_ms"].get("other", 0.0)
                / max(tc["category_ms"].get("other", 0.0), 1e-9),
                "other_at_or_below_torch_compile": bl["category_ms"].get("other", 0.0)
                <= tc["category_ms"].get("other", 0.0),
            }
        doc["modes"][mode] = res
        for fw, r in res.items():
            if fw == "ratios":
                continue
            if "error" in r:
                print(f"{mode:5s} {fw:13s} ERROR {r['error']}")
                continue
            c = {k: round(v, 2) for k, v in r["category_ms"].items()}
            print(f"{mode:5s} {fw:13s} total {r['total_ms']:7.2f} ms  {c}  launches {r['launches']:.0f}  "
                  f"casts {r['casts']['launches']:.0f} ({r['casts']['ms']:.2f} ms)  adds {r['adds']['launches']:.0f} "
                  f"({r['adds']['ms']:.2f} ms)  emb-bwd {r['embedding_backward_ms']}")
            if r.get("timeline"):
                t = r["timeline"]
                print(f"        timeline: wall {t['wall_ms']:.2f} ms a step, span {t['span_ms']:.2f}, busy "
                      f"{t['busy_ms']:.2f}, idle {t['idle_ms']:.2f}  {t['idle_by_gap']}")
            for k in r["top_attention"][:6] + r["top_other"][:6]:
                print(f"        {k['ms']:7.3f} ms x{k['count']:5.1f}  {k['name'][:90]}")
        if "ratios" in res:
            ratio = res["ratios"]["other_blutrain_over_torch_compile"]
            print(f"{mode:5s} other: BluTrain / torch.compile = {ratio:.3f}")
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    return 0 if all("error" not in r for m in doc["modes"].values() for k, r in m.items() if k != "ratios") else 1


if __name__ == "__main__":
    sys.exit(main())
