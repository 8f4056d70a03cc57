"""Tensor creation: tensor, zeros, ones, empty, full, arange, randn, rand, randint and *_like."""

from __future__ import annotations

import numbers
import operator

import numpy as np

from blutensor import random as _random
from blutensor.backends import xp_of
from blutensor.device import as_device
from blutensor.dtypes import as_dtype, bfloat16, bool_, from_numpy_dtype, get_default_dtype, int64
from blutensor.errors import ArgumentError, DTypeError, ShapeError


def _host_to(arr: np.ndarray, dt, dev):
    """Put a host array of dtype ``dt.np`` on ``dev`` in that device's storage dtype."""
    if dev.type == "cpu":
        return arr
    xp = xp_of(dev)
    if dt is bfloat16:
        arr = arr.view(np.uint16)
    with xp.cuda.Device(dev.index):
        return xp.asarray(arr)


def _wrap(arr, dt, dev, requires_grad=False):
    from blutensor._tensor import Tensor

    t = Tensor._from_data(arr, dt, dev)
    if requires_grad:
        t.requires_grad_(True)
    return t


def tensor(data, dtype=None, device=None, requires_grad: bool = False):
    """A new tensor copied from ``data`` (nested lists, scalars, NumPy/CuPy arrays or a Tensor)."""
    from blutensor._tensor import Tensor

    dev = as_device(device)
    if isinstance(data, Tensor):
        out = data.detach().to(dev if device is not None else data.device)
        out = out.to(as_dtype(dtype)) if dtype is not None else out
        out = _wrap(out._data.copy(), out.dtype, out.device, requires_grad)
        return out
    typed = isinstance(data, np.ndarray | np.generic) or hasattr(data, "__cuda_array_interface__")
    arr = data.get() if hasattr(data, "__cuda_array_interface__") else _host_array(data)
    if dtype is not None:
        dt = as_dtype(dtype)
    elif typed:
        dt = from_numpy_dtype(arr.dtype)
    elif arr.dtype.kind == "f":
        dt = get_default_dtype()
    elif arr.dtype.kind == "b":
        dt = bool_
    elif arr.dtype.kind in "iu":
        dt = int64
    else:
        dt = from_numpy_dtype(arr.dtype)
    if not dt.is_floating_point and dt is not bool_ and arr.dtype.kind in "iuf" and arr.size \
            and not np.can_cast(arr.dtype, dt.np):
        _check_int_range(arr, dt)
    arr = np.array(arr, dtype=dt.np, copy=True)
    return _wrap(_host_to(arr, dt, dev), dt, dev, requires_grad)


def _host_array(data) -> np.ndarray:
    """``np.asarray(data)``, with ragged nesting and non-numeric data reported as blutensor errors."""
    try:
        arr = np.asarray(data)
    except ValueError as e:  # NumPy >= 1.24 refuses ragged nested sequences
        raise ShapeError(f"tensor: data is ragged (nested sequences of different lengths): {e}") from None
    if arr.dtype.kind not in "biuf" and arr.dtype != bfloat16.np:
        kind = "ragged or non-numeric" if arr.dtype == object else "non-numeric"
        raise DTypeError(f"tensor: cannot make a tensor from {kind} data of NumPy dtype {arr.dtype} "
                         f"({type(data).__name__}); expected numbers, bools or nested lists of them")
    return arr


def _check_int_range(arr: np.ndarray, dt) -> None:
    """Raise unless every value of ``arr`` fits integer dtype ``dt`` (no silent wrap-around or NaN cast)."""
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise ArgumentError(f"tensor: NaN or inf in the data cannot be converted to {dt.name}")
    info = np.iinfo(dt.np)
    lo, hi = arr.min(), arr.max()
    if lo < info.min or hi > info.max:
        bad = lo if lo < info.min else hi
        raise ArgumentError(f"tensor: value {bad} is out of range for {dt.name} [{info.min}, {info.max}]")


