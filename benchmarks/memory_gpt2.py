"""Memory-lean training on one GPU: BluTrain and PyTorch side by side, in one run.

    python3 benchmarks/memory_gpt2.py \
        --out benchmarks/results/memory_gpt2_h200.json [--only a,b,c,e]
    python3 benchmarks/memory_gpt2.py --only b --precision bf16 --steps 8 --timeout 600 --out OUT.json

(a) GPT-2 124M, B=16, T=1024, fp32: peak allocated/reserved of BluTrain (plain AdamW + clipping as PyTorch;
    and with the memory-lean options) vs PyTorch eager and torch.compile.
(b) GPT-2 124M, B=2, T=16384 (block_size 16384), fp32: peak memory and tokens/s vs PyTorch eager and
    torch.compile (BluTrain's attention is its flash kernel, nothing T x T is stored). ``blutrain_graph`` is the
    Trainer's own step (blumodels.step.TrainStep, captured into CUDA graphs after graph_step.WARMUP_STEPS eager
    steps, as ``train.cuda_graph = "auto"`` runs it); the other BluTrain runs are this script's eager loop.
    ``--precision bf16`` runs case b in bf16 autocast with fp32 master weights: BluTrain's Trainer step under
    the execution policy of ``train.precision = "bf16"`` (``blutrain``: captured, the Trainer's default;
    ``blutrain_eager``: the same step with ``train.cuda_graph = false``) beside PyTorch bf16 autocast eager and
    torch.compile of the same model, weights and batches.
(c) d_model=3072, 24 heads, B=2, T=1024, fp32, --layers-c layers (80: 9.22B parameters): BluTrain trains
    with activation recomputation + optimizer step in backward, 6 steps, lr warming up linearly to 4e-6 over
    4 steps (loss must fall). Why so small: at 80 layers the residual projections start at std
    0.02/sqrt(160) = 0.0016 and Adam's first steps move every weight by about lr; PyTorch (CPU, d=3072,
    4 layers with that init) also jumps from 11.0 to 15.1 at a constant 2e-5 and to 23.3 at 3e-4, and falls
    (11.0 -> 10.6 -> 9.9 -> 8.8) with a 1e-6..5e-6 warmup: case c's old rise was this, not a bug.
(e) the lean options on the GPU at case c's width (4 layers): per-step losses of BluTrain plain, recompute,
    optimizer-in-backward and both, and PyTorch, from the same weights and batches (no clipping anywhere).
Each run is its own subprocess so peaks do not mix. BluTrain runs allocate through bluallocator (CuPy's
allocator is replaced) and report its peak reserved; PyTorch's numbers come from torch.cuda. Per run: the loss of
every step, tokens/s (median over the timed steps: after step 0, and after the capture for a captured step), peak
allocated and reserved; ``ratios`` divides every BluTrain run by each PyTorch run of its case, ``loss_diff`` is
each run's largest per-step loss difference from PyTorch eager. ``--tiny`` runs the same plumbing with toy sizes on
the CPU (no memory numbers, no torch.compile; a captured step replays its recorded body eagerly) for tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

GiB = 2**30
CASES = {  # sizes; steps include step 0
    "a": dict(batch=16, seq=1024, layers=12, d=768, heads=12, steps=6),
    "b": dict(batch=2, seq=16384, layers=12, d=768, heads=12, steps=5),
    "c": dict(batch=2, seq=1024, layers=80, d=3072, heads=24, steps=6, warmup=4, lr=4e-6),
    "e": dict(batch=2, seq=1024, layers=4, d=3072, heads=24, steps=4, lr=1e-5),
}
TINY = {
    "a": dict(batch=2, seq=32, layers=2, d=64, heads=4, steps=3),
    "b": dict(batch=1, seq=128, layers=2, d=64, heads=4, steps=3),
    "c": dict(batch=1, seq=32, layers=12, d=64, heads=4, steps=4, warmup=2, lr=1e-3),
    "e": dict(batch=1, seq=32, layers=6, d=64, heads=4, steps=4, lr=1e-3),
}
LEAN = ["--recompute", "--oib"]
RUNS = [  # (case, name, framework, flags)
    ("a", "torch_eager", "torch", []),
    ("a", "torch_compile", "torch", ["--compile"]),
    ("a", "blutrain", "blutrain", []),
    ("a", "blutrain_oib", "blutrain", ["--oib"]),
    ("a", "blutrain_lean", "blutrain", LEAN),
    ("b", "torch_eager", "torch", []),
    ("b", "torch_compile", "torch", ["--compile"]),
    ("b", "blutrain", "blutrain", []),
    ("b", "blutrain_graph", "step", ["--graph"]),
    ("b", "blutrain_lean", "blutrain", LEAN),
    # fp32 storage and fp32-accurate arithmetic on the tensor cores: 3xTF32 attention (what PyTorch's own fp32
    # SDPA runs), then also 3xTF32 GEMMs (split-TF32, blublas.split_tf32) instead of FFMA SGEMM
    ("b", "blutrain_x3attn", "blutrain", ["--sdpa-fp32", "tf32x3"]),
    ("b", "blutrain_x3", "blutrain", ["--sdpa-fp32", "tf32x3", "--fp32-gemm", "3xtf32"]),
    ("c", "blutrain_lean", "blutrain", LEAN),
    ("e", "torch_eager", "torch", ["--no-clip"]),
    ("e", "blutrain_plain", "blutrain", ["--no-clip"]),
    ("e", "blutrain_recompute", "blutrain", ["--recompute", "--no-clip"]),
    ("e", "blutrain_oib", "blutrain", ["--oib"]),
    ("e", "blutrain_lean", "blutrain", LEAN),
]
# (case, ours, reference, metric, bound, "<=" / ">="): the targets
TARGETS = [
    ("a", "blutrain", "torch_eager", "peak_reserved_gib", 0.75, "<="),
    ("a", "blutrain", "torch_compile", "peak_reserved_gib", 1.0, "<="),
    ("b", "blutrain", "torch_eager", "peak_reserved_gib", 0.85, "<="),
    ("b", "blutrain", "torch_eager", "tokens_per_s", 1.2, ">="),
    ("b", "blutrain_x3attn", "torch_eager", "peak_reserved_gib", 0.85, "<="),
    ("b", "blutrain_x3attn", "torch_eager", "tokens_per_s", 1.2, ">="),
    ("b", "blutrain_x3", "torch_eager", "peak_reserved_gib", 0.85, "<="),
    ("b", "blutrain_x3", "torch_eager", "tokens_per_s", 1.2, ">="),
]
#: --precision bf16: bf16 autocast, fp32 master weights and AdamW state, on both sides
RUNS_BF16 = [
    ("b", "torch_eager", "torch", []),
    ("b", "torch_compile", "torch", ["--compile"]),
    ("b", "blutrain", "step", ["--graph"]),
    ("b", "blutrain_eager", "step", []),
]
TARGETS_BF16 = [
    ("b", "blutrain", "torch_compile", "tokens_per_s", 1.1, ">="),
]
RUNS_OF = {"fp32": RUNS, "bf16": RUNS_BF16}
TARGETS_OF = {"fp32": TARGETS, "bf16": TARGETS_BF16}


def model_cfg(a):
    from blumodels.config import ModelConfig

    return ModelConfig(n_layer=a.layers, n_head=a.heads, d_model=a.d, block_size=a.seq, vocab_size=50257)


def lr_at(a, step: int) -> float:
    """Linear warmup over ``--warmup`` steps (from lr/warmup), then constant."""
    return a.lr * min(1.0, (step + 1) / a.warmup) if a.warmup > 0 else a.lr


def _batches(a):
    from e2e_gpt2 import batches

    return list(batches(a.batch, a.seq, a.steps))


def blutrain(a) -> dict:
    """Train ``a.steps`` steps of BluTrain's GPT-2; memory from bluallocator's statistics."""
    import blutensor as bt
    from blumodels.gpt2 import build_model
    from blutensor.utils import OptimizerInBackward, checkpoint_modules

    cuda = a.device == "cuda"
    if a.sdpa_fp32:
        bt.policy.update(attention_fp32=a.sdpa_fp32)  # the process default (BLUTRAIN_SDPA_FP32's field)
    bt.set_fp32_gemm(a.fp32_gemm)
    alloc = None
    if cuda and a.allocator == "blu":
        import bluallocator

        alloc = bluallocator.install()
        alloc.begin_profile()  # step 0's request sizes choose the rounding; flushed after step 0
    sync = (lambda: __import__("cupy").cuda.Device().synchronize()) if cuda else (lambda: None)
    t_init = time.perf_counter()
    model = build_model(model_cfg(a), device=a.device, seed=0)
    model.lean_logits = True  # as the Trainer: the CUDA loss overwrites the logits with their gradient
    if a.recompute:
        checkpoint_modules(model, "blocks.*")
    opt = bt.optim.AdamW(model.param_groups(0.1), lr=lr_at(a, 0), betas=(0.9, 0.95), eps=1e-8,
                         fused=True if cuda else None)
    if a.oib:
        opt = OptimizerInBackward(opt)
    sync()
    init_s = time.perf_counter() - t_init
    losses, times, lrs, flush, after0 = [], [], [], {}, {}
    for i, (x, y) in enumerate(_batches(a)):
        for g in opt.param_groups:
            g["lr"] = lr_at(a, i)
        lrs.append(lr_at(a, i))
        xi, yi = bt.tensor(x, device=a.device), bt.tensor(y, device=a.device)
        sync()
        t0 = time.perf_counter()
        _, loss = model(xi, yi)
        del _
        loss.backward()
        if not a.oib and not a.no_clip:
            bt.optim.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.item()))
        del loss, xi, yi
        if alloc is not None:
            if i == 0:
                flush = alloc.flush_after_step0()
                alloc_after0 = alloc.memory_stats()
                after0 = {"allocated_after_step0_gib": alloc_after0["allocated_bytes"] / GiB,
                          "reserved_after_step0_gib": alloc_after0["reserved_bytes"] / GiB}
                run_peak = (alloc_after0["peak_allocated_bytes"], alloc_after0["peak_reserved_bytes"])
                alloc.reset_peak_stats()
    out = {"losses": losses, "lrs": lrs, "step_s": times, "init_s": init_s, "layers": a.layers,
           "params_b": sum(p.numel() for p in model.parameters()) / 1e9}
    if alloc is not None:
        st = alloc.memory_stats()
        out.update(peak_allocated_gib=max(run_peak[0], st["peak_allocated_bytes"]) / GiB,
                   peak_reserved_gib=max(run_peak[1], st["peak_reserved_bytes"]) / GiB,
                   steady_peak_allocated_gib=st["peak_allocated_bytes"] / GiB,
                   steady_peak_reserved_gib=st["peak_reserved_bytes"] / GiB,
                   released_after_step0_gib=flush.get("released_bytes", 0) / GiB,
                   granularity=[flush.get("granularity_small"), flush.get("granularity_large")],
                   fragmentation=st["fragmentation"], num_allocs=st["num_allocs"], **after0)
    elif cuda:
        import cupy

        pool = cupy.get_default_memory_pool()
        out.update(peak_reserved_gib=pool.total_bytes() / GiB, note="CuPy pool: reserved at the end, no peak")
    return out


def trainer_step(a) -> dict:
    """BluTrain's training step as the Trainer runs it (blumodels.trainer.Trainer._build_step): the run's execution
    policy from its ``[train]`` table (``train.precision = "bf16"``: bf16 autocast around forward + loss, fp32
    masters), the Trainer's allocator handling (blumodels.memory.DeviceMemory: flushed after step 0, emptied before
    the capture), lean logits, the fused AdamW, clipping at 1.0 unless --no-clip, and with ``--graph`` the step
    captured after graph_step.WARMUP_STEPS eager steps (on the CPU graph_step's EagerCapture, which replays the
    recorded body). Only the batches differ from a Trainer run: this script's, the ones PyTorch gets."""
    import blutensor as bt
    from blumodels import graph_step
    from blumodels.config import RunConfig, TrainConfig
    from blumodels.execution import policy_from_config
    from blumodels.gpt2 import build_model
    from blumodels.memory import DeviceMemory
    from blumodels.step import TrainStep
    from blumodels.trainer import make_optimizer

    if a.recompute or a.oib:
        raise ValueError("the Trainer-step runs take neither --recompute nor --oib")
    cuda = a.device == "cuda"
    if a.sdpa_fp32:
        bt.policy.update(attention_fp32=a.sdpa_fp32)  # the surrounding policy the run's policy is based on
    cfg = RunConfig(model=model_cfg(a), train=TrainConfig(
        steps=a.steps, micro_batch=a.batch, seq_len=a.seq, batch_tokens=a.batch * a.seq, lr=a.lr,
        precision=a.precision, fp32_gemm=a.fp32_gemm, grad_clip=0.0 if a.no_clip else 1.0, device=a.device,
        cuda_graph="auto" if a.graph else False, allocator=a.allocator)).validate()
    t = cfg.train
    policy = policy_from_config(t, a.device)
    sync = (lambda: __import__("cupy").cuda.Device().synchronize()) if cuda else (lambda: None)
    with policy.use():
        why = graph_step.config_refusal(cfg) if cuda else None
        why = why or (graph_step.runtime_refusal(a.device) if cuda else None)
        if a.graph and why is not None:
            raise RuntimeError(f"--graph: the step cannot be captured: {why}")
        memory = DeviceMemory(a.device, t.allocator)
        t_init = time.perf_counter()
        model = build_model(cfg.model, device=a.device, seed=0)
        model.lean_logits = True
        opt = make_optimizer(model, cfg, a.device)
        lrs = [lr_at(a, i) for i in range(a.steps)]
        step = TrainStep(model, opt, list(model.parameters()), device=a.device, lr_schedule=lrs,
                         grad_clip=t.grad_clip, autocast=(lambda: policy.autocast(a.device))
                         if t.precision == "bf16" else None, fused=bool(cuda and t.fused_adamw))
        step.precast_accumulate = cuda and bool(step.grads)
        step.seek(0)
        sync()
        init_s = time.perf_counter() - t_init
        captured, capture_s = None, None
        losses, times, lrs_run, peaks = [], [], [], {}
        for i, (x, y) in enumerate(_batches(a)):
            xi, yi = bt.tensor(x, device=a.device), bt.tensor(y, device=a.device)
            if a.graph and captured is None and i >= graph_step.WARMUP_STEPS:
                t0 = time.perf_counter()
                make = graph_step.CudaCapture if cuda else graph_step.EagerCapture
                captured = graph_step.CapturedStep(step, (a.batch, a.seq), make_capture=make)
                memory.empty_cache()  # the graphs' pool takes the warm-up steps' activation memory back
                captured.capture()
                sync()
                capture_s = time.perf_counter() - t0
            sync()
            t0 = time.perf_counter()
            (captured or step).run(lambda b=(xi, yi): b, lrs[i])
            res = step.read()  # the step's one host read (it waits for the device)
            sync()
            times.append(time.perf_counter() - t0)
            losses.append(res.loss)
            lrs_run.append(lrs[i])
            peaks = memory.after_step()
            del xi, yi
        step.release()
    out = {"losses": losses, "lrs": lrs_run, "step_s": times, "init_s": init_s, "layers": a.layers,
           "params_b": sum(p.numel() for p in model.parameters()) / 1e9, "precision": t.precision,
           "captured": captured is not None, "capture_s": capture_s,
           # timed steps: after step 0 eagerly; after the capture (whose time is capture_s) when captured
           "timed_from": graph_step.WARMUP_STEPS if captured is not None else 1}
    if peaks.get("peak_reserved_bytes") is not None:
        out.update(peak_allocated_gib=peaks["peak_allocated_bytes"] / GiB,
                   peak_reserved_gib=peaks["peak_reserved_bytes"] / GiB,
                   reserved_at_end_gib=peaks["reserved_bytes"] / GiB, allocator=memory.allocator)
        if memory.alloc is None:
            out["note"] = "CuPy pool: peaks are its current used/total bytes, not peaks"
    return out


