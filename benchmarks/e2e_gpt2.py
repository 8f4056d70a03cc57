"""GPT-2 124M training step: BluTrain and PyTorch side by side on one GPU, per precision mode.

    pip install packages/blutensor[cuda13] packages/blublas packages/bluallocator packages/blumodels
    python3 benchmarks/e2e_gpt2.py --out benchmarks/results/e2e_gpt2_h200.json          # single-step harness
    blutrain prepare --out /tmp/gpt2data --corpus pydocs --tokenizer bpe --vocab-size 4096 --max-bytes 12000000
    python3 benchmarks/e2e_gpt2.py --suite recipe --data /tmp/gpt2data --recipe-steps 5 \
        --only trainer_tf32,blutrain_tf32_graph,torch_eager_tf32_accum,torch_compile_tf32_accum \
        --out benchmarks/results/e2e_gpt2_recipe_tf32_h200.json           # likewise fp32, bf16

Every configuration runs in its own subprocess (CuPy reads CUPY_TF32 at import; torch.compile caches),
from the same initial weights (BluTrain's, copied into the PyTorch model) and the same batches (bytes of
the Python standard library's source as tokens). Reported: tokens/s (median of timed steps), step ms,
peak memory, per-step losses; ratios BluTrain / PyTorch are computed from this one run.

``--suite recipe`` runs what ``blutrain train --preset gpt2-124m`` runs: the Trainer with the preset's
524,288-token batches (32 micro-steps of 16x1024), captured by default, beside PyTorch eager and
torch.compile doing the same accumulation, and the single-step captured harness (the same step, one
micro-batch) that the Trainer's tokens/s is held to. The Trainer reads its tokens from ``--data``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def corpus_tokens(n: int) -> np.ndarray:
    """n tokens: the bytes of the stdlib's .py files (deterministic order), as int64 (shared by the benchmarks)."""
    out, total = [], 0
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        b = np.frombuffer(p.read_bytes(), dtype=np.uint8)
        out.append(b)
        total += b.size
        if total >= n:
            break
    return np.resize(np.concatenate(out), n).astype(np.int64)  # repeated when the files hold fewer than n


def batches(B: int, T: int, steps: int):
    toks = corpus_tokens(B * (T + 1) * steps + 1)
    for s in range(steps):
        chunk = toks[s * B * (T + 1):(s + 1) * B * (T + 1)].reshape(B, T + 1)
        yield chunk[:, :-1], chunk[:, 1:]


def config(n_layer):
    from blumodels.config import ModelConfig

    return ModelConfig(n_layer=n_layer, n_head=12, d_model=768, block_size=1024, vocab_size=50257)


def run_blutrain(a) -> dict:
    import blutensor as bt
    import cupy
    from blumodels.gpt2 import build_model

    if a.allocator == "caching":
        import bluallocator

        alloc = bluallocator.install()
    bt.set_matmul_precision(a.precision if a.precision != "bf16" else "fp32")
    if a.gemm:
        bt.set_gemm_provider(a.gemm)
    model = build_model(config(a.layers), device="cuda", seed=0)
    groups = model.param_groups(0.1)
    opt = bt.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True if a.fused else None)
    losses, times, cap = [], [], None
    from blumodels.graph_step import CapturedStep
    from blumodels.step import TrainStep

    amp = (lambda: bt.autocast("cuda", dtype=bt.bfloat16)) if a.precision == "bf16" else None
    # the Trainer's step (blumodels.step): the same phases eagerly, or captured after 2 eager warm-up steps
    step = TrainStep(model, opt, list(model.parameters()), device="cuda", lr_schedule=[6e-4] * a.steps,
                     grad_clip=1.0, autocast=amp, fused=bool(a.fused))
    step.precast_accumulate = True
    for s, (x, y) in enumerate(batches(a.batch, a.seq, a.steps)):
        xi, yi = bt.tensor(x, device="cuda"), bt.tensor(y, device="cuda")
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        if a.graph and s >= 2 and cap is None:  # --graph: 2 eager warm-up steps, then the captured step
            cap = CapturedStep(step, tuple(xi.shape))
            cap.capture()
            cupy.cuda.Device().synchronize()
            t0 = time.perf_counter()
        (cap or step).run(lambda b=(xi, yi): b, 6e-4)
        losses.append(step.read().loss)  # the one host read per step (it synchronises)
        cupy.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
    mem = {}
    if a.allocator == "caching":
        st = alloc.memory_stats()
        mem = {"peak_allocated_gib": st["peak_allocated_bytes"] / 2**30,
               "peak_reserved_gib": st["peak_reserved_bytes"] / 2**30}
    else:
        mem = {"pool_reserved_gib": cupy.get_default_memory_pool().total_bytes() / 2**30}
    from blutensor.ext import pick_attention_variant

    attn = pick_attention_variant(np.dtype(np.uint16 if a.precision == "bf16" else np.float32), 64)
    return {"losses": losses, "step_s": times, "attention_variant": attn, **mem}


