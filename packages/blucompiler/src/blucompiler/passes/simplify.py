"""blu-simplify: algebraic simplification as a set of rewrite patterns.

x+0, x-0, x*1, x/1 -> x (when the result type is x's); neg(neg(x)) -> x; copies, identity casts and
identity views -> their operand; reshape(reshape(x)) -> reshape(x); ops on scalar constants folded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from xdsl.passes import ModulePass
from xdsl.pattern_rewriter import (
    GreedyRewritePatternApplier,
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
)

from blucompiler.dialect import attrs_of, make_op
from blucompiler.graph import ELEMENTWISE
from blucompiler.passes.common import const_of, dtype_of, kind, producer

#: ops whose result is a new contiguous array owned by nobody else (a copy of it is redundant)
FRESH = set(ELEMENTWISE) - {"copy"} | {"matmul", "reduce", "gather", "take_along_axis", "concat", "stack",
                                       "setitem", "scatter_add", "full", "iota", "tril", "triu"}


def _same(op, v) -> bool:
    return op.results[0].type == v.type


class DropIdentity(RewritePattern):
    """copy(x) when only elementwise ops read it (fused kernels read any strides) or x is a fresh
    array (a GEMM/reduction/elementwise result), cast(x) to x's type, reshape/broadcast to x's shape,
    identity transpose -> x."""

    def match_and_rewrite(self, op, rewriter: PatternRewriter) -> None:
        k = kind(op)
        if k == "copy" and not all(kind(u.operation) in ELEMENTWISE for u in op.results[0].uses):
            p = producer(op.operands[0])
            if p is None or kind(p) not in FRESH:
                return  # GEMMs/library kernels get the contiguous copy eager gave them; aliases stay copies
        if k in ("copy", "cast", "reshape", "broadcast") and _same(op, op.operands[0]):
            rewriter.replace(op, [], [op.operands[0]])
        elif k == "transpose" and attrs_of(op)["perm"] == tuple(range(len(attrs_of(op)["perm"]))):
            rewriter.replace(op, [], [op.operands[0]])


class ArithIdentity(RewritePattern):
    """x + 0, 0 + x, x - 0, x * 1, 1 * x, x / 1 -> x; neg(neg(x)) -> x."""

    def match_and_rewrite(self, op, rewriter: PatternRewriter) -> None:
        k = kind(op)
        if k == "neg":
            p = producer(op.operands[0])
            if p is not None and kind(p) == "neg" and _same(op, p.operands[0]):
                rewriter.replace(op, [], [p.operands[0]])
            return
        unit = {"add": 0, "sub": 0, "mul": 1, "div": 1}.get(k)
        if unit is None:
            return
        a, b = op.operands
        if const_of(b) == unit and _same(op, a):
            rewriter.replace(op, [], [a])
        elif k in ("add", "mul") and const_of(a) == unit and _same(op, b):
            rewriter.replace(op, [], [b])


class ViewChains(RewritePattern):
    """reshape(reshape(x)) -> reshape(x); transpose(transpose(x)) -> one transpose."""

    def match_and_rewrite(self, op, rewriter: PatternRewriter) -> None:
        k = kind(op)
        if k not in ("reshape", "transpose"):
            return
        p = producer(op.operands[0])
        if p is None or kind(p) != k:
            return
        if k == "reshape":
            new = make_op("reshape", [p.operands[0]], [op.results[0].type], attrs_of(op))
        else:
            inner, outer = attrs_of(p)["perm"], attrs_of(op)["perm"]
            new = make_op("transpose", [p.operands[0]], [op.results[0].type],
                          {"perm": tuple(inner[i] for i in outer)})
        rewriter.replace(op, [new])


class FoldScalars(RewritePattern):
    """An elementwise op whose operands are all scalar constants becomes a constant."""

    def match_and_rewrite(self, op, rewriter: PatternRewriter) -> None:
        k = kind(op)
        if k not in ELEMENTWISE or k in ("erf", "copy"):
            return
        vals = [const_of(v) for v in op.operands]
        if any(v is None for v in vals) or op.results[0].type.get_shape() != ():
            return
        from blucompiler.ops_impl import run_op

        args = []
        for v, x in zip(op.operands, vals):
            weak = attrs_of(producer(v)).get("weak", False)
            args.append(x if weak else dtype_of(v).type(x))
        dt = dtype_of(op.results[0])
        with np.errstate(all="ignore"):
            r = np.asarray(run_op(k, {}, dt, (), args, np, [])).astype(dt)
        value = float(r) if dt.kind == "f" else (bool(r) if dt.kind == "b" else int(r))
        rewriter.replace(op, [make_op("const", [], [op.results[0].type], {"value": value, "weak": False})])


PATTERNS = (DropIdentity(), ArithIdentity(), ViewChains(), FoldScalars())


@dataclass(frozen=True)
class SimplifyPass(ModulePass):
    name = "blu-simplify"

    def apply(self, ctx, op) -> None:
        PatternRewriteWalker(GreedyRewritePatternApplier(list(PATTERNS)), apply_recursively=True).rewrite_module(op)
