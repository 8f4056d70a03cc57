"""AdamW update and gradient norm over all parameters on the CPU (kernels.c), float32.

``adamw_`` performs exactly the float32 operations of ``blutensor.optim.adamw.adamw_update`` in the same
order (bit-identical results) in one threaded pass instead of eight NumPy passes. ``clip_grads_`` is the
fixed-order sum of squares of every gradient in one threaded call (float64 partials), then the clip.
"""

from __future__ import annotations

import math

import numpy as np

from blutensor.backends.numpy._build import lib as _lib

_F32 = np.dtype(np.float32)


def _plain(*arrays) -> bool:
    return all(type(a) is np.ndarray and a.dtype == _F32 and a.flags.c_contiguous for a in arrays)


def adamw_(x, g, m, v, step: int, lr: float, b1: float, b2: float, eps: float, wd: float) -> bool:
    """One AdamW update of float32 ``x`` in place (moments ``m``, ``v``); False when it does not apply
    (not contiguous float32 host arrays, or no compiled library) and the caller runs the reference."""
    if not _plain(x, g, m, v) or not x.shape == g.shape == m.shape == v.shape:
        return False
    lib = _lib()
    if lib is None:
        return False
    f = np.float32
    bc1 = 1 - b1 ** step
    bc2_sqrt = math.sqrt(1 - b2 ** step)
    lib.blu_adamw(x.ctypes.data, g.ctypes.data, m.ctypes.data, v.ctypes.data, x.size, f(1 - lr * wd), f(1 - b1),
                  f(b2), f(1 - b2), f(bc2_sqrt), f(eps), f(-(lr / bc1)))
    return True


def clip_grads_(grads: list, max_norm: float):
    """The L2 norm of all ``grads`` (0-d float32 array), and the clip by min(1, max_norm / (norm + 1e-6)) in
    place; None when they are not all contiguous float32 host arrays or there is no compiled library."""
    if not grads or not _plain(*grads):
        return None
    lib = _lib()
    if lib is None:
        return None
    ptrs = np.array([a.ctypes.data for a in grads], np.int64)
    lens = np.array([a.size for a in grads], np.int64)
    part = np.empty(max(1, int(sum(-(-n // 16384) for n in lens.tolist()))), np.float64)
    ss = np.empty(len(grads), np.float64)
    lib.blu_sum_squares(ptrs.ctypes.data, lens.ctypes.data, len(grads), part.ctypes.data, ss.ctypes.data)
    total = np.asarray(math.sqrt(float(ss.sum())), _F32)
    coef = min(max_norm / (float(total) + 1e-6), 1.0)
    if coef < 1.0:  # a NaN/inf norm leaves the gradients as they are (as the reference does)
        lib.blu_scale_(ptrs.ctypes.data, lens.ctypes.data, len(grads), np.float32(coef))
    return total, coef < 1.0
