"""blu-fuse-reduction and blu-fuse-elementwise: form ``blu.fused`` kernels.

Reduction fusion: each ``blu.reduce`` absorbs the elementwise ops of its input's shape that feed it
(cloned as its prologue: the values are recomputed inside the reduction loop, never stored).

Elementwise fusion: elementwise ops with the same iteration domain (result shape) are grouped in
program order; a group stays open until something outside it (a contraction, a view, another group,
the function's return) reads one of its values, so a group can be placed at its last member without
breaking any dependency. Each group becomes one kernel whose outputs are the values read outside.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.ir import Block, Region
from xdsl.passes import ModulePass

from blucompiler.dialect import FusedOp, YieldOp, to_attr
from blucompiler.passes.common import _erase, body, is_elementwise, kind, producer, shape_of

MAX_GROUP_OPS = 400
MAX_KERNEL_ARGS = 120
MAX_PROLOGUE = 48


def _externals(members, mset):
    ext, seen = [], set()
    for m in members:
        for v in m.operands:
            if producer(v) not in mset and v not in seen:
                seen.add(v)
                ext.append(v)
    return ext


def make_fused(block: Block, members: list, outs: list, attrs: dict, anchor) -> FusedOp:
    """Clone ``members`` into a new ``blu.fused`` op placed before ``anchor``; return it."""
    mset = set(members)
    ext = _externals(members, mset)
    rblock = Block(arg_types=[v.type for v in ext])
    mapping = dict(zip(ext, rblock.args))
    for m in members:
        c = m.clone(value_mapper=mapping)
        for a, b in zip(m.results, c.results):
            mapping[a] = b
        rblock.add_op(c)
    rblock.add_op(YieldOp.create(operands=[mapping[o] for o in outs]))
    f = FusedOp.create(operands=ext, result_types=[o.type for o in outs],
                       attributes={k: to_attr(v) for k, v in attrs.items()}, regions=[Region(rblock)])
    block.insert_op_before(f, anchor)
    return f


class _Counter:
    n = 0


def _next_id(mod) -> str:
    used = [int(str(o.attributes["id"].data)[1:]) for o in mod.walk() if o.name == "blu.fused" and "id" in o.attributes]
    return f"k{max(used, default=-1) + 1}"


@dataclass(frozen=True)
class FuseReductionPass(ModulePass):
    name = "blu-fuse-reduction"

    def apply(self, ctx, op) -> None:
        block = body(op)
        ops = list(block.ops)
        pos = {o: i for i, o in enumerate(ops)}
        n = int(_next_id(op)[1:])
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


@dataclass(frozen=True)
class FuseElementwisePass(ModulePass):
    name = "blu-fuse-elementwise"

    def apply(self, ctx, op) -> None:
        block = body(op)
        ops = list(block.ops)
        group_of: dict = {}
        groups: list[list] = []
        closed: set[int] = set()
        open_by_dom: dict = {}
        nargs: list[int] = []

        def close(g):
            closed.add(g)

        for o in ops:
            if is_elementwise(o):
                dom = shape_of(o.results[0])
                g = open_by_dom.get(dom)
                if g is None or g in closed or len(groups[g]) >= MAX_GROUP_OPS or nargs[g] >= MAX_KERNEL_ARGS:
                    g = len(groups)
                    groups.append([])
                    nargs.append(0)
                    open_by_dom[dom] = g
                for v in o.operands:
                    p = producer(v)
                    pg = group_of.get(p) if p is not None else None
                    if pg is not None and pg != g:
                        close(pg)
                    if pg != g:
                        nargs[g] += 1
                groups[g].append(o)
                group_of[o] = g
            else:
                for v in o.operands:
                    p = producer(v)
                    if p is not None and p in group_of:
                        close(group_of[p])
        n = int(_next_id(op)[1:])
        for members in groups:
            mset = set(members)
            outs = [m.results[0] for m in members if any(u.operation not in mset for u in m.results[0].uses)]
            if not outs:
                continue
            f = make_fused(block, members, outs, {"kind": "elementwise", "domain": shape_of(members[-1].results[0]),
                                                   "id": f"k{n}"}, members[-1])
            n += 1
            for o, r in zip(outs, f.results):
                o.replace_all_uses_with(r)
            for m in reversed(members):
                _erase(m)
