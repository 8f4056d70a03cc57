"""blu-contraction: classify every matmul by arithmetic intensity and route it to a GEMM provider.

Annotates ``blu.matmul`` with ``m``, ``n``, ``k``, ``batch``, ``flops``, ``intensity`` (flop/byte),
``class`` ("compute" above the ridge point, else "memory"), ``provider`` ("gemm": the GEMM provider;
"gemv": matrix-vector shapes) and ``epilogue``: the id of the fused elementwise kernel that is the
result's only consumer (bias add, residual add, scaling), run right after the GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.passes import ModulePass

from blucompiler.dialect import attrs_of, to_attr
from blucompiler.passes.common import body, dtype_of, kind, shape_of, users

#: flop/byte above which a GEMM is compute-bound (H200 fp32 SIMT: ~67 TFLOP/s over ~4.8 TB/s)
RIDGE = 14.0


def classify(a_shape, b_shape, out_shape, ta: bool, tb: bool, itemsize: int) -> dict:
    m = a_shape[-1] if ta else (a_shape[-2] if len(a_shape) >= 2 else 1)
    k = (a_shape[-2] if ta else a_shape[-1])
    n = (b_shape[-2] if tb else b_shape[-1]) if len(b_shape) >= 2 else 1
    batch = 1
    for s in out_shape[:-2]:
        batch *= s
    flops = 2 * batch * m * n * k
    size = lambda s: int(__import__("math").prod(s))  # noqa: E731
    nbytes = itemsize * (size(a_shape) + size(b_shape) + size(out_shape))
    ai = flops / max(nbytes, 1)
    return {"m": int(m), "n": int(n), "k": int(k), "batch": int(batch), "flops": int(flops),
            "intensity": round(ai, 3), "class": "compute" if ai >= RIDGE else "memory",
            "provider": "gemm" if min(m, n) > 1 else "gemv"}


@dataclass(frozen=True)
class ContractionPass(ModulePass):
    name = "blu-contraction"

    def apply(self, ctx, op) -> None:
        for o in body(op).ops:
            if kind(o) != "matmul":
                continue
            at = attrs_of(o)
            info = classify(shape_of(o.operands[0]), shape_of(o.operands[1]), shape_of(o.results[0]),
                            at.get("ta", False), at.get("tb", False), dtype_of(o.results[0]).itemsize)
            us = users(o.results[0])
            if len(us) == 1 and us[0].name == "blu.fused" and attrs_of(us[0]).get("kind") == "elementwise":
                info["epilogue"] = attrs_of(us[0])["id"]
            for k, v in info.items():
                o.attributes[k] = to_attr(v)
