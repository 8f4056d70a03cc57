"""Where the Trainer's device memory goes, phase by phase, on CUDA: bluallocator's counters after each step and
around the CUDA-graph capture, for a preset's recipe (default the shipped GPT-2 124M one, its accumulation) in one
precision.

    python benchmarks/memory_phases.py --data DIR --precision bf16 [--steps 4] [--out OUT.json]
    python benchmarks/memory_phases.py --data DIR --preset llama-1b --set train.batch_tokens=8192 --steps 4

Each phase reports allocated / reserved bytes at its end and its own peaks (the peaks restart at every phase),
plus the segment and private-pool counts: a reserved peak well above the allocated one says which phase holds
cached memory it does not use.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a prepared GPT-2 token directory (data.dir)")
    p.add_argument("--precision", default="bf16", choices=("fp32", "tf32", "bf16"))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--preset", default="gpt2-124m")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override after the preset's (repeatable), e.g. train.batch_tokens=8192")
    p.add_argument("--out", default=None, help="JSON file for the phases (default: print only)")
    a = p.parse_args(argv)
    from blumodels import graph_step
    from blumodels.config import apply_overrides, load_preset
    from blumodels.trainer import Trainer

    phases: list[dict] = []
    gib = 2**30
    holder: dict = {}

    def mark(name: str) -> None:
        alloc = getattr(holder.get("trainer") and holder["trainer"].memory, "alloc", None)
        if alloc is None:
            print(f"{name}: no bluallocator caching allocator installed (train.allocator = 'blu' on CUDA)")
            return
        st = alloc.memory_stats()
        row = {
            "phase": name,
            "allocated_gib": st["allocated_bytes"] / gib,
            "reserved_gib": st["reserved_bytes"] / gib,
            "peak_allocated_gib": st["peak_allocated_bytes"] / gib,
            "peak_reserved_gib": st["peak_reserved_bytes"] / gib,
            "cached_free_gib": st["cached_free_bytes"] / gib,
            "segments": st["segments"],
            "private_pools": st["private_pools"],
        }
        phases.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        alloc.reset_peak_stats()

    real_capture = graph_step.CapturedStep.capture

    def capture(self) -> None:
        mark("before capture (warm-up steps done, cache emptied)")
        real_capture(self)
        mark("capture")

    graph_step.CapturedStep.capture = capture
    cfg = apply_overrides(
        load_preset(a.preset),
        [
            f"train.steps={a.steps}",
            f"train.precision={a.precision}",
            f"data.dir={a.data}",
            "train.eval_interval=0",
            "train.checkpoint_interval=0",
            "train.sample_tokens=0",
            "train.plot=false",
            "train.warmup_steps=1",
            *a.set,
        ],
    )
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"memory-phases-{a.precision}"
    tr = holder["trainer"] = Trainer(cfg, out, quiet=True, overwrite=True)
    mark("model + optimizer state built")
    for s in range(a.steps):
        tr.fit(steps=s + 1, save_final=False)
        mark(f"step {s} ({'captured' if tr.history[-1].get('cuda_graph') else 'eager'})")
    tr.close()
    if a.out:
        command = "python " + " ".join(["benchmarks/memory_phases.py", *sys.argv[1:]])
        Path(a.out).write_text(
            json.dumps({"command": command, "precision": a.precision, "preset": a.preset, "overrides": a.set,
                        "phases": phases}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