def from_numpy(arr: np.ndarray):
    """A CPU tensor sharing memory with ``arr``."""
    if not isinstance(arr, np.ndarray):
        raise DTypeError(f"from_numpy: expected a numpy.ndarray, got {type(arr).__name__} "
                         f"(use blutensor.tensor() for lists and scalars)")
    return _wrap(arr, from_numpy_dtype(arr.dtype), as_device("cpu"))


def _shape(size, op: str = "zeros") -> tuple:
    """A size given as ints or one list/tuple of ints, checked: integers (not floats), none negative."""
    if len(size) == 1 and isinstance(size[0], list | tuple):
        size = size[0]
    try:
        shape = tuple(operator.index(s) for s in size)
    except TypeError:
        raise DTypeError(f"{op}: size must be a sequence of ints, got {tuple(size)!r}") from None
    for s in shape:
        if s < 0:
            raise ShapeError(f"{op}: size {shape} has a negative dimension")
    return shape


def _make(fill, size, dtype, device, requires_grad, op: str = "zeros"):
    shape = _shape(size, op)
    dt = as_dtype(dtype) if dtype is not None else get_default_dtype()
    dev = as_device(device)
    xp = xp_of(dev)
    store = dt.cuda_storage if dev.type == "cuda" else dt.np
    if dev.type == "cuda":
        with xp.cuda.Device(dev.index):
            arr = _fill(xp, shape, store, fill, dt)
    else:
        arr = _fill(xp, shape, store, fill, dt)
    return _wrap(arr, dt, dev, requires_grad)


def _fill(xp, shape, store, fill, dt):
    if fill is None:
        return xp.empty(shape, dtype=store)
    if fill == 0:
        return xp.zeros(shape, dtype=store)
    if dt is bfloat16 and store == np.uint16:
        bits = int(np.asarray(fill, dtype=bfloat16.np).view(np.uint16))
        return xp.full(shape, bits, dtype=store)
    return xp.full(shape, fill, dtype=store)


def zeros(*size, dtype=None, device=None, requires_grad: bool = False):
    return _make(0, size, dtype, device, requires_grad, "zeros")


def ones(*size, dtype=None, device=None, requires_grad: bool = False):
    return _make(1, size, dtype, device, requires_grad, "ones")


def empty(*size, dtype=None, device=None, requires_grad: bool = False):
    return _make(None, size, dtype, device, requires_grad, "empty")


def full(size, fill_value, dtype=None, device=None, requires_grad: bool = False):
    if dtype is None and isinstance(fill_value, bool):
        dtype = bool_
    elif dtype is None and isinstance(fill_value, int):
        dtype = int64
    if not isinstance(fill_value, numbers.Number | np.generic):
        raise DTypeError(f"full: fill_value must be a number, got {type(fill_value).__name__} {fill_value!r}")
    return _make(fill_value, (size,) if isinstance(size, int) else tuple(size), dtype, device, requires_grad,
                 "full")


def arange(start, end=None, step=1, dtype=None, device=None, requires_grad: bool = False):
    if end is None:
        start, end = 0, start
    for name, v in (("start", start), ("end", end), ("step", step)):
        if not isinstance(v, numbers.Real):
            raise DTypeError(f"arange: {name} must be a number, got {type(v).__name__} {v!r}")
    if step == 0:
        raise ArgumentError(f"arange: step must be nonzero (start={start}, end={end})")
    if dtype is None:
        dtype = int64 if all(isinstance(v, int) for v in (start, end, step)) else get_default_dtype()
    dt = as_dtype(dtype)
    arr = np.arange(start, end, step, dtype=np.float64 if dt.is_floating_point else np.int64).astype(dt.np)
    dev = as_device(device)
    return _wrap(_host_to(arr, dt, dev), dt, dev, requires_grad)


