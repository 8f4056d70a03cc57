"""The compiled CPU kernels of ``F.add_rms_norm`` and ``F.add_layer_norm`` (kernels.c ``blu_add_rms_norm_*``,
``blu_add_layer_norm_*``, float32): the residual add and the norm in one pass over each row, the backward in one
pass with the residual gradient added and dweight (and dbias) from fixed row blocks summed in order. LayerNorm's
arithmetic is ``blu_layer_norm_*``'s and RMSNorm's ``blu_rms_norm_*``'s: the fused ops' results are bitwise add +
layer_norm's and add + rms_norm's. :func:`usable` says
when they serve a call (else the NumPy reference)."""

from __future__ import annotations

import numpy as np

from blutensor.backends.numpy._build import lib as _lib

_F32 = np.dtype(np.float32)
BLOCK = 32  # rows per dweight partial (LN_BLOCK in kernels.c)


def usable(*arrays) -> bool:
    """The library is built and every given array is a float32 NumPy array (a tracer's arrays take the reference)."""
    return _lib() is not None and all(a is None or (type(a) is np.ndarray and a.dtype == _F32) for a in arrays)


def forward(x2, r2, w, eps: float):
    """(h, y, rstd (N,)) for rows x2, r2 (N, C) float32 and w (C,) or None."""
    x2, r2 = np.ascontiguousarray(x2), np.ascontiguousarray(r2)
    w = None if w is None else np.ascontiguousarray(w)
    N, C = x2.shape
    h, y = np.empty_like(r2), np.empty_like(r2)
    rstd = np.empty(N, _F32)
    _lib().blu_add_rms_norm_forward(x2.ctypes.data, r2.ctypes.data, None if w is None else w.ctypes.data,
                                    h.ctypes.data, y.ctypes.data, rstd.ctypes.data, N, C, float(eps))
    return h, y, rstd


def backward(gy, gh, h, w, rstd, need_dw: bool):
    """(dsum, dw) from the gradients of y and h (either may be None); dw None unless asked and w is given."""
    N, C = h.shape
    gy = None if gy is None else np.ascontiguousarray(gy, dtype=_F32)
    gh = None if gh is None else np.ascontiguousarray(gh, dtype=_F32)
    dsum = np.empty_like(h)
    dw = np.empty(C, _F32) if need_dw and w is not None else None
    part = np.empty(max(1, -(-N // BLOCK) * C) if dw is not None else 1, _F32)
    _lib().blu_add_rms_norm_backward(None if gy is None else gy.ctypes.data, None if gh is None else gh.ctypes.data,
                                     h.ctypes.data, None if w is None else w.ctypes.data, rstd.ctypes.data,
                                     dsum.ctypes.data, part.ctypes.data, None if dw is None else dw.ctypes.data, N, C)
    return dsum, dw


def ln_forward(x2, r2, w, b, eps: float):
    """(h, y, mean (N,), rstd (N,)) of the residual add + LayerNorm for rows x2, r2 (N, C) float32; w, b (C,) or
    None."""
    x2, r2 = np.ascontiguousarray(x2), np.ascontiguousarray(r2)
    w = None if w is None else np.ascontiguousarray(w)
    b = None if b is None else np.ascontiguousarray(b)
    N, C = x2.shape
    h, y = np.empty_like(r2), np.empty_like(r2)
    mean, rstd = np.empty(N, _F32), np.empty(N, _F32)
    _lib().blu_add_layer_norm_forward(x2.ctypes.data, r2.ctypes.data, None if w is None else w.ctypes.data,
                                      None if b is None else b.ctypes.data, h.ctypes.data, y.ctypes.data,
                                      mean.ctypes.data, rstd.ctypes.data, N, C, float(eps))
    return h, y, mean, rstd


def ln_backward(gy, gh, h, w, mean, rstd, need_dw: bool, need_db: bool):
    """(dsum, dw, db) from the gradients of y and h (either may be None); dw / db None unless asked (dw: and w is
    given); zeros when only h got a gradient."""
    N, C = h.shape
    gy = None if gy is None else np.ascontiguousarray(gy, dtype=_F32)
    gh = None if gh is None else np.ascontiguousarray(gh, dtype=_F32)
    dsum = np.empty_like(h)
    dw = np.empty(C, _F32) if need_dw and w is not None else None
    db = np.empty(C, _F32) if need_db else None
    part = np.empty(max(1, -(-N // BLOCK) * 2 * C) if dw is not None or db is not None else 1, _F32)
    _lib().blu_add_layer_norm_backward(None if gy is None else gy.ctypes.data, None if gh is None else gh.ctypes.data,
                                       h.ctypes.data, None if w is None else w.ctypes.data, mean.ctypes.data,
                                       rstd.ctypes.data, dsum.ctypes.data, part.ctypes.data,
                                       None if dw is None else dw.ctypes.data, None if db is None else db.ctypes.data,
                                       N, C)
    return dsum, dw, db