def torch_run(a, precision: str = "fp32") -> dict:
    """The same model in PyTorch (weights copied from BluTrain's init), fused AdamW, clip 1.0 unless --no-clip;
    ``precision="bf16"``: forward + loss under torch.autocast to bf16 (fp32 masters), as torch_gpt2.train_torch."""
    import torch
    from blumodels.gpt2 import build_model
    from torch_gpt2 import from_blutrain

    cuda = a.device == "cuda"
    model = from_blutrain(build_model(model_cfg(a), device="cpu", seed=0), device=a.device)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr_at(a, 0), betas=(0.9, 0.95), eps=1e-8, fused=cuda)
    step_model = torch.compile(model) if a.compile else model
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for i, (x, y) in enumerate(_batches(a)):
        for g in opt.param_groups:
            g["lr"] = lr_at(a, i)
        xi = torch.from_numpy(x.copy()).to(a.device)
        yi = torch.from_numpy(y.copy()).to(a.device)
        sync()
        t0 = time.perf_counter()
        with torch.autocast(a.device, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = step_model(xi, yi)
        loss.backward()
        if not a.no_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.item()))
    out = {"losses": losses, "step_s": times, "torch": torch.__version__, "precision": precision}
    if cuda:
        out.update(peak_allocated_gib=torch.cuda.max_memory_allocated() / GiB,
                   peak_reserved_gib=torch.cuda.max_memory_reserved() / GiB)
    return out


