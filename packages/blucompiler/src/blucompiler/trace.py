"""Tracing: run a step once with TracedArrays in place of tensor storage and record the graph.

The tracer swaps the storage of every tensor the step touches (arguments, parameters, optimizer
state) for a TracedArray, runs the step as ordinary eager code, and records every array operation
of the forward kernels, of the backward formulas the autograd engine runs, and of the optimizer.
Python control flow runs once at trace time and leaves only the operations it chose. Where an op
cannot be traced (a host sync, an unknown NumPy function) that op, or its backward formula, is
recorded as an opaque eager call instead; the report lists them.
"""

from __future__ import annotations

import numpy as np
from blutensor import ext

from blucompiler.graph import Graph
from blucompiler.tarray import DataDependent, TracedArray, TraceUnsupported, _index_spec, norm_axes

_NP_FN = {
    "add": "add", "sub": "subtract", "mul": "multiply", "div": "true_divide", "pow": "power", "max": "maximum",
    "min": "minimum", "neg": "negative", "exp": "exp", "log": "log", "tanh": "tanh", "sqrt": "sqrt",
    "abs": "absolute", "sign": "sign", "eq": "equal", "ne": "not_equal", "lt": "less", "le": "less_equal",
    "gt": "greater", "ge": "greater_equal", "not": "logical_not", "and": "logical_and", "or": "logical_or",
    "xor": "logical_xor", "sin": "sin", "cos": "cos", "square": "square", "recip": "reciprocal",
    "where": "where",
}


class CompileError(Exception):
    """The step as a whole cannot be compiled (it then runs eagerly; the report says why).
    ``retry=True``: only this call runs eagerly, the next call traces again."""

    def __init__(self, msg: str, retry: bool = False):
        super().__init__(msg)
        self.retry = retry


def _conc(x):
    if isinstance(x, TracedArray):
        return x.v
    if isinstance(x, list | tuple):
        return type(x)(_conc(i) for i in x)
    return x


