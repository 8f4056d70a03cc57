"""Memory-lean training on one GPU: BluTrain vs PyTorch, side by side in one run.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 benchmarks/memory_gpt2.py \
        --out benchmarks/results/memory_gpt2_h200.json [--only a,b,c]

(a) GPT-2 124M, B=16, T=1024, fp32: peak allocated/reserved of BluTrain (memory-lean options) vs
    PyTorch eager and torch.compile.
(b) GPT-2 124M, B=2, T=16384 (block_size 16384), fp32: peak memory and tokens/s vs PyTorch eager.
(c) d_model=3072, 24 heads, B=2, T=1024, fp32 with --layers L: BluTrain trains 3 steps (loss must fall).
Each case runs in its own subprocess so peaks do not mix. BluTrain's memory comes from bluallocator's
statistics (it is installed as CuPy's allocator for these runs); PyTorch's from torch.cuda.
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


def cfg(layers, d, heads, block):
    from blumodels.config import ModelConfig

    return ModelConfig(n_layer=layers, n_head=heads, d_model=d, block_size=block, vocab_size=50257)


def blutrain(a) -> dict:
    import bluallocator
    import blutensor as bt
    import cupy
    from blumodels.gpt2 import build_model
    from blutensor.utils import OptimizerInBackward, checkpoint_modules
    from e2e_gpt2 import batches

    alloc = bluallocator.install()
    model = build_model(cfg(a.layers, a.d, a.heads, a.seq), device="cuda", seed=0)
    if a.recompute:
        checkpoint_modules(model, "blocks.*")
    opt = bt.optim.AdamW(model.param_groups(0.1), lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
                         fused=True if a.fused else None)
    if a.oib:
        opt = OptimizerInBackward(opt)
    losses, times = [], []
    alloc.reset_peak_stats()
    for i, (x, y) in enumerate(batches(a.batch, a.seq, a.steps)):
        xi, yi = bt.tensor(x, device="cuda"), bt.tensor(y, device="cuda")
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        _, loss = model(xi, yi)
        loss.backward()
        if not a.oib:
            bt.optim.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        cupy.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.item()))
        if i == 0:
            alloc.flush_after_step0()
    st = alloc.memory_stats()
    return {"losses": losses, "step_s": times, "peak_allocated_gib": st["peak_allocated_bytes"] / 2**30,
            "peak_reserved_gib": st["peak_reserved_bytes"] / 2**30,
            "params_b": sum(p.numel() for p in model.parameters()) / 1e9}


def torch_run(a) -> dict:
    from blumodels.gpt2 import build_model
    from e2e_gpt2 import batches
    from torch_gpt2 import from_blutrain, train_torch

    model = from_blutrain(build_model(cfg(a.layers, a.d, a.heads, a.seq), device="cpu", seed=0))
    return train_torch(model, batches(a.batch, a.seq, a.steps), a.lr, a.compile)


CASES = {
    "a": dict(batch=16, seq=1024, layers=12, d=768, heads=12, steps=6),
    "b": dict(batch=2, seq=16384, layers=12, d=768, heads=12, steps=5),
    "c": dict(batch=2, seq=1024, layers=80, d=3072, heads=24, steps=3),
}
RUNS = [  # (case, name, framework, flags)
    ("a", "torch_eager", "torch", []),
    ("a", "torch_compile", "torch", ["--compile"]),
    ("a", "blutrain_lean", "blutrain", ["--recompute", "--oib"]),
    ("a", "blutrain_plain", "blutrain", []),
    ("b", "torch_eager", "torch", []),
    ("b", "blutrain_lean", "blutrain", ["--recompute", "--oib"]),
    ("c", "blutrain_lean", "blutrain", ["--recompute", "--oib"]),
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", default="")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--oib", action="store_true")
    p.add_argument("--fused", action="store_true")
    p.add_argument("--lr", type=float, default=3e-4)
    for k in ("batch", "seq", "layers", "d", "heads", "steps"):
        p.add_argument(f"--{k}", type=int, default=0)
    p.add_argument("--layers-c", type=int, default=80)
    p.add_argument("--only", default="a,b,c")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory_gpt2.json"))
    a = p.parse_args()
    if a.child:
        try:
            r = blutrain(a) if a.child == "blutrain" else torch_run(a)
            t = sorted(r["step_s"][1:] or r["step_s"])
            r["tokens_per_s"] = a.batch * a.seq / t[len(t) // 2]
        except Exception as e:  # noqa: BLE001
            import traceback

            r = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        print("RESULT " + json.dumps(r), flush=True)
        return
    results: dict = {}
    only = set(a.only.split(","))
    for case, name, fw, flags in RUNS:
        if case not in only:
            continue
        c = dict(CASES[case])
        if case == "c":
            c["layers"] = a.layers_c
        sizes = [x for k, v in c.items() for x in (f"--{k}", str(v))]
        cmd = [sys.executable, __file__, "--child", fw, *flags, "--lr", str(a.lr), *sizes]
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ))
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        r = json.loads(line[-1][7:]) if line else {"error": proc.stderr[-3000:]}
        r["wall_s"] = round(time.time() - t0, 1)
        r["flags"] = flags
        results.setdefault(case, {})[name] = r
        print(case, name, {k: r.get(k) for k in ("peak_reserved_gib", "peak_allocated_gib", "tokens_per_s",
                                                 "losses", "error")}, flush=True)
    ratios = {}
    for case, ref in (("a", "torch_eager"), ("a", "torch_compile"), ("b", "torch_eager")):
        ours, theirs = results.get(case, {}).get("blutrain_lean", {}), results.get(case, {}).get(ref, {})
        for k in ("peak_reserved_gib", "peak_allocated_gib", "tokens_per_s"):
            if ours.get(k) and theirs.get(k):
                ratios[f"{case}:{k}:blutrain_lean/{ref}"] = ours[k] / theirs[k]
    import cupy

    doc = {"command": "PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 " + " ".join(sys.argv),
           "gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cases": CASES, "results": results,
           "ratios": ratios}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print("ratios", json.dumps(ratios, indent=1))


if __name__ == "__main__":
    main()