def linspace(start: float, end: float, steps: int, dtype=None, device=None):
    if not isinstance(steps, numbers.Integral) or steps < 0:
        raise ArgumentError(f"linspace: steps must be a non-negative int, got {steps!r}")
    dt = as_dtype(dtype) if dtype is not None else get_default_dtype()
    dev = as_device(device)
    return _wrap(_host_to(np.linspace(start, end, steps).astype(dt.np), dt, dev), dt, dev)


def _generator(generator):
    """``generator`` or the default one; anything else is refused before drawing."""
    if generator is None:
        return _random.default_generator
    if not isinstance(generator, _random.Generator):
        raise DTypeError(f"generator must be a blutensor.Generator, got {type(generator).__name__}")
    return generator


def _normal_array(shape, dt, dev, generator=None, mean: float = 0.0, std: float = 1.0):
    """Normal(mean, std) samples in ``dt``'s storage on ``dev`` (drawn and scaled in float32/64)."""
    gen = _generator(generator)
    xp = xp_of(dev)
    compute = np.float64 if dt.np == np.float64 else np.float32
    with _on(dev, xp):
        z = gen.normal(shape, xp, compute)
        if std != 1.0 or mean != 0.0:
            z = z * compute(std) + compute(mean)
        return _store(z, dt, xp)


def _uniform_array(shape, dt, dev, generator=None, low: float = 0.0, high: float = 1.0):
    """Uniform[low, high) samples in ``dt``'s storage on ``dev``."""
    gen = _generator(generator)
    xp = xp_of(dev)
    compute = np.float64 if dt.np == np.float64 else np.float32
    with _on(dev, xp):
        u = gen.uniform(shape, xp, compute)
        if low != 0.0 or high != 1.0:
            u = u * compute(high - low) + compute(low)
        return _store(u, dt, xp)


def _on(dev, xp):
    """Context that makes ``dev`` current for CuPy allocations (a no-op on the CPU)."""
    import contextlib

    return xp.cuda.Device(dev.index) if dev.type == "cuda" else contextlib.nullcontext()


def _store(arr, dt, xp):
    if dt is bfloat16:
        if xp is np:
            return arr.astype(bfloat16.np)
        from blutensor.backends import f32_to_bf16_bits

        return f32_to_bf16_bits(arr, xp)
    return arr.astype(dt.np, copy=False)


def randn(*size, dtype=None, device=None, requires_grad: bool = False, generator=None):
    """Standard-normal samples from the Philox stream (identical on CPU and CUDA)."""
    dt = as_dtype(dtype) if dtype is not None else get_default_dtype()
    dev = as_device(device)
    return _wrap(_normal_array(_shape(size, "randn"), dt, dev, generator), dt, dev, requires_grad)


def rand(*size, dtype=None, device=None, requires_grad: bool = False, generator=None):
    """Uniform [0, 1) samples from the Philox stream."""
    dt = as_dtype(dtype) if dtype is not None else get_default_dtype()
    dev = as_device(device)
    return _wrap(_uniform_array(_shape(size, "rand"), dt, dev, generator), dt, dev, requires_grad)


def randint(low: int, high=None, size=(), dtype=None, device=None, generator=None):
    """Uniform integers in [low, high): ``randint(high, size)`` or ``randint(low, high, size)`` (PyTorch's two
    overloads; a tuple/list second argument is the size)."""
    if isinstance(high, list | tuple):
        low, high, size = 0, low, high
    if high is None:
        low, high = 0, low
    if low >= high:
        raise ArgumentError(f"randint: low ({low}) must be less than high ({high})")
    shape = _shape((size,) if isinstance(size, int) else tuple(size), "randint")
    gen = _generator(generator)
    dev = as_device(device)
    xp = xp_of(dev)
    dt = as_dtype(dtype) if dtype is not None else int64
    with _on(dev, xp):
        arr = gen.integers(low, high, shape, xp)
        arr = arr.astype(dt.np)
    return _wrap(arr, dt, dev)


def _like(fn, t, dtype, device, **kw):
    if not hasattr(t, "shape") or not hasattr(t, "dtype"):
        raise DTypeError(f"{fn.__name__}_like: expected a Tensor, got {type(t).__name__}")
    return fn(*t.shape, dtype=dtype or t.dtype, device=device or t.device, **kw)