def _gpu_name(framework: str) -> str:
    """The device's name through the library the run already uses (PyTorch, or CuPy for BluTrain)."""
    if framework == "torch":
        import torch

        return torch.cuda.get_device_name(0)
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _no_gpu_reason() -> str:
    """Why the GPU runs cannot run here ('' when they can), found without opening a CUDA context in this process."""
    import importlib.util

    if importlib.util.find_spec("cupy") is None:
        return "BluTrain's runs need CuPy (pip install 'packages/blutensor[cuda13]')"
    try:
        import torch
    except ImportError:
        return "the PyTorch runs need torch"
    return "" if torch.cuda.is_available() else "PyTorch sees no CUDA device"


def child(a) -> None:
    try:
        if a.child == "blutrain":
            if a.precision != "fp32":
                raise ValueError(f"this script's eager loop runs fp32 only, not --precision {a.precision} (the "
                                 f"Trainer-step runs, --child step, take bf16)")
            r = blutrain(a)
        elif a.child == "step":
            r = trainer_step(a)
        else:
            r = torch_run(a, a.precision)
        t = sorted(r["step_s"][r.get("timed_from", 1):] or r["step_s"])
        r["tokens_per_s"] = a.batch * a.seq / t[len(t) // 2]
        if a.device == "cuda":
            r["gpu"] = _gpu_name(a.child)
    except Exception as e:  # noqa: BLE001 - reported in the JSON, the other runs go on
        import traceback

        r = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(r), flush=True)


