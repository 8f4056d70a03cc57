"""Shared by the fusion passes: build a ``blu.fused`` op from a list of member ops."""

from __future__ import annotations

from xdsl.ir import Block, Region

from blucompiler.dialect import FusedOp, YieldOp, to_attr
from blucompiler.passes.common import producer


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


def next_id(mod) -> str:
    """The next free kernel id ``k<n>``."""
    used = [int(str(o.attributes["id"].data)[1:]) for o in mod.walk() if o.name == "blu.fused" and "id" in o.attributes]
    return f"k{max(used, default=-1) + 1}"