def run_trainer(a) -> dict:
    """The path users run: ``blutrain train --preset gpt2-124m`` (its 524,288-token batches: 32 micro-steps of
    16x1024 on one GPU) through the Trainer, with only the run's length, precision and data shortened/pointed."""
    from blumodels.config import apply_overrides, load_preset
    from blumodels.trainer import Trainer

    cfg = apply_overrides(load_preset("gpt2-124m"), [
        f"train.steps={a.steps}", f"train.precision={a.precision}", f"data.dir={a.data}", "train.eval_interval=0",
        "train.checkpoint_interval=0", "train.sample_tokens=0", "train.plot=false", "train.warmup_steps=1"])
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"e2e-trainer-{a.precision}"
    tr = Trainer(cfg, out, quiet=True, overwrite=True)
    tr.fit(save_final=False)
    tr.close()
    h = tr.history
    return {"losses": [r["loss"] for r in h], "step_s": [r["step_ms"] / 1e3 for r in h],
            "captured_steps": sum(bool(r.get("cuda_graph")) for r in h), "grad_accum": cfg.grad_accum,
            "tokens_per_step": cfg.train.batch_tokens,
            "peak_allocated_gib": (h[-1].get("peak_allocated_bytes") or 0) / 2**30,
            "peak_reserved_gib": (h[-1].get("peak_reserved_bytes") or 0) / 2**30}


def run_torch(a) -> dict:
    from blumodels.gpt2 import build_model

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from torch_gpt2 import from_blutrain, train_torch

    model = from_blutrain(build_model(config(a.layers), device="cpu", seed=0))
    return train_torch(model, batches(a.batch, a.seq, a.steps * a.accum), 6e-4, a.compile, a.precision, a.accum)


def summarize(r: dict, a) -> dict:
    t = sorted(r["step_s"][a.warmup:]) or sorted(r["step_s"])
    med = t[len(t) // 2]
    r["median_step_ms"] = med * 1e3
    r["tokens_per_s"] = r.get("tokens_per_step", a.batch * a.seq * a.accum) / med
    return r


def child(a) -> None:
    try:
        r = {"blutrain": run_blutrain, "trainer": run_trainer, "torch": run_torch}[a.framework](a)
        r = summarize(r, a)
    except Exception as e:  # noqa: BLE001 - the driver records the failure
        import traceback

        r = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(r), flush=True)


