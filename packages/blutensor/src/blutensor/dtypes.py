"""dtypes: float32 (default), float64, bfloat16 (via ml_dtypes), int32, int64, uint16, bool."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from blutensor.errors import DTypeError


class dtype:  # noqa: N801 - PyTorch's name
    """A blutensor dtype: its name, its NumPy dtype, and how CUDA stores it."""

    __slots__ = ("name", "np", "itemsize", "is_floating_point", "cuda_storage", "bf16")

    def __init__(self, name: str, np_dtype, is_float: bool, cuda_storage=None):
        self.name = name
        self.np = np.dtype(np_dtype)
        self.itemsize = self.np.itemsize
        self.is_floating_point = is_float
        # CuPy has no bfloat16: on CUDA it is kept as raw 16-bit storage
        self.cuda_storage = np.dtype(cuda_storage) if cuda_storage is not None else self.np
        self.bf16 = name == "bfloat16"  # fast test on the dispatch hot path

    def __repr__(self) -> str:
        return f"blutensor.{self.name}"

    def __reduce__(self):
        return (_by_name, (self.name,))


float32 = dtype("float32", np.float32, True)
float64 = dtype("float64", np.float64, True)
bfloat16 = dtype("bfloat16", ml_dtypes.bfloat16, True, cuda_storage=np.uint16)
int32 = dtype("int32", np.int32, False)
int64 = dtype("int64", np.int64, False)
uint16 = dtype("uint16", np.uint16, False)
bool_ = dtype("bool", np.bool_, False)
float16 = dtype("float16", np.float16, True)

ALL = (float32, float64, bfloat16, int32, int64, uint16, bool_, float16)
_NAMES = {d.name: d for d in ALL}
_NAMES.update({"float": float32, "double": float64, "long": int64, "int": int32, "bf16": bfloat16,
               "fp32": float32, "fp64": float64, "half": float16})
_FROM_NP = {d.np: d for d in ALL}

_default = float32


def _by_name(name: str) -> dtype:
    return _NAMES[name]


def get_default_dtype() -> dtype:
    return _default


def set_default_dtype(d: dtype) -> None:
    """Set the dtype used for floating-point tensors created from Python floats."""
    global _default
    d = as_dtype(d)
    if not d.is_floating_point:
        raise DTypeError(f"set_default_dtype: only floating-point dtypes can be the default, got {d.name}")
    _default = d


def as_dtype(d) -> dtype:
    """Turn a blutensor dtype, its name or a NumPy dtype into a blutensor dtype."""
    if isinstance(d, dtype):
        return d
    if isinstance(d, str):
        try:
            return _NAMES[d]
        except KeyError:
            raise DTypeError(f"unknown dtype {d!r}; known: {', '.join(x.name for x in ALL)}") from None
    try:
        return _FROM_NP[np.dtype(d)]
    except (KeyError, TypeError):
        raise DTypeError(f"unsupported dtype {d!r}; known: {', '.join(x.name for x in ALL)}") from None


def from_numpy_dtype(npd) -> dtype:
    npd = np.dtype(npd)
    d = _FROM_NP.get(npd)
    if d is not None:
        return d
    if npd.kind == "f":
        return float32
    if npd.kind in "iu":
        return int64
    if npd.kind == "b":
        return bool_
    raise DTypeError(f"unsupported NumPy dtype {npd}; known: {', '.join(x.name for x in ALL)}")


# ---- type promotion (PyTorch's torch.promote_types / torch.result_type) ----

#: category of a dtype: bool < integer < floating point; a higher category wins over size
def _category(d: dtype) -> int:
    return 2 if d.is_floating_point else (0 if d is bool_ else 1)


_RANK = {bool_: 0, uint16: 1, int32: 2, int64: 3, float16: 4, bfloat16: 4, float32: 5, float64: 6}


def promote_types(a, b) -> dtype:
    """The smallest dtype both ``a`` and ``b`` convert to without losing their category (PyTorch's table:
    bool < uint16 < int32 < int64 < float16, bfloat16 < float32 < float64; float16 with bfloat16 is float32)."""
    a, b = as_dtype(a), as_dtype(b)
    if a is b:
        return a
    if {a, b} == {float16, bfloat16}:
        return float32
    return a if _RANK[a] > _RANK[b] else b


def _scalar_dtype(x) -> dtype:
    """The dtype a Python number takes as a weak operand: bool, int64 or the default float dtype."""
    if isinstance(x, bool | np.bool_):
        return bool_
    if isinstance(x, int | np.integer):
        return int64
    if isinstance(x, float | np.floating):
        return _default
    raise DTypeError(f"result_type: expected Tensors or real numbers, got {type(x).__name__} {x!r:.40}")


def _combine(higher, lower):
    """PyTorch's combine_categories: a lower tier only counts when its category is higher."""
    if higher is None:
        return lower
    if lower is None or higher.is_floating_point:
        return higher
    if higher is bool_ or lower.is_floating_point:
        return promote_types(higher, lower)
    return higher


def result_type(*operands) -> dtype:
    """PyTorch's ``torch.result_type`` over Tensors and Python numbers.

    Three tiers, each promoted within itself with :func:`promote_types`: tensors with dims, 0-d tensors and
    Python numbers (weak: bool, int64, or the default float dtype). A lower tier changes the result only when
    its category (bool < integer < float) is higher: ``int32 tensor + 5`` is int32, ``int32 tensor + 5.5``
    float32, ``float32 tensor + float64 0-d tensor`` float32, ``int64 tensor + float64 0-d tensor`` float64."""
    dim = zero = wrapped = None
    for x in operands:
        dt = getattr(x, "dtype", None)
        if isinstance(dt, dtype) and hasattr(x, "ndim"):
            if x.ndim:
                dim = dt if dim is None else promote_types(dim, dt)
            else:
                zero = dt if zero is None else promote_types(zero, dt)
        else:
            s = _scalar_dtype(x)
            wrapped = s if wrapped is None else promote_types(wrapped, s)
    out = _combine(dim, _combine(zero, wrapped))
    if out is None:
        raise DTypeError("result_type: expected at least one operand")
    return out
