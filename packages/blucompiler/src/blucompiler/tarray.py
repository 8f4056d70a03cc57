"""TracedArray: a NumPy-duck array that records every array operation into the graph.

Each TracedArray carries its concrete value (NumPy or CuPy), so the tracing run is an ordinary
eager step whose results are real, and shapes/dtypes come from the real computation. blutensor's
kernels call ``xp.<fn>`` with ``xp = numpy`` for unknown array types, so NumPy's
``__array_ufunc__``/``__array_function__`` protocols route every call here; methods and operators
are defined below. In-place operations rebind the array to a new value (functionalisation).
"""

from __future__ import annotations

import numpy as np

from blucompiler.graph import ELEMENTWISE


class TraceUnsupported(Exception):
    """An array operation the tracer cannot express; the op around it falls back to eager."""


class DataDependent(TraceUnsupported):
    """Python asked for the value of a traced array (int(), bool(), item())."""


UFUNCS = {
    "add": "add", "subtract": "sub", "multiply": "mul", "divide": "div", "true_divide": "div",
    "power": "pow", "maximum": "max", "minimum": "min", "negative": "neg", "exp": "exp", "log": "log",
    "tanh": "tanh", "sqrt": "sqrt", "absolute": "abs", "sign": "sign", "equal": "eq", "not_equal": "ne",
    "less": "lt", "less_equal": "le", "greater": "gt", "greater_equal": "ge", "logical_not": "not",
    "invert": "not", "logical_and": "and", "bitwise_and": "and", "logical_or": "or", "bitwise_or": "or",
    "logical_xor": "xor", "bitwise_xor": "xor", "sin": "sin", "cos": "cos", "square": "square",
    "reciprocal": "recip", "positive": "copy",
}
_BOOL_ONLY = {"not", "and", "or", "xor"}
_REDUCE_FNS = {"sum": "sum", "mean": "mean", "amax": "max", "max": "max", "amin": "min", "min": "min"}


def norm_axes(axis, ndim: int) -> tuple:
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, int | np.integer):
        axis = (axis,)
    return tuple(sorted(int(a) % max(ndim, 1) for a in axis))


def _index_spec(index):
    """(template string, array operands, basic?) for a NumPy index expression."""
    items = index if isinstance(index, tuple) else (index,)
    arrays, parts, basic = [], [], True
    for it in items:
        if isinstance(it, TracedArray) or hasattr(it, "__array_interface__") or hasattr(it, "__cuda_array_interface__"):
            if getattr(it, "dtype", None) == np.bool_:
                raise DataDependent("boolean-mask indexing has a data-dependent shape")
            parts.append(f"ARR({len(arrays)})")
            arrays.append(it)
            basic = False
        elif it is None or it is Ellipsis or isinstance(it, slice | int | np.integer):
            parts.append(repr(int(it)) if isinstance(it, np.integer) else repr(it))
        elif isinstance(it, list):
            raise TraceUnsupported("list indices are not traced")
        else:
            raise TraceUnsupported(f"index component {type(it).__name__} is not traced")
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")", arrays, basic