def zeros_like(t, dtype=None, device=None, requires_grad: bool = False):
    return _like(zeros, t, dtype, device, requires_grad=requires_grad)


def ones_like(t, dtype=None, device=None, requires_grad: bool = False):
    return _like(ones, t, dtype, device, requires_grad=requires_grad)


def empty_like(t, dtype=None, device=None, requires_grad: bool = False):
    return _like(empty, t, dtype, device, requires_grad=requires_grad)


def full_like(t, fill_value, dtype=None, device=None):
    if not hasattr(t, "shape") or not hasattr(t, "dtype"):
        raise DTypeError(f"full_like: expected a Tensor, got {type(t).__name__}")
    return full(t.shape, fill_value, dtype=dtype or t.dtype, device=device or t.device)


def randn_like(t, dtype=None, device=None):
    return _like(randn, t, dtype, device)


def rand_like(t, dtype=None, device=None):
    return _like(rand, t, dtype, device)


def eye(n: int, m: int | None = None, dtype=None, device=None, requires_grad: bool = False):
    """The n x m identity matrix (m defaults to n)."""
    m = n if m is None else m
    for name, v in (("n", n), ("m", m)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ArgumentError(f"eye: {name} must be a non-negative int, got {v!r}")
    dt = as_dtype(dtype) if dtype is not None else get_default_dtype()
    return tensor(np.eye(n, m, dtype=dt.np), dtype=dt, device=device, requires_grad=requires_grad)


def _tri_indices(op, fn, row, col, offset, dtype, device):
    for name, v in (("row", row), ("col", col), ("offset", offset)):
        if isinstance(v, bool) or not isinstance(v, int) or (name != "offset" and v < 0):
            raise ArgumentError(f"{op}: {name} must be {'an' if name == 'offset' else 'a non-negative'} int, "
                                f"got {v!r}")
    r, c = fn(row, offset, col)
    return tensor(np.stack([r, c]).astype(np.int64).reshape(2, -1), dtype=dtype or int64, device=device)


def tril_indices(row: int, col: int, offset: int = 0, dtype=None, device=None):
    """(2, N) row/column indices of the lower triangle (diagonal ``offset``), row-major as PyTorch orders them."""
    return _tri_indices("tril_indices", np.tril_indices, row, col, offset, dtype, device)


def triu_indices(row: int, col: int, offset: int = 0, dtype=None, device=None):
    """(2, N) row/column indices of the upper triangle (diagonal ``offset``)."""
    return _tri_indices("triu_indices", np.triu_indices, row, col, offset, dtype, device)


def meshgrid(*tensors, indexing: str = "ij"):
    """Coordinate grids from 1-D tensors (``indexing="ij"``: matrix, ``"xy"``: Cartesian); each grid is an
    expanded view of its input, differentiable."""
    if len(tensors) == 1 and isinstance(tensors[0], list | tuple):
        tensors = tuple(tensors[0])
    if indexing not in ("ij", "xy"):
        raise ArgumentError(f"meshgrid: indexing must be 'ij' or 'xy', got {indexing!r}")
    for i, t in enumerate(tensors):
        if not hasattr(t, "_data") or t.ndim > 1:
            got = t._desc() if hasattr(t, "_desc") else type(t).__name__
            raise ShapeError(f"meshgrid: tensor {i} must be 0-d or 1-d, got {got}")
    ts = [t.reshape(-1) for t in tensors]
    swap = indexing == "xy" and len(ts) >= 2
    if swap:
        ts[0], ts[1] = ts[1], ts[0]
    shape = tuple(t.shape[0] for t in ts)
    n = len(ts)
    out = [t.reshape((1,) * i + (-1,) + (1,) * (n - i - 1)).expand(shape) for i, t in enumerate(ts)]
    if swap:
        out[0], out[1] = out[1], out[0]
    return tuple(out)