RUNS = [  # (name, framework, precision, compile, options: env vars, or child flags when the key starts with "-")
    ("torch_eager_fp32", "torch", "fp32", False, {}),
    ("torch_compile_fp32", "torch", "fp32", True, {}),
    # PyTorch fp32 on cuBLASLt instead of cuBLAS: two valid fp32 configurations of the reference itself, whose
    # loss difference is the noise floor of the "within 1e-4 of PyTorch fp32" criterion
    ("torch_eager_fp32_lt", "torch", "fp32", False, {"TORCH_BLAS_PREFER_CUBLASLT": "1"}),
    ("blutrain_fp32", "blutrain", "fp32", False, {"--fused": ""}),
    ("blutrain_fp32_cublas", "blutrain", "fp32", False, {"--fused": "", "--gemm": "cublas"}),
    # fp32-accurate GEMMs emulated on the TF32 tensor cores (split hi/lo, 3 products; blublas.split_tf32)
    ("blutrain_fp32_3xtf32", "blutrain", "fp32", False,
     {"--fused": "", "--gemm": "cublas", "BLUTRAIN_FP32_GEMM": "3xtf32"}),
    ("blutrain_fp32_3xtf32_graph", "blutrain", "fp32", False,
     {"--fused": "", "--gemm": "cublas", "--graph": "", "BLUTRAIN_FP32_GEMM": "3xtf32"}),
    # the same with the two-GEMM split (small terms in their own GEMM: tensor-core accumulation keeps their bits)
    ("blutrain_fp32_3xtf32two", "blutrain", "fp32", False,
     {"--fused": "", "--gemm": "cublas", "BLUTRAIN_FP32_GEMM": "3xtf32", "BLUBLAS_3XTF32": "two"}),
    ("blutrain_fp32_3xtf32two_graph", "blutrain", "fp32", False,
     {"--fused": "", "--gemm": "cublas", "--graph": "", "BLUTRAIN_FP32_GEMM": "3xtf32", "BLUBLAS_3XTF32": "two"}),
    ("blutrain_fp32_blublas", "blutrain", "fp32", False, {"--fused": "", "--gemm": "blublas"}),
    ("blutrain_fp32_xp", "blutrain", "fp32", False, {"--fused": "", "--gemm": "xp"}),
    ("blutrain_fp32_caching", "blutrain", "fp32", False, {"--fused": "", "--allocator": "caching"}),
    ("torch_eager_tf32", "torch", "tf32", False, {}),
    ("torch_compile_tf32", "torch", "tf32", True, {}),
    ("blutrain_tf32", "blutrain", "tf32", False, {"--fused": "", "CUPY_TF32": "1"}),
    ("blutrain_tf32_graph", "blutrain", "tf32", False,
     {"--fused": "", "CUPY_TF32": "1", "--graph": "", "--gemm": "cublas"}),
    # the same step on BluBLAS's own GEMM kernels (sm_90a TMA wgmma) instead of cuBLASLt
    ("blutrain_tf32_graph_blublas", "blutrain", "tf32", False,
     {"--fused": "", "CUPY_TF32": "1", "--graph": "", "--gemm": "blublas"}),
    ("blutrain_fp32_graph", "blutrain", "fp32", False, {"--fused": "", "--graph": "", "--gemm": "cublas"}),
    ("blutrain_fp32_simt_attn_graph", "blutrain", "fp32", False,
     {"--fused": "", "--graph": "", "--gemm": "cublas", "BLUTRAIN_SDPA_FP32": "simt"}),
    ("blutrain_fp32_tf32x3_attn_graph", "blutrain", "fp32", False,
     {"--fused": "", "--graph": "", "--gemm": "cublas", "BLUTRAIN_SDPA_FP32": "tf32x3"}),
    # fp32 storage, fp32-accurate arithmetic on the tensor cores: 3xTF32 GEMMs (long reductions, K > 4096, strict:
    # BLUTRAIN_3XTF32_MAX_K) and 3xTF32 attention, the whole step in a CUDA graph
    ("blutrain_fp32_x3_graph", "blutrain", "fp32", False,
     {"--fused": "", "--graph": "", "--gemm": "cublas", "BLUTRAIN_FP32_GEMM": "3xtf32",
      "BLUTRAIN_SDPA_FP32": "tf32x3"}),
    ("torch_eager_bf16", "torch", "bf16", False, {}),
    ("torch_compile_bf16", "torch", "bf16", True, {}),
    ("blutrain_bf16", "blutrain", "bf16", False, {"--fused": "", "--gemm": "cublas"}),
    ("blutrain_bf16_graph", "blutrain", "bf16", False, {"--fused": "", "--graph": "", "--gemm": "cublas"}),
    ("blutrain_bf16_graph_blublas", "blutrain", "bf16", False, {"--fused": "", "--graph": "", "--gemm": "blublas"}),
]


