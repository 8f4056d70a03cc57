"""Array-library implementations of every blu op (NumPy on the CPU, CuPy on CUDA).

The runtime uses them for ops that are not lowered to generated code (contractions go to the GEMM
provider; gathers, scatters, views and eager fallbacks to the array library), and the reference
interpreter uses them for everything.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from blutensor import ext

from blucompiler.trace import _NP_FN


@lru_cache(maxsize=4096)
def index_fn(tmpl: str):
    """Compile an index template like ``(slice(None, None, None), ARR(0))`` into ``f(arrays) -> index``."""
    code = compile(tmpl, "<blu index>", "eval")

    def f(arrays):
        return eval(code, {"__builtins__": {}, "slice": slice, "Ellipsis": Ellipsis, "None": None,  # noqa: S307
                           "ARR": arrays.__getitem__})

    return f


def const_value(node):
    v = node.attrs["value"]
    if node.attrs.get("weak"):
        return v
    return node.dtype.type(v)


def gemm(a, b):
    return ext.gemm(a, b)


def scatter_add(out, index, values):
    ext.scatter_add(out, index, values)


def erf(x, xp):
    return ext.erf(x, xp)


def run_op(op: str, attrs: dict, dtype, shape, args, xp, side):
    """Compute one op on concrete values ``args``."""
    if op in _NP_FN:
        return getattr(xp, _NP_FN[op])(*args)
    if op == "copy":
        return args[0]
    if op == "cast":
        return args[0].astype(dtype)
    if op == "erf":
        return erf(args[0], xp)
    if op == "reshape":
        return args[0].reshape(shape)
    if op == "transpose":
        return args[0].transpose(attrs["perm"])
    if op == "broadcast":
        return xp.broadcast_to(args[0], shape)
    if op == "slice":
        return args[0][index_fn(attrs["index"])(args[1:])]
    if op == "gather":
        return args[0][index_fn(attrs["index"])(args[1:])]
    if op == "setitem":
        c = args[0].copy()
        c[index_fn(attrs["index"])(args[2:])] = args[1]
        return c
    if op == "scatter_add":
        c = args[0].copy()
        scatter_add(c, index_fn(attrs["index"])(args[2:]), args[1])
        return c
    if op == "reduce":
        kind, axes, kd = attrs["kind"], tuple(attrs["axes"]), attrs["keepdims"]
        a = args[0]
        if kind == "sum":
            return xp.asarray(a.sum(axis=axes, keepdims=kd, dtype=dtype))
        if kind == "mean":
            return xp.asarray(a.mean(axis=axes, keepdims=kd))
        return xp.asarray(getattr(a, kind)(axis=axes, keepdims=kd))
    if op in ("argmax", "argmin"):
        ax = attrs["axis"]
        return xp.asarray(getattr(args[0], op)(axis=None if ax == -1 else ax))
    if op == "take_along_axis":
        return xp.take_along_axis(args[0], args[1], axis=attrs["axis"])
    if op == "concat":
        return xp.concatenate(args, axis=attrs["axis"])
    if op == "stack":
        return xp.stack(args, axis=attrs["axis"])
    if op in ("tril", "triu"):
        return getattr(xp, op)(args[0], attrs["k"])
    if op == "full":
        return xp.full(tuple(attrs["shape"]), attrs["value"], dtype=dtype)
    if op == "iota":
        return xp.arange(attrs["n"], dtype=dtype)
    if op == "matmul":
        return gemm(args[0], args[1])
    if op == "eager":
        return side[attrs["key"]].forward(list(args))
    if op == "eager_backward":
        eb = side[attrs["key"]]
        if attrs.get("from_forward"):
            return eb.backward(None, args[1], fwd=args[0])
        return eb.backward(list(args[:-1]), args[-1])
    if op == "extract":
        r = args[0][attrs["index"]]
        return np.asarray(r) if isinstance(r, np.generic) else r
    raise NotImplementedError(f"blu op '{op}' has no array-library implementation")


def interpret(graph, inputs: dict, xp=np):
    """Reference interpreter: evaluate every node of ``graph`` (inputs: vid -> array)."""
    vals: list = [None] * len(graph.nodes)
    for vid, n in enumerate(graph.nodes):
        if n.op == "input":
            vals[vid] = inputs[vid]
        elif n.op == "const":
            vals[vid] = const_value(n)
        else:
            vals[vid] = run_op(n.op, n.attrs, n.dtype, n.shape, [vals[i] for i in n.inputs], xp, graph.side)
    return vals