def _verdicts(results: dict, layers_c: int, precision: str = "fp32") -> tuple[dict, dict, dict]:
    """(ratios, targets, loss_diff) of one run of the script: every ratio and verdict follows from ``results``."""
    ratios, targets, loss_diff = {}, {}, {}
    for case, ours, ref, metric, bound, op in TARGETS_OF[precision]:
        o, t = results.get(case, {}).get(ours, {}), results.get(case, {}).get(ref, {})
        if o.get(metric) and t.get(metric):
            r = o[metric] / t[metric]
            key = f"{case}:{metric}:{ours}/{ref}"
            ratios[key] = r
            targets[key] = {"ratio": r, "bound": f"{op} {bound}", "met": r <= bound if op == "<=" else r >= bound}
    for case in ("a", "b"):  # every BluTrain variant against every reference, for the record
        runs = results.get(case, {})
        for name, o in runs.items():
            for ref in ("torch_eager", "torch_compile"):
                t = runs.get(ref, {})
                for metric in ("peak_reserved_gib", "peak_allocated_gib", "tokens_per_s"):
                    if name.startswith("blutrain") and o.get(metric) and t.get(metric):
                        ratios.setdefault(f"{case}:{metric}:{name}/{ref}", o[metric] / t[metric])
        ref = runs.get("torch_eager", {}).get("losses")
        for name, o in runs.items():  # per-step losses from the same weights and batches
            if ref and name != "torch_eager" and o.get("losses"):
                d = [abs(x - y) for x, y in zip(o["losses"], ref)]
                loss_diff[f"{case}:{name}/torch_eager"] = {"max_abs": max(d), "steps": len(d), "per_step": d}
    c = results.get("c", {}).get("blutrain_lean", {})
    if c.get("losses"):
        ls = c["losses"]
        n = c.get("layers", layers_c)
        targets["c:largest_model"] = {"layers": n, "params_b": c.get("params_b"), "steps": len(ls),
                                      "losses": ls, "met": n >= 80 and len(ls) >= 4 and c["params_b"] >= 9.2
                                      and max(ls[1:]) < ls[0] and ls[-1] < ls[1]}
    e = results.get("e", {})
    ref = e.get("blutrain_plain", {}).get("losses")
    if ref:
        diffs = {n: max(abs(x - y) for x, y in zip(r["losses"], ref)) for n, r in e.items() if r.get("losses")}
        targets["e:lean_equals_plain"] = {"max_abs_loss_diff": diffs,
                                          "met": all(v <= 1e-5 for n, v in diffs.items() if n.startswith("blu"))}
    return ratios, targets, loss_diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--oib", action="store_true")
    p.add_argument("--no-clip", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--sdpa-fp32", default="", help="BluTrain: BLUTRAIN_SDPA_FP32 (simt | tf32x3)")
    p.add_argument("--fp32-gemm", default="strict", help="BluTrain: fp32 GEMMs, strict | 3xtf32")
    p.add_argument("--allocator", default="blu", choices=("blu", "cupy"))
    p.add_argument("--precision", default="fp32", choices=tuple(RUNS_OF),
                   help="fp32, or bf16 (autocast, fp32 masters; case b: the Trainer's step beside PyTorch eager "
                        "and torch.compile)")
    p.add_argument("--graph", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=0)
    for k in ("batch", "seq", "layers", "d", "heads"):
        p.add_argument(f"--{k}", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=0,
                   help="steps per run, step 0 included, of every case but c (default: the case's own)")
    p.add_argument("--layers-c", type=int, default=80)
    p.add_argument("--lr-c", type=float, default=0.0, help="case c peak lr (default: CASES['c'])")
    p.add_argument("--warmup-c", type=int, default=-1, help="case c linear-warmup steps (default: CASES['c'])")
    p.add_argument("--steps-c", type=int, default=0, help="case c steps (default: CASES['c'])")
    p.add_argument("--only", default="", help="comma-separated subset of the cases a,b,c,e (default: every case "
                                               "with runs at --precision: a,b,c,e in fp32, b in bf16)")
    p.add_argument("--runs", default="", help="comma-separated run names to keep (e.g. blutrain,torch_eager)")
    p.add_argument("--tiny", action="store_true", help="toy sizes on the CPU: tests the plumbing only")
    p.add_argument("--timeout", type=int, default=300, help="seconds per subprocess")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory_gpt2.json"))
    a = p.parse_args()
    if a.child:
        child(a)
        return
    runs_all = RUNS_OF[a.precision]
    with_runs = list(dict.fromkeys(case for case, *_ in runs_all))
    only = [c.strip() for c in a.only.split(",") if c.strip()] or with_runs
    bad = [c for c in only if c not in CASES]
    if bad:
        p.error(f"--only: unknown case(s) {bad}; choose from {sorted(CASES)}")
    bad = [c for c in only if c not in with_runs]
    if bad:
        p.error(f"--only: case(s) {bad} have no runs at --precision {a.precision}; choose from {with_runs}")
    keep = set(filter(None, a.runs.split(",")))
    names = {name for case, name, *_ in runs_all if case in only}
    if keep - names:
        p.error(f"--runs: no run named {sorted(keep - names)} in case(s) {only} at --precision {a.precision}; "
                f"choose from {sorted(names)}")
    if a.steps < 0:
        p.error(f"--steps must be positive, got {a.steps}")
    if not a.tiny and (why := _no_gpu_reason()):
        p.error(f"{why}; --tiny runs the same plumbing with toy sizes on the CPU")
    sizes_of = TINY if a.tiny else CASES
    plan = []
    for case, name, fw, flags in runs_all:
        if case not in only or (keep and name not in keep):
            continue
        if a.tiny and "--compile" in flags:
            continue  # torch.compile on the CPU takes minutes: not what --tiny checks
        c = dict(sizes_of[case])
        if case == "c" and not a.tiny:
            c["layers"] = a.layers_c
            c["lr"] = a.lr_c or c["lr"]
            c["warmup"] = c["warmup"] if a.warmup_c < 0 else a.warmup_c
            c["steps"] = a.steps_c or c["steps"]
        elif a.steps:
            c["steps"] = a.steps
        c.setdefault("lr", a.lr)
        if "--graph" in flags:
            from blumodels.graph_step import WARMUP_STEPS

            if c["steps"] <= WARMUP_STEPS:
                p.error(f"case {case} run {name} captures its step after {WARMUP_STEPS} eager steps: it needs "
                        f"--steps > {WARMUP_STEPS}, got {c['steps']}")
        plan.append((case, name, fw, flags, c))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    results: dict = {}
    t_all = time.time()

    def write_doc() -> tuple[dict, dict]:
        """The results document, rewritten after every run (a later run's failure keeps the earlier ones)."""
        ratios, targets, loss_diff = _verdicts(results, a.layers_c, a.precision)
        # the GPU as the runs saw it (this process never opens a CUDA context of its own beside theirs)
        gpu = "cpu (--tiny)" if a.tiny else next((r["gpu"] for rs in results.values() for r in rs.values()
                                                  if r.get("gpu")), "unknown")
        doc = {"command": "python3 benchmarks/memory_gpt2.py " + " ".join(sys.argv[1:]), "commit": commit,
               "gpu": gpu, "precision": a.precision,
               "cases": {k: next((c for cs, _, _, _, c in plan if cs == k), sizes_of[k]) for k in only},
               "layers_c": a.layers_c, "results": results, "ratios": ratios, "targets": targets,
               "loss_diff": loss_diff, "wall_s": round(time.time() - t_all, 1)}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=1))
        return ratios, targets

    for case, name, fw, flags, c in plan:
        args = [x for k, v in c.items() for x in (f"--{k}", str(v))]
        cmd = [sys.executable, __file__, "--child", fw, *flags, *args, "--precision", a.precision,
               "--device", "cpu" if a.tiny else "cuda", "--allocator", a.allocator]
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=dict(os.environ))
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            r = json.loads(line[-1][7:]) if line else {"error": (proc.stderr or proc.stdout)[-3000:]}
        except subprocess.TimeoutExpired:
            r = {"error": f"timed out after {a.timeout} s"}
        r["wall_s"] = round(time.time() - t0, 1)
        r["flags"] = flags
        results.setdefault(case, {})[name] = r
        show = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                if k in ("peak_reserved_gib", "peak_allocated_gib", "tokens_per_s", "wall_s", "error")}
        show["losses"] = [round(x, 4) for x in r.get("losses", [])]
        print(case, name, json.dumps(show), flush=True)
        write_doc()
    ratios, targets = write_doc()
    print("ratios", json.dumps(ratios, indent=1))
    print("targets", json.dumps({k: v.get("met") for k, v in targets.items()}))


if __name__ == "__main__":
    main()
