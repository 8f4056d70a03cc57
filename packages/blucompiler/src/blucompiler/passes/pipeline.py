"""The ordered pass pipeline; ``BLU_COMPILER_DUMP=dir`` writes the MLIR text after every pass."""

from __future__ import annotations

import os
import time
from pathlib import Path

from blucompiler.dialect import context, print_ir
from blucompiler.passes.buffers import BufferPass
from blucompiler.passes.contraction import ContractionPass
from blucompiler.passes.cse import CSEPass
from blucompiler.passes.dce import DCEPass
from blucompiler.passes.fuse_elementwise import FuseElementwisePass
from blucompiler.passes.fuse_reduction import FuseReductionPass
from blucompiler.passes.layout import LayoutPass
from blucompiler.passes.simplify import SimplifyPass

#: (name, pass) in the order they run
PIPELINE = (
    ("simplify", SimplifyPass()),
    ("cse", CSEPass()),
    ("dce", DCEPass()),
    ("layout", LayoutPass()),
    ("cse-2", CSEPass()),
    ("dce-2", DCEPass()),
    ("fuse-reduction", FuseReductionPass()),
    ("dce-3", DCEPass()),
    ("fuse-elementwise", FuseElementwisePass()),
    ("contraction", ContractionPass()),
    ("buffers", BufferPass()),
)
PASSES = {p.name: p for _, p in PIPELINE}


def run_pipeline(mod, dump: str | None = None, only: tuple[str, ...] | None = None) -> dict:
    """Run the pipeline on ``mod`` in place; return per-pass timings (s) and op counts."""
    dump = dump if dump is not None else os.environ.get("BLU_COMPILER_DUMP")
    ctx = context()
    out = Path(dump) if dump else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "00-traced.mlir").write_text(print_ir(mod))
    stats = {}
    for i, (label, p) in enumerate(PIPELINE, 1):
        if only is not None and p.name not in only and label not in only:
            continue
        t = time.perf_counter()
        p.apply(ctx, mod)
        stats[label] = {"seconds": round(time.perf_counter() - t, 4), "ops": _count(mod)}
        if out is not None:
            (out / f"{i:02d}-{label}.mlir").write_text(print_ir(mod))
    mod.verify()
    return stats


def _count(mod) -> int:
    n = 0
    for o in mod.body.block.ops:
        if o.name == "func.func":
            n = len(list(o.regions[0].block.ops))
    return n
