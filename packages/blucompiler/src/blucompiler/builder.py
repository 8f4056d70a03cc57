"""Graph -> xDSL module: one ``func.func @step`` whose arguments are the graph inputs and whose
return values are the graph outputs; every node becomes a ``blu`` op.

What the IR cannot hold (the live tensors an argument is bound to, Python kernels of eager
fallbacks, host scalar producers) stays in a :class:`Program` next to the module; the IR names them
by position (``blu.inputs``/``blu.outputs`` on the function) or by key (``key`` attribute).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xdsl.dialects import func
from xdsl.dialects.builtin import ArrayAttr, ModuleOp, StringAttr
from xdsl.ir import Block, Region

from blucompiler.dialect import make_op, tensor_type
from blucompiler.graph import Graph


@dataclass
class Program:
    """The Python side of a compiled step."""

    inputs: list = field(default_factory=list)  # per func argument: binding tuple
    sinks: list = field(default_factory=list)  # per returned value: sink tuple
    nograd: list = field(default_factory=list)  # tensors whose .grad is None after the step
    side: list = field(default_factory=list)
    effects: list = field(default_factory=list)
    host_fns: list = field(default_factory=list)


def _input_label(b) -> str:
    kind, what = b
    if kind == "arg":
        return f"arg:{what}"
    if kind == "host":
        return f"host:{what[0]}.{what[1]}"
    return kind


def _sink_label(s, argpos) -> str:
    kind, what = s
    if kind == "ret":
        return f"ret:{what}"
    if kind == "write":
        return f"write:{argpos[what]}"
    return "grad"


def build_module(graph: Graph) -> tuple[ModuleOp, Program]:
    """Translate the traced graph into a verified xDSL module plus its Program."""
    prog = Program(side=graph.side, effects=graph.effects, host_fns=graph.host_fns)
    in_ids = [i for i, n in enumerate(graph.nodes) if n.op == "input"]
    argpos = {vid: k for k, vid in enumerate(in_ids)}
    block = Block(arg_types=[tensor_type(graph.nodes[i].shape, graph.nodes[i].dtype) for i in in_ids])
    vals: dict[int, object] = {vid: block.args[k] for k, vid in enumerate(in_ids)}
    for vid in in_ids:
        prog.inputs.append(graph.bindings[vid])
    for vid, n in enumerate(graph.nodes):
        if n.op == "input":
            continue
        attrs = dict(n.attrs)
        if n.op == "const":
            v = attrs["value"]
            attrs["value"] = float(v) if n.dtype.kind == "f" else (bool(v) if n.dtype.kind == "b" else int(v))
        op = make_op(n.op, [vals[i] for i in n.inputs], [tensor_type(n.shape, n.dtype)], attrs)
        block.add_op(op)
        vals[vid] = op.results[0]
    outs, labels = [], []
    for vid, sink in graph.outputs:
        if vid is None:
            prog.nograd.append(sink[1])
            continue
        outs.append(vals[vid])
        prog.sinks.append(sink)
        labels.append(_sink_label(sink, argpos))
    block.add_op(func.ReturnOp(*outs))
    fn = func.FuncOp("step", ([a.type for a in block.args], [o.type for o in outs]), Region(block))
    fn.attributes["blu.inputs"] = ArrayAttr([StringAttr(_input_label(b)) for b in prog.inputs])
    fn.attributes["blu.outputs"] = ArrayAttr([StringAttr(s) for s in labels])
    mod = ModuleOp([fn])
    mod.verify()
    return mod, prog


def step_func(mod: ModuleOp) -> func.FuncOp:
    for op in mod.body.block.ops:
        if isinstance(op, func.FuncOp):
            return op
    raise ValueError("module has no func.func")
