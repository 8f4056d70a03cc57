"""Helpers shared by the passes: the step function's body, op kinds, shapes, value replacement."""

from __future__ import annotations

from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Block, Operation, SSAValue

from blucompiler.dialect import attrs_of, np_type, op_kind
from blucompiler.graph import ELEMENTWISE, VIEWS

#: ops without effects whose result depends only on operands and attributes
PURE = (set(ELEMENTWISE) | VIEWS | {"const", "reduce", "argmax", "argmin", "gather", "setitem", "scatter_add",
                                     "take_along_axis", "concat", "stack", "tril", "triu", "full", "iota",
                                     "matmul", "extract"})


def body(mod: ModuleOp) -> Block:
    """The block of ``func.func @step``."""
    for op in mod.body.block.ops:
        if op.name == "func.func":
            return op.regions[0].block
    raise ValueError("module has no func.func")


def kind(op: Operation) -> str:
    return op_kind(op)


def shape_of(v: SSAValue) -> tuple:
    return np_type(v.type)[0]


def dtype_of(v: SSAValue):
    return np_type(v.type)[1]


def is_elementwise(op: Operation) -> bool:
    return kind(op) in ELEMENTWISE and dtype_of(op.results[0]) is not None


def producer(v: SSAValue):
    """The op defining ``v`` (None for block arguments)."""
    return v.owner if isinstance(v.owner, Operation) else None


def _erase(op: Operation) -> None:
    """Detach ``op`` from its block and erase it (it must have no uses left)."""
    op.detach()
    op.erase()


def replace(op: Operation, new: SSAValue) -> None:
    """Replace the single result of ``op`` by ``new`` and erase ``op``."""
    op.results[0].replace_all_uses_with(new)
    _erase(op)


def nuses(v: SSAValue) -> int:
    return v.uses.get_length()


def users(v: SSAValue) -> list[Operation]:
    return [u.operation for u in v.uses]


def const_of(v: SSAValue):
    """The Python value of ``v`` when it is a scalar ``blu.const`` (else None)."""
    p = producer(v)
    if p is not None and kind(p) == "const":
        return attrs_of(p)["value"]
    return None