class Tracer:
    """Records array operations into a :class:`Graph` while computing their concrete values."""

    def __init__(self, args=(), xp=np):
        self.g = Graph()
        self.xp = xp
        self.args = {id(t): i for i, t in enumerate(args)}
        self.swapped: list = []  # (tensor, original array, original grad, placeholder, input vid)
        self.lifted: dict[int, int] = {}  # id(tensor) -> index in swapped
        self.consts: dict = {}
        self.captured: dict[int, int] = {}
        self.fallbacks: list[tuple[str, str]] = []
        self.primitives = 0  # array ops the eager step ran (each at least one kernel)
        self.host_cache: dict = {}

    # ---- values ----
    def new(self, op: str, inputs, attrs: dict, value, root=None) -> TracedArray:
        if op not in ("input", "const"):
            self.primitives += op not in ("reshape", "transpose", "slice", "broadcast")
        vid = self.g.add(op, inputs, attrs, value.shape, value.dtype)
        return TracedArray(self, vid, value, root)

    def operand(self, x) -> int:
        if isinstance(x, TracedArray):
            if x.root is not x and x.root.ver != x.bver:
                raise TraceUnsupported("a view is read after its base was modified in place")
            return x.vid
        if isinstance(x, bool | int | float):
            dt = np.dtype(bool) if isinstance(x, bool) else np.dtype(np.int64 if isinstance(x, int) else np.float64)
            return self.const(x, dt, True)
        if isinstance(x, np.generic) or (isinstance(x, np.ndarray) and x.ndim == 0):
            return self.const(x.item(), x.dtype, False)
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return self.capture(x)
        raise TraceUnsupported(f"operand of type {type(x).__name__}")

    def const(self, value, dt, weak: bool) -> int:
        key = (repr(value), dt.str, weak)
        vid = self.consts.get(key)
        if vid is None:
            vid = self.consts[key] = self.g.add("const", [], {"value": value, "weak": weak}, (), dt)
        return vid

    def capture(self, arr) -> int:
        """A real array the step created outside traced ops: a constant bound by reference."""
        vid = self.captured.get(id(arr))
        if vid is None:
            a = arr
            if self.xp is not np and isinstance(arr, np.ndarray):
                a = self.xp.asarray(arr)
            vid = self.g.add("input", [], {"kind": "const", "index": len(self.captured)}, a.shape, a.dtype)
            self.g.bindings[vid] = ("const", a)
            self.captured[id(arr)] = vid
            self._keep = getattr(self, "_keep", []) + [arr]
        return vid

    def lift(self, t) -> TracedArray:
        """Swap tensor ``t``'s storage for a graph input (argument or live memory)."""
        i = self.lifted.get(id(t))
        if i is not None:
            return self.swapped[i][3]
        arr = t._data
        if id(t) in self.args:
            kind, bind = "arg", ("arg", self.args[id(t)])
        else:
            kind, bind = "live", ("live", t)
        if arr.dtype.name == "bfloat16" or (self.xp is not np and arr.dtype == np.uint16):
            raise CompileError(f"bfloat16 tensor {tuple(arr.shape)} in the step: blucompiler traces float32 steps")
        vid = self.g.add("input", [], {"kind": kind, "index": len(self.swapped)}, arr.shape, arr.dtype)
        self.g.bindings[vid] = bind
        ta = TracedArray(self, vid, arr)
        self.lifted[id(t)] = len(self.swapped)
        self.swapped.append((t, arr, t.grad, ta, vid))
        t._data = ta
        g = t.grad
        if g is not None and not isinstance(g._data, TracedArray):
            # an existing gradient (a training step accumulating into persistent gradient buffers) is live memory
            # too: backward's in-place accumulation into it is traced and written back into the same array
            self.lift(g)
        return ta

    def host_scalars(self, key, fn, weak: bool = False) -> list[TracedArray]:
        """Scalars recomputed from live Python state before every call (``fn() -> tuple``).
        ``weak``: Python numbers (NumPy's weak promotion), else NumPy scalars of fixed dtype."""
        got = self.host_cache.get(key)
        if got is not None:
            return got
        vals = fn()
        k = len(self.g.host_fns)
        self.g.host_fns.append(fn)
        out = []
        for j, v in enumerate(vals):
            a = np.asarray(v)
            vid = self.g.add("input", [], {"kind": "host", "index": k * 1000 + j, "weak": weak}, (), a.dtype)
            self.g.bindings[vid] = ("host", (k, j))
            out.append(WeakScalar(self, vid, v) if weak else
                       TracedArray(self, vid, a if self.xp is np else self.xp.asarray(a)))
        self.host_cache[key] = out
        return out

    # ---- operations ----
    def _c(self, x):
        """Concrete value of an operand (host arrays moved to the device when tracing on CUDA)."""
        if isinstance(x, TracedArray):
            return x.v
        if isinstance(x, list | tuple):
            return type(x)(self._c(i) for i in x)
        if self.xp is not np and isinstance(x, np.ndarray) and x.ndim > 0:
            return self.xp.asarray(x)
        return x

    def ew(self, name: str, *inputs) -> TracedArray:
        ins = [self.operand(x) for x in inputs]
        cs = [self._c(x) for x in inputs]
        if name in ("not", "and", "or", "xor") and any(getattr(c, "dtype", np.dtype(bool)) != np.bool_
                                                      and not isinstance(c, bool) for c in cs):
            raise TraceUnsupported(f"bitwise {name} on integers")
        xp = self.xp
        if name == "copy":
            v = xp.array(cs[0], copy=True)
        elif name == "erf":
            v = ext.erf(cs[0], xp)
        else:
            v = getattr(xp, _NP_FN[name])(*cs)
        if not hasattr(v, "shape") or isinstance(v, np.generic):
            v = xp.asarray(v)
        return self.new(name, ins, {}, v)

    def cast(self, x, dt) -> TracedArray:
        return self.new("cast", [self.operand(x)], {}, x.v.astype(dt))

    def full(self, shape, dtype, value) -> TracedArray:
        dt = np.dtype(dtype)
        v = self.xp.full(tuple(shape), value, dtype=dt)
        return self.new("full", [], {"shape": tuple(int(s) for s in shape), "value": _py(value)}, v)

    def iota(self, n, dtype) -> TracedArray:
        return self.new("iota", [], {"n": int(n)}, self.xp.arange(n, dtype=dtype))

    def assign(self, o: TracedArray, res) -> None:
        """In-place write of ``res`` into ``o``: ``o`` now names the new value."""
        if o.root is not o:
            raise TraceUnsupported("in-place write into a view of a traced array")
        if not isinstance(res, TracedArray):
            res = self.full(o.shape, o.dtype, _py(res)) if np.ndim(res) == 0 else None
            if res is None:
                raise TraceUnsupported("in-place write of an untraced array")
        if res.dtype != o.dtype:
            res = self.cast(res, o.dtype)
        if res.shape != o.shape:
            res = self.broadcast(res, o.shape)
        o.vid, o.v = res.vid, res.v
        o.ver += 1

    def reshape(self, x, shape) -> TracedArray:
        v = x.v.reshape(tuple(int(s) for s in shape))
        if v.shape == x.shape:
            return x
        return self.new("reshape", [self.operand(x)], {"shape": tuple(v.shape)}, v, x.root)

    def transpose(self, x, perm) -> TracedArray:
        if tuple(perm) == tuple(range(x.ndim)):
            return x
        return self.new("transpose", [self.operand(x)], {"perm": tuple(perm)}, x.v.transpose(perm), x.root)

    def broadcast(self, x, shape) -> TracedArray:
        shape = tuple(int(s) for s in shape)
        if not isinstance(x, TracedArray):
            x = TracedArray(self, self.operand(x), self.xp.asarray(x))
        if x.shape == shape:
            return x
        return self.new("broadcast", [self.operand(x)], {"shape": shape}, self.xp.broadcast_to(x.v, shape), x.root)

    def reduce(self, kind, x, axis, keepdims, dtype=None) -> TracedArray:
        axes = norm_axes(axis, x.ndim)
        fn = {"sum": "sum", "mean": "mean", "max": "max", "min": "min"}[kind]
        kw = {"dtype": dtype} if dtype is not None else {}
        v = getattr(x.v, fn)(axis=axes if axes else None, keepdims=keepdims, **kw) if axes else x.v.copy()
        if not hasattr(v, "shape") or isinstance(v, np.generic):
            v = self.xp.asarray(v)
        if not axes:
            return self.new("copy", [self.operand(x)], {}, v)
        return self.new("reduce", [self.operand(x)], {"kind": kind, "axes": axes, "keepdims": bool(keepdims)}, v)

    def argreduce(self, kind, x, axis) -> TracedArray:
        v = getattr(x.v, kind)(axis=axis)
        v = self.xp.asarray(v)
        return self.new(kind, [self.operand(x)], {"axis": -1 if axis is None else int(axis) % x.ndim}, v)

    def matmul(self, a, b) -> TracedArray:
        v = ext.gemm(self._c(a), self._c(b))
        return self.new("matmul", [self.operand(a), self.operand(b)], {}, v)

    def getitem(self, x, index) -> TracedArray:
        tmpl, arrays, basic = _index_spec(index)
        v = x.v[_concrete_index(index, self.xp)]
        if isinstance(v, np.generic) or not hasattr(v, "shape"):
            v = self.xp.asarray(v)
        ins = [self.operand(x)] + [self.operand(a) for a in arrays]
        if basic:
            return self.new("slice", ins, {"index": tmpl}, v, x.root)
        return self.new("gather", ins, {"index": tmpl}, v)

    def setitem(self, x, index, value) -> None:
        tmpl, arrays, _ = _index_spec(index)
        c = x.v.copy()
        c[_concrete_index(index, self.xp)] = self._c(value)
        ins = [self.operand(x), self.operand(value)] + [self.operand(a) for a in arrays]
        self.assign(x, self.new("setitem", ins, {"index": tmpl}, c))

    def scatter_add(self, out, index, values) -> None:
        if not isinstance(out, TracedArray):
            raise TraceUnsupported("scatter-add into an untraced array")
        tmpl, arrays, _ = _index_spec(index)
        c = out.v.copy()
        ext.scatter_add(c, _concrete_index(index, self.xp), self._c(values))
        ins = [self.operand(out), self.operand(values)] + [self.operand(a) for a in arrays]
        self.assign(out, self.new("scatter_add", ins, {"index": tmpl}, c))

    def array_function(self, func, args, kwargs):
        name = func.__name__
        xp = self.xp
        if name == "where" and len(args) == 3:
            return self.ew("where", *args)
        if name == "broadcast_to":
            return self.broadcast(args[0], kwargs.get("shape", args[1] if len(args) > 1 else None))
        if name in ("expand_dims", "squeeze", "reshape"):
            a = args[0]
            if name == "reshape":
                return a.reshape(kwargs.get("newshape", kwargs.get("shape", args[1] if len(args) > 1 else None)))
            v = getattr(np if isinstance(a.v, np.ndarray) else xp, name)(a.v, *args[1:], **kwargs)
            return self.reshape(a, v.shape)
        if name == "transpose":
            axes = kwargs.get("axes", args[1] if len(args) > 1 else None)
            return args[0].transpose() if axes is None else args[0].transpose(tuple(axes))
        if name == "swapaxes":
            return args[0].swapaxes(*args[1:])
        if name in ("sum", "mean", "amax", "amin", "max", "min"):
            a = args[0]
            kind = {"amax": "max", "amin": "min"}.get(name, name)
            axis = kwargs.get("axis", args[1] if len(args) > 1 else None)
            return self.reduce(kind, a, axis, kwargs.get("keepdims", False), kwargs.get("dtype"))
        if name in ("copy", "ascontiguousarray"):
            return self.ew("copy", args[0])
        if name == "matmul":
            return self.matmul(*args)
        if name == "take_along_axis":
            a, idx = args[0], args[1]
            axis = int(kwargs.get("axis", args[2] if len(args) > 2 else -1)) % a.ndim
            v = xp.take_along_axis(self._c(a), self._c(idx), axis=axis)
            return self.new("take_along_axis", [self.operand(a), self.operand(idx)], {"axis": axis}, v)
        if name in ("concatenate", "stack"):
            arrs = list(args[0])
            axis = int(kwargs.get("axis", args[1] if len(args) > 1 else 0))
            v = getattr(xp, name)([self._c(a) for a in arrs], axis=axis)
            nd = v.ndim
            return self.new("concat" if name == "concatenate" else "stack", [self.operand(a) for a in arrs],
                            {"axis": axis % nd}, v)
        if name in ("tril", "triu"):
            k = int(kwargs.get("k", args[1] if len(args) > 1 else 0))
            return self.new(name, [self.operand(args[0])], {"k": k}, getattr(xp, name)(self._c(args[0]), k))
        if name in ("zeros_like", "ones_like", "empty_like", "full_like"):
            a = args[0]
            dt = kwargs.get("dtype") or a.dtype
            val = {"zeros_like": 0, "ones_like": 1, "empty_like": 0}.get(name)
            if val is None:
                val = kwargs.get("fill_value", args[1] if len(args) > 1 else None)
            return self.full(a.shape, dt, val)
        if name in ("result_type", "shape", "ndim", "size", "broadcast_shapes", "can_cast"):
            return func(*_conc(list(args)), **kwargs)
        if name == "astype":
            return args[0].astype(args[1], **kwargs)
        raise TraceUnsupported(f"numpy.{name}")


