"""blu-fuse-elementwise: elementwise ops with the same iteration domain (result shape) are grouped in
program order; a group stays open until something outside it (a contraction, a view, another group,
the function's return) reads one of its values, so a group can be placed at its last member without
breaking any dependency. Each group becomes one kernel whose outputs are the values read outside.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.passes import ModulePass

from blucompiler.passes.common import _erase, body, is_elementwise, producer, shape_of
from blucompiler.passes.fusion import make_fused, next_id

MAX_GROUP_OPS = 400
MAX_KERNEL_ARGS = 120


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
        n = int(next_id(op)[1:])
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
