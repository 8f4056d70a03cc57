"""GPT-2 training step on the CPU: BluTrain and the same model in PyTorch side by side, in one process.

    .venv/bin/python benchmarks/cpu_gpt2.py --out benchmarks/results/cpu_gpt2.json

Both sides start from the same weights (BluTrain's, copied into benchmarks/torch_gpt2.TorchGPT2) and see the
same batches (bytes of the Python standard library's source as tokens); a step is forward, loss, backward,
clip_grad_norm_(1.0) and AdamW (PyTorch: fused=True, its fastest CPU AdamW). Configurations: the ``blutrain
train --preset tiny`` shapes (4 layers, d 128, T 128, B 16) and a larger one (6 layers, d 384, T 256, B 8); each
at 1 thread and at all the cores this process may use (``bt.set_num_threads`` / ``torch.set_num_threads``).

Timing on a shared machine is noisy, so the two sides run in alternating blocks (which side goes first
alternates too), each block a few steps; reported per side: the median step time over all timed steps, and the
BluTrain / PyTorch speed ratio as the median of the per-block ratios (torch ms / BluTrain ms, > 1: BluTrain
faster). The load average before and after each configuration is recorded as the contention note, and beside
the wall times each side's median CPU time per step, of all its threads (``*_cpu_ms``) and of the main thread
(``*_main_thread_ms``: with the work split evenly, about the wall time on an idle machine), which other
processes on the machine disturb much less than the wall clock. The first
steps' losses of both sides are recorded to show they train the same model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from e2e_gpt2 import corpus_tokens  # noqa: E402  (the benchmarks' shared token source)

CONFIGS = {
    "tiny": dict(n_layer=4, n_head=4, d_model=128, block_size=128, vocab_size=1024, B=16, T=128),
    "larger": dict(n_layer=6, n_head=6, d_model=384, block_size=256, vocab_size=1024, B=8, T=256),
}


def make_batches(B: int, T: int, n: int) -> list:
    toks = corpus_tokens(B * (T + 1) * n + 1)
    res = []
    for s in range(n):
        c = toks[s * B * (T + 1):(s + 1) * B * (T + 1)].reshape(B, T + 1)
        res.append((np.ascontiguousarray(c[:, :-1]), np.ascontiguousarray(c[:, 1:])))
    return res


class BluSide:
    def __init__(self, cfg: dict, seed: int):
        import blutensor as bt
        from blumodels.config import ModelConfig
        from blumodels.gpt2 import build_model

        self.bt = bt
        mc = ModelConfig(n_layer=cfg["n_layer"], n_head=cfg["n_head"], d_model=cfg["d_model"],
                         block_size=cfg["block_size"], vocab_size=cfg["vocab_size"], dropout=0.0)
        self.model = build_model(mc, seed=seed)
        self.params = list(self.model.parameters())
        self.opt = bt.optim.AdamW(self.model.param_groups(0.1), lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.1)

    def step(self, x, y) -> float:
        bt = self.bt
        _, loss = self.model(bt.from_numpy(x), bt.from_numpy(y))
        loss.backward()
        bt.optim.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad()
        return float(loss.item())


class TorchSide:
    def __init__(self, blu_model):
        import torch
        from torch_gpt2 import from_blutrain

        self.torch = torch
        self.model = from_blutrain(blu_model, device="cpu")
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        rest = [p for p in self.model.parameters() if p.ndim < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                     lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)

    def step(self, x, y) -> float:
        torch = self.torch
        loss = self.model(torch.from_numpy(x), torch.from_numpy(y))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.item())


def run_config(name: str, threads: int, blocks: int, per_block: int, warmup: int) -> dict:
    import blutensor as bt
    import torch

    cfg = CONFIGS[name]
    bt.set_num_threads(threads)
    torch.set_num_threads(threads)
    blu = BluSide(cfg, seed=1234)
    tor = TorchSide(blu.model)
    batches = make_batches(cfg["B"], cfg["T"], warmup + blocks * per_block)
    load0 = os.getloadavg()
    first = [(blu.step(*b), tor.step(*b)) for b in batches[:warmup]]  # same weights and batches: same losses
    times = {"blutrain": [], "torch": []}
    cpu = {"blutrain": [], "torch": []}  # process CPU time per step (all threads) and the main thread's
    main = {"blutrain": [], "torch": []}
    ratios = []
    it = warmup
    for k in range(blocks):
        order = [("blutrain", blu), ("torch", tor)] if k % 2 == 0 else [("torch", tor), ("blutrain", blu)]
        block = {}
        for side, obj in order:
            ts = []
            for b in batches[it:it + per_block]:
                t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
                obj.step(*b)
                ts.append(time.perf_counter() - t0)
                cpu[side].append(time.process_time() - c0)
                main[side].append(time.thread_time() - m0)
            block[side] = statistics.median(ts)
            times[side] += ts
        it += per_block
        ratios.append(block["torch"] / block["blutrain"])
    load1 = os.getloadavg()
    med = {s: statistics.median(v) * 1e3 for s, v in times.items()}
    return {"config": name, "threads": threads, **{k: v for k, v in cfg.items()},
            "blutrain_ms": round(med["blutrain"], 2), "torch_ms": round(med["torch"], 2),
            "ratio_blutrain_vs_torch": round(statistics.median(ratios), 3),
            **{f"{s}_cpu_ms": round(statistics.median(v) * 1e3, 2) for s, v in cpu.items()},
            **{f"{s}_main_thread_ms": round(statistics.median(v) * 1e3, 2) for s, v in main.items()},
            "block_ratios": [round(r, 3) for r in ratios],
            "first_losses": [[round(a, 6), round(b, 6)] for a, b in first],
            "loadavg_before_after": [round(load0[0], 2), round(load1[0], 2)]}


def cold_build_s() -> float | None:
    """Seconds to build the CPU kernel library into an empty cache (a fresh process; the first-use cost)."""
    with tempfile.TemporaryDirectory() as d:
        code = ("import time; t=time.perf_counter(); from blutensor.ext import cpu_kernels_status as status; "
                "s=status(); print(time.perf_counter()-t if s['available'] else -1)")
        r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "BLUTRAIN_CPU_CACHE": d},
                           capture_output=True, text=True, check=True)
        v = float(r.stdout.strip().splitlines()[-1])
        return round(v, 3) if v >= 0 else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="tiny,larger")
    ap.add_argument("--threads", default="1,all", help="comma list of thread counts; 'all' = the usable cores")
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--per-block", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import blutensor as bt
    import torch

    cores = len(os.sched_getaffinity(0))
    threads = sorted({cores if t == "all" else int(t) for t in a.threads.split(",")})
    rows = []
    for name in a.configs.split(","):
        for n in threads:
            r = run_config(name, n, a.blocks, a.per_block, a.warmup)
            print(json.dumps({k: r[k] for k in ("config", "threads", "blutrain_ms", "torch_ms",
                                                "ratio_blutrain_vs_torch", "blutrain_main_thread_ms",
                                                "torch_main_thread_ms", "loadavg_before_after")}), flush=True)
            rows.append(r)
    from blutensor.ext import cpu_kernels_status as status

    out = {
        "command": "python benchmarks/cpu_gpt2.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "what": "ms per training step (forward, loss, backward, clip, AdamW), median over alternating blocks; "
                "ratio = median over blocks of torch_ms / blutrain_ms (> 1: BluTrain faster)",
        "rows": rows,
        "cpu_kernels": {k: v for k, v in status().items() if k != "path"},
        "cold_build_s": cold_build_s(),
        "machine": {"cpu": platform.processor() or platform.machine(), "usable_cores": cores,
                    "os_cpu_count": os.cpu_count(), "python": platform.python_version(),
                    "numpy": np.__version__, "torch": torch.__version__, "blutensor": bt.__version__},
        "contention": "the machine is shared; the load average (1 min) before and after each row is in "
                      "loadavg_before_after; ratios come from alternating blocks so both sides see the same load",
    }
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
