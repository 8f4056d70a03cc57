"""Threaded host copies and reductions the step makes outside its fused kernels (kernels.c), float32.

:func:`contiguous` is ``np.ascontiguousarray`` with the rows of the copy split over blutensor's CPU threads (the
transposing copies around attention: NumPy copies on one core); :func:`col_sum` is ``x.sum(axis=0)`` of a 2-D
array (the bias gradient of ``linear``) with column blocks split over the threads, rows added in NumPy's order,
so both return exactly NumPy's values. Small arrays, other dtypes, one thread or no compiled library: NumPy.
"""

from __future__ import annotations

import numpy as np

from blutensor.backends.numpy._build import lib as _lib

_F32 = np.dtype(np.float32)
#: below this many elements NumPy's single-threaded call is as fast (memory-bound copy; waking threads ~20 us)
MIN_ELEMENTS = 1 << 17


def _threads() -> int:
    from blutensor.ops import linalg

    return linalg._threads[0]


def contiguous(a: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of ``a`` (``a`` itself when already contiguous), as ``np.ascontiguousarray``."""
    if (type(a) is not np.ndarray or a.flags.c_contiguous or a.dtype != _F32 or a.size < MIN_ELEMENTS
            or a.ndim > 8 or _threads() < 2 or any(s % 4 for s in a.strides)):
        return np.ascontiguousarray(a)
    lib = _lib()
    if lib is None:
        return np.ascontiguousarray(a)
    out = np.empty(a.shape, _F32)
    shape = np.array(a.shape, np.int64)
    strides = np.array([s // 4 for s in a.strides], np.int64)
    lib.blu_copy_strided(a.ctypes.data, out.ctypes.data, a.ndim, shape.ctypes.data, strides.ctypes.data)
    return out


def col_sum(x: np.ndarray) -> np.ndarray:
    """``x.sum(axis=0)`` of a 2-D array (float32 C-contiguous ones on the compiled kernels' threads)."""
    if (type(x) is not np.ndarray or x.ndim != 2 or x.dtype != _F32 or not x.flags.c_contiguous
            or x.size < MIN_ELEMENTS or _threads() < 2):
        return x.sum(axis=0)
    lib = _lib()
    if lib is None:
        return x.sum(axis=0)
    out = np.empty(x.shape[1], _F32)
    lib.blu_col_sum(x.ctypes.data, out.ctypes.data, x.shape[0], x.shape[1])
    return out