class TracedArray:
    """A value of the traced graph; behaves like the NumPy/CuPy array it wraps."""

    __slots__ = ("tr", "vid", "v", "root", "ver", "bver")
    __array_priority__ = 10000
    __hash__ = object.__hash__

    def __init__(self, tr, vid: int, value, root=None):
        self.tr, self.vid, self.v = tr, vid, value
        self.root = self if root is None else root
        self.ver = 0
        self.bver = self.root.ver

    # ---- metadata from the concrete value ----
    shape = property(lambda self: self.v.shape)
    dtype = property(lambda self: self.v.dtype)
    ndim = property(lambda self: self.v.ndim)
    size = property(lambda self: self.v.size)
    itemsize = property(lambda self: self.v.itemsize)
    nbytes = property(lambda self: self.v.nbytes)
    strides = property(lambda self: self.v.strides)
    flags = property(lambda self: self.v.flags)
    base = property(lambda self: None)
    device = property(lambda self: self.v.device)
    T = property(lambda self: self.transpose())

    def __len__(self):
        return self.v.shape[0]

    def __repr__(self):
        return f"TracedArray(%{self.vid}, shape={self.v.shape}, dtype={self.v.dtype})"

    def __bool__(self):
        raise DataDependent("bool() of a traced array")

    def __int__(self):
        raise DataDependent("int() of a traced array")

    def __float__(self):
        raise DataDependent("float() of a traced array")

    def __index__(self):
        raise DataDependent("a traced array used as an index")

    def item(self, *a):
        raise DataDependent("item() of a traced array")

    def tolist(self):
        raise DataDependent("tolist() of a traced array")

    def __iter__(self):
        raise TraceUnsupported("iteration over a traced array")

    # ---- NumPy protocols ----
    def __array__(self, *a, **k):
        raise DataDependent("conversion of a traced array to a NumPy array")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        tr = self.tr
        if method == "at" and ufunc is np.add:
            out, index, values = inputs
            tr.scatter_add(out, index, values)
            return None
        if method != "__call__":
            raise TraceUnsupported(f"ufunc method {ufunc.__name__}.{method}")
        name = UFUNCS.get(ufunc.__name__)
        if name is None:
            raise TraceUnsupported(f"ufunc {ufunc.__name__}")
        out = kwargs.pop("out", None)
        if kwargs:
            raise TraceUnsupported(f"ufunc {ufunc.__name__} with {sorted(kwargs)}")
        res = tr.ew(name, *inputs)
        if out is not None:
            (o,) = out
            if not isinstance(o, TracedArray):
                raise TraceUnsupported("in-place write into an array that is not traced")
            tr.assign(o, res)
            return o
        return res

    def __array_function__(self, func, types, args, kwargs):
        return self.tr.array_function(func, args, kwargs)

    # ---- operators ----
    def _bin(name, swap=False):  # noqa: N805
        def f(self, other):
            return self.tr.ew(name, other, self) if swap else self.tr.ew(name, self, other)
        return f

    def _ibin(name):  # noqa: N805
        def f(self, other):
            self.tr.assign(self, self.tr.ew(name, self, other))
            return self
        return f

    __add__, __radd__, __iadd__ = _bin("add"), _bin("add", True), _ibin("add")
    __sub__, __rsub__, __isub__ = _bin("sub"), _bin("sub", True), _ibin("sub")
    __mul__, __rmul__, __imul__ = _bin("mul"), _bin("mul", True), _ibin("mul")
    __truediv__, __rtruediv__, __itruediv__ = _bin("div"), _bin("div", True), _ibin("div")
    __and__, __rand__, __iand__ = _bin("and"), _bin("and", True), _ibin("and")
    __or__, __ror__, __ior__ = _bin("or"), _bin("or", True), _ibin("or")
    __xor__, __rxor__ = _bin("xor"), _bin("xor", True)
    __eq__, __ne__ = _bin("eq"), _bin("ne")
    __lt__, __le__, __gt__, __ge__ = _bin("lt"), _bin("le"), _bin("gt"), _bin("ge")
    __rpow__ = _bin("pow", True)
    del _bin, _ibin

    def __pow__(self, other):
        # NumPy's scalar fast paths for ``**`` (square, sqrt, reciprocal) keep their exact results
        if isinstance(other, int | float) and not isinstance(other, bool) and self.dtype.kind == "f":
            if other == 2:
                return self.tr.ew("square", self)
            if other == 0.5:
                return self.tr.ew("sqrt", self)
            if other == -1:
                return self.tr.ew("recip", self)
            if other == 1:
                return self.tr.ew("copy", self)
        return self.tr.ew("pow", self, other)

    def __ipow__(self, other):
        self.tr.assign(self, self ** other)
        return self

    def __neg__(self):
        return self.tr.ew("neg", self)

    def __pos__(self):
        return self

    def __abs__(self):
        return self.tr.ew("abs", self)

    def __invert__(self):
        if self.dtype != np.bool_:
            raise TraceUnsupported("bitwise invert of integers")
        return self.tr.ew("not", self)

    def __matmul__(self, other):
        return self.tr.matmul(self, other)

    def __rmatmul__(self, other):
        return self.tr.matmul(other, self)

    def __getitem__(self, index):
        return self.tr.getitem(self, index)

    def __setitem__(self, index, value):
        self.tr.setitem(self, index, value)

    # ---- methods ----
    def reshape(self, *shape, order="C"):
        if len(shape) == 1 and isinstance(shape[0], tuple | list):
            shape = tuple(shape[0])
        return self.tr.reshape(self, shape)

    def transpose(self, *axes):
        if len(axes) == 1 and isinstance(axes[0], tuple | list):
            axes = tuple(axes[0])
        perm = tuple(int(a) % self.ndim for a in axes) if axes else tuple(reversed(range(self.ndim)))
        return self.tr.transpose(self, perm)

    def swapaxes(self, a, b):
        perm = list(range(self.ndim))
        a, b = a % self.ndim, b % self.ndim
        perm[a], perm[b] = perm[b], perm[a]
        return self.tr.transpose(self, tuple(perm))

    def squeeze(self, axis=None):
        ax = norm_axes(axis, self.ndim) if axis is not None else tuple(i for i, s in enumerate(self.shape) if s == 1)
        return self.tr.reshape(self, tuple(s for i, s in enumerate(self.shape) if i not in ax))

    def flatten(self):
        return self.tr.reshape(self, (-1,))

    ravel = flatten

    def sum(self, axis=None, keepdims=False, dtype=None):
        return self.tr.reduce("sum", self, axis, keepdims, dtype)

    def mean(self, axis=None, keepdims=False, dtype=None):
        return self.tr.reduce("mean", self, axis, keepdims, dtype)

    def max(self, axis=None, keepdims=False):
        return self.tr.reduce("max", self, axis, keepdims)

    def min(self, axis=None, keepdims=False):
        return self.tr.reduce("min", self, axis, keepdims)

    def any(self, axis=None, keepdims=False):
        return self.tr.reduce("max", self.astype(np.bool_), axis, keepdims)

    def all(self, axis=None, keepdims=False):
        return self.tr.reduce("min", self.astype(np.bool_), axis, keepdims)

    def argmax(self, axis=None):
        return self.tr.argreduce("argmax", self, axis)

    def argmin(self, axis=None):
        return self.tr.argreduce("argmin", self, axis)

    def astype(self, dtype, copy=True):
        dt = np.dtype(dtype)
        if dt == self.dtype:
            return self.tr.ew("copy", self) if copy else self
        return self.tr.cast(self, dt)

    def copy(self):
        return self.tr.ew("copy", self)

    def take(self, i, axis=None):
        if not isinstance(i, int | np.integer) or axis is None:
            raise TraceUnsupported("take() with array indices")
        idx = [slice(None)] * self.ndim
        idx[axis] = int(i)
        return self.tr.getitem(self, tuple(idx))

    def fill(self, value):
        self.tr.assign(self, self.tr.full(self.shape, self.dtype, value))


assert set(UFUNCS.values()) <= set(ELEMENTWISE)