#: --suite recipe: the shipped recipe (32 micro-steps of 16x1024 per step) through the Trainer beside PyTorch doing
#: the same accumulation, and the single-step captured harness it is held to (within 3%)
RECIPE = [
    ("torch_eager_fp32_accum", "torch", "fp32", False, {"--accum": "32"}),
    ("torch_compile_fp32_accum", "torch", "fp32", True, {"--accum": "32"}),
    ("trainer_fp32", "trainer", "fp32", False, {}),
    ("blutrain_fp32_graph", "blutrain", "fp32", False, {"--fused": "", "--graph": "", "--gemm": "cublas"}),
    ("torch_eager_tf32_accum", "torch", "tf32", False, {"--accum": "32"}),
    ("torch_compile_tf32_accum", "torch", "tf32", True, {"--accum": "32"}),
    ("trainer_tf32", "trainer", "tf32", False, {"CUPY_TF32": "1"}),
    ("blutrain_tf32_graph", "blutrain", "tf32", False,
     {"--fused": "", "CUPY_TF32": "1", "--graph": "", "--gemm": "cublas"}),
    ("torch_eager_bf16_accum", "torch", "bf16", False, {"--accum": "32"}),
    ("torch_compile_bf16_accum", "torch", "bf16", True, {"--accum": "32"}),
    ("trainer_bf16", "trainer", "bf16", False, {}),
    ("blutrain_bf16_graph", "blutrain", "bf16", False, {"--fused": "", "--graph": "", "--gemm": "cublas"}),
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", action="store_true")
    p.add_argument("--framework", default="blutrain")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--fused", action="store_true")
    p.add_argument("--graph", action="store_true", help="BluTrain: capture the whole step in one CUDA graph")
    p.add_argument("--allocator", default="cupy-default")
    p.add_argument("--gemm", default="", help="BluTrain GEMM provider (default: the plugin host's choice)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--accum", type=int, default=1, help="PyTorch: micro-steps per step (gradient accumulation)")
    p.add_argument("--data", default="", help="trainer runs: a prepared data directory (blutrain prepare)")
    p.add_argument("--suite", default="harness", choices=("harness", "recipe"))
    p.add_argument("--recipe-steps", type=int, default=6, help="--suite recipe: optimisation steps per run")
    p.add_argument("--only", default="")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "e2e_gpt2.json"))
    a = p.parse_args()
    if a.child:
        return child(a)
    runs = list(RUNS if a.suite == "harness" else RECIPE)
    if a.only:
        runs = [r for r in runs if r[0] in a.only.split(",")]
    results = {}
    prec_of = {r[0]: r[2] for r in RUNS + RECIPE}
    if a.suite == "recipe":
        a.steps, a.warmup = a.recipe_steps, 3  # per run: 2 eager warm-up steps, the capture, then timed steps
        refs = {p: (f"torch_compile_{p}_accum", f"torch_eager_{p}_accum", f"blutrain_{p}_graph")
                for p in ("fp32", "tf32", "bf16")}
        loss_refs = {p: (f"torch_eager_{p}_accum",) for p in ("fp32", "tf32", "bf16")}
    else:
        refs = {"fp32": ("torch_compile_fp32", "torch_eager_fp32"),
                "tf32": ("torch_compile_tf32", "torch_eager_tf32"),
                "bf16": ("torch_compile_bf16", "torch_eager_bf16")}
        loss_refs = {"fp32": ("torch_eager_fp32",), "tf32": ("torch_eager_tf32", "torch_compile_tf32"),
                     "bf16": ("torch_eager_bf16",)}

    def write_doc():
        """Ratios (tokens/s, BluTrain / PyTorch, same run) and per-step loss differences; rewritten after every run."""
        ratios, loss_diff = {}, {}
        for ours, r in results.items():
            if "tokens_per_s" not in r:
                continue
            if ours.startswith(("blutrain", "trainer")):
                for ref in refs[prec_of[ours]]:
                    if ref != ours and results.get(ref, {}).get("tokens_per_s"):
                        ratios[f"{ours}/{ref}"] = r["tokens_per_s"] / results[ref]["tokens_per_s"]
            # PyTorch runs other than the reference too: their difference from it is the criterion's noise floor
            ref = next((x for x in loss_refs[prec_of[ours]] if "losses" in results.get(x, {})), None)
            if a.suite == "recipe" and ours.startswith(("blutrain", "trainer")):
                ref = None  # the Trainer reads the prepared corpus and the harness one micro-batch: other losses
            if ref and ref != ours and "losses" in r:
                d = [abs(x - y) for x, y in zip(r["losses"], results[ref]["losses"])]
                r[f"abs_loss_diff_vs_{ref}"] = d
                loss_diff[f"{ours}/{ref}"] = {"max": max(d), "steps": len(d), "median": sorted(d)[len(d) // 2],
                                              "steps_above_1e-4": sum(x > 1e-4 for x in d)}
        import cupy

        doc = {"command": "python3 benchmarks/e2e_gpt2.py " + " ".join(sys.argv[1:]),
               "gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cupy": cupy.__version__,
               "python": platform.python_version(), "config": {"model": "gpt2-124m", "batch": a.batch, "seq": a.seq,
                                                              "layers": a.layers, "steps": a.steps, "warmup": a.warmup},
               "results": results, "ratios_tokens_per_s": ratios, "max_abs_loss_diff": loss_diff}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=1))
        return ratios, loss_diff

    for name, fw, prec, comp, env in runs:
        cmd = [sys.executable, __file__, "--child", "--framework", fw, "--precision", prec, "--batch", str(a.batch),
               "--seq", str(a.seq), "--layers", str(a.layers), "--steps", str(a.steps), "--warmup", str(a.warmup),
               "--data", a.data]
        if comp:
            cmd.append("--compile")
        for k, v in env.items():
            if k.startswith("-"):
                cmd += [k, v] if v else [k]
        t0 = time.time()
        child_env = {**os.environ, **{k: v for k, v in env.items() if not k.startswith("-")}}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env, timeout=900)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        results[name] = json.loads(line[-1][7:]) if line else {"error": proc.stderr[-3000:]}
        results[name]["wall_s"] = round(time.time() - t0, 1)
        print(name, {k: results[name].get(k) for k in ("tokens_per_s", "median_step_ms", "peak_reserved_gib",
                                                        "peak_allocated_gib", "error")}, flush=True)
        write_doc()
    ratios, loss_diff = write_doc()
    print("ratios", json.dumps(ratios), "loss diff", loss_diff)


if __name__ == "__main__":
    main()
