"""The ``blu`` dialect (xDSL): BluTrain's array operations as MLIR ops on ``tensor<...>`` values.

Ops take their operands and produce results of builtin tensor types; their parameters are
attributes (``axes``, ``shape``, ``perm``, ``index``...). Opaque runtime objects (an eager op's
context) have type ``!blu.obj``. ``blu.fused`` holds a fused kernel as a region whose block
arguments are the kernel inputs and whose ``blu.yield`` lists its outputs.
"""

from __future__ import annotations

import numpy as np
from xdsl.dialects.builtin import (
    ArrayAttr,
    BoolAttr,
    DenseArrayBase,
    FloatAttr,
    IntegerAttr,
    IntegerType,
    Signedness,
    StringAttr,
    TensorType,
    f16,
    f32,
    f64,
    i1,
    i32,
    i64,
)
from xdsl.ir import Attribute, Dialect, ParametrizedAttribute, TypeAttribute
from xdsl.irdl import (
    IRDLOperation,
    irdl_attr_definition,
    irdl_op_definition,
    region_def,
    traits_def,
    var_operand_def,
    var_result_def,
)
from xdsl.traits import IsTerminator

from blucompiler.graph import ELEMENTWISE


@irdl_attr_definition
class ObjType(ParametrizedAttribute, TypeAttribute):
    """An opaque host object (eager op context or tuple of gradients)."""

    name = "blu.obj"


#: every op of the dialect besides fused/yield: elementwise, reductions, layout, data movement,
#: contractions, constants, eager fallbacks
OP_NAMES = sorted(set(ELEMENTWISE) | {
    "const", "reduce", "argmax", "argmin", "reshape", "transpose", "broadcast", "slice", "gather", "setitem",
    "scatter_add", "take_along_axis", "concat", "stack", "tril", "triu", "full", "iota", "matmul", "eager",
    "eager_backward", "extract",
})
OPS: dict[str, type] = {}


def _make(name: str) -> type:
    cls = type(f"Blu_{name}", (IRDLOperation,), {
        "name": f"blu.{name}", "ins": var_operand_def(), "outs": var_result_def(), "__module__": __name__,
        "__doc__": f"blu.{name}",
    })
    return irdl_op_definition(cls)


for _n in OP_NAMES:
    OPS[_n] = _make(_n)


@irdl_op_definition
class FusedOp(IRDLOperation):
    """A fused kernel: ``kind`` = "elementwise" (one loop over ``domain``) or "reduce"."""

    name = "blu.fused"
    ins = var_operand_def()
    outs = var_result_def()
    body = region_def()


@irdl_op_definition
class YieldOp(IRDLOperation):
    name = "blu.yield"
    ins = var_operand_def()
    traits = traits_def(IsTerminator())


OPS["fused"], OPS["yield"] = FusedOp, YieldOp
Blu = Dialect("blu", list(OPS.values()), [ObjType])

# ---- types ----
_U = Signedness.UNSIGNED
_TO_MLIR = {"float32": f32, "float64": f64, "float16": f16, "int64": i64, "int32": i32, "bool": i1,
            "int8": IntegerType(8), "uint8": IntegerType(8, _U), "uint64": IntegerType(64, _U),
            "uint32": IntegerType(32, _U), "int16": IntegerType(16)}
_FROM_MLIR = {str(v): np.dtype(k) for k, v in _TO_MLIR.items()}


def tensor_type(shape, dtype) -> Attribute:
    if dtype is None:
        return ObjType()
    try:
        el = _TO_MLIR[np.dtype(dtype).name]
    except KeyError:
        raise TypeError(f"blucompiler: dtype {dtype} has no MLIR element type") from None
    return TensorType(el, list(shape))


def np_type(t: Attribute):
    """(shape, numpy dtype) of a tensor type; ((), None) for !blu.obj."""
    if isinstance(t, ObjType):
        return (), None
    return tuple(t.get_shape()), _FROM_MLIR[str(t.element_type)]


# ---- attributes ----
def to_attr(v) -> Attribute:
    if isinstance(v, bool | np.bool_):
        return BoolAttr(bool(v), i1)
    if isinstance(v, int | np.integer):
        return IntegerAttr(int(v), i64)
    if isinstance(v, float | np.floating):
        return FloatAttr(float(v), f64)
    if isinstance(v, str):
        return StringAttr(v)
    if isinstance(v, tuple | list):
        if all(isinstance(i, int | np.integer) and not isinstance(i, bool) for i in v):
            return DenseArrayBase.from_list(i64, [int(i) for i in v])
        return ArrayAttr([to_attr(i) for i in v])
    raise TypeError(f"blucompiler: attribute value {v!r} has no MLIR form")


def from_attr(a: Attribute):
    if isinstance(a, IntegerAttr):
        v = a.value.data
        return bool(v) if a.type == i1 else int(v)
    if isinstance(a, FloatAttr):
        return float(a.value.data)
    if isinstance(a, StringAttr):
        return a.data
    if isinstance(a, DenseArrayBase):
        return tuple(int(x) for x in a.get_values())
    if isinstance(a, ArrayAttr):
        return tuple(from_attr(x) for x in a.data)
    return a


def attrs_of(op) -> dict:
    return {k: from_attr(v) for k, v in op.attributes.items()}


def op_kind(op) -> str:
    """The blu op name without the dialect prefix ('' for ops of other dialects)."""
    n = op.name
    return n[4:] if n.startswith("blu.") else ""


def make_op(kind: str, operands, result_types, attrs: dict | None = None, regions=()):
    cls = OPS[kind]
    return cls.create(operands=list(operands), result_types=list(result_types),
                      attributes={k: to_attr(v) for k, v in (attrs or {}).items()}, regions=list(regions))


def context():
    """An xDSL context that parses blu IR (builtin, func, blu)."""
    from xdsl.context import Context
    from xdsl.dialects.builtin import Builtin
    from xdsl.dialects.func import Func

    ctx = Context()
    for d in (Builtin, Func, Blu):
        ctx.load_dialect(d)
    return ctx


def parse(text: str):
    from xdsl.parser import Parser

    mod = Parser(context(), text).parse_module()
    mod.verify()
    return mod


def print_ir(op) -> str:
    import io

    from xdsl.printer import Printer

    s = io.StringIO()
    Printer(stream=s).print_op(op)
    return s.getvalue() + "\n"