class WeakScalar(TracedArray):
    """A per-call host scalar that NumPy treats as a Python number (weak promotion)."""

    __slots__ = ()
    shape = property(lambda self: ())
    dtype = property(lambda self: np.dtype(np.float64 if isinstance(self.v, float) else np.int64))
    ndim = property(lambda self: 0)
    size = property(lambda self: 1)


def _py(v):
    return v.item() if hasattr(v, "item") else v


def _concrete_index(index, xp):
    items = index if isinstance(index, tuple) else (index,)
    out = []
    for it in items:
        if isinstance(it, TracedArray):
            out.append(it.v)
        elif isinstance(it, np.ndarray) and xp is not np:
            out.append(xp.asarray(it))
        else:
            out.append(it)
    return tuple(out) if isinstance(index, tuple) else out[0]


class TracedNumpy:
    """What ``xp_of(traced)`` returns while tracing: NumPy, except that array constructors
    (zeros, ones, arange, full) become graph nodes instead of host arrays."""

    ndarray = TracedArray

    def __init__(self, tracer: Tracer):
        self._tr = tracer

    def __getattr__(self, name):
        return getattr(np, name)

    def zeros(self, shape, dtype=float):
        return self._tr.full(_shape(shape), dtype, 0)

    empty = zeros

    def ones(self, shape, dtype=float):
        return self._tr.full(_shape(shape), dtype, 1)

    def full(self, shape, value, dtype=None):
        return self._tr.full(_shape(shape), dtype or np.asarray(value).dtype, value)

    def arange(self, n, dtype=None):
        return self._tr.iota(n, dtype or np.int64)

    def asarray(self, x, dtype=None):
        if isinstance(x, TracedArray):
            return x.astype(dtype, copy=False) if dtype is not None else x
        return np.asarray(x, dtype=dtype)

    def ascontiguousarray(self, a, dtype=None):
        return self._tr.ew("copy", a) if isinstance(a, TracedArray) else np.ascontiguousarray(a, dtype=dtype)

    def tril(self, a, k=0):
        return self._tr.array_function(np.tril, (a, k), {})

    def triu(self, a, k=0):
        return self._tr.array_function(np.triu, (a, k), {})


def _shape(s):
    return (int(s),) if isinstance(s, int | np.integer) else tuple(int(i) for i in s)


__all__ = ["Tracer", "TracedArray", "TracedNumpy", "TraceUnsupported", "DataDependent", "CompileError"]
