"""blu-layout: layout and transpose folding.

* a transpose of the last two dims feeding a matmul becomes the matmul's ``ta``/``tb`` flag (the
  GEMM reads the operand transposed; no transposed copy is made);
* a broadcast feeding an elementwise op whose result has the broadcast shape is dropped (the
  fused kernel reads the operand with stride 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.passes import ModulePass
from xdsl.pattern_rewriter import (
    GreedyRewritePatternApplier,
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
)

from blucompiler.dialect import attrs_of, make_op
from blucompiler.graph import ELEMENTWISE
from blucompiler.passes.common import kind, producer, shape_of


def _swaps_last_two(perm) -> bool:
    n = len(perm)
    return n >= 2 and tuple(perm) == tuple(range(n - 2)) + (n - 1, n - 2)


class FoldTransposeIntoMatmul(RewritePattern):
    def match_and_rewrite(self, op, rewriter: PatternRewriter) -> None:
        if kind(op) != "matmul":
            return
        attrs = attrs_of(op)
        ops = list(op.operands)
        changed = False
        for i, flag in ((0, "ta"), (1, "tb")):
            p = producer(ops[i])
            if p is not None and kind(p) == "transpose" and _swaps_last_two(attrs_of(p)["perm"]) \
                    and len(shape_of(ops[i])) >= 2:
                ops[i] = p.operands[0]
                attrs[flag] = not attrs.get(flag, False)
                changed = True
        if changed:
            rewriter.replace(op, [make_op("matmul", ops, [op.results[0].type], attrs)])


class FoldBroadcastIntoElementwise(RewritePattern):
    def match_and_rewrite(self, op, rewriter: PatternRewriter) -> None:
        if kind(op) not in ELEMENTWISE:
            return
        out = shape_of(op.results[0])
        ops = list(op.operands)
        changed = False
        for i, v in enumerate(ops):
            p = producer(v)
            if p is not None and kind(p) == "broadcast" and shape_of(v) == out:
                src = p.operands[0]
                others = [shape_of(w) for j, w in enumerate(ops) if j != i]
                if len(shape_of(src)) <= len(out) and any(s == out for s in others):
                    ops[i] = src
                    changed = True
        if changed:
            new = make_op(kind(op), ops, [op.results[0].type], attrs_of(op))
            rewriter.replace(op, [new])


@dataclass(frozen=True)
class LayoutPass(ModulePass):
    name = "blu-layout"

    def apply(self, ctx, op) -> None:
        pats = [FoldTransposeIntoMatmul(), FoldBroadcastIntoElementwise()]
        PatternRewriteWalker(GreedyRewritePatternApplier(pats), apply_recursively=True).rewrite_module(op)
