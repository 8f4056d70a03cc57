"""blu-fuse-reduction: each ``blu.reduce`` absorbs the elementwise ops of its input's shape that feed
it, cloned as its prologue (the values are recomputed inside the reduction loop, never stored)."""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.passes import ModulePass

from blucompiler.passes.common import _erase, body, is_elementwise, kind, producer, shape_of
from blucompiler.passes.fusion import make_fused, next_id

MAX_PROLOGUE = 48


@dataclass(frozen=True)
class FuseReductionPass(ModulePass):
    name = "blu-fuse-reduction"

    def apply(self, ctx, op) -> None:
        block = body(op)
        ops = list(block.ops)
        pos = {o: i for i, o in enumerate(ops)}
        n = int(next_id(op)[1:])
        for r in ops:
            if kind(r) != "reduce":
                continue
            dom = shape_of(r.operands[0])
            pro, stack = set(), [r.operands[0]]
            while stack and len(pro) < MAX_PROLOGUE:
                p = producer(stack.pop())
                if p is None or p in pro or not is_elementwise(p) or shape_of(p.results[0]) != dom:
                    continue
                pro.add(p)
                stack.extend(p.operands)
            members = sorted(pro, key=pos.__getitem__) + [r]
            f = make_fused(block, members, [r.results[0]], {"kind": "reduce", "domain": dom, "id": f"k{n}"}, r)
            n += 1
            r.results[0].replace_all_uses_with(f.results[0])
            _erase(r)
