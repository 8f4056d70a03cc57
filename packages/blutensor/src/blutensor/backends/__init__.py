"""Array backends: NumPy for ``cpu``, CuPy for ``cuda``; bfloat16 <-> float32 conversion on both."""

from __future__ import annotations

import numpy as np

from blutensor.device import device
from blutensor.errors import DeviceError

_cupy = None
_cupy_error: str | None = None
INSTALL_HINT = ("install CuPy for your CUDA version: pip install 'blutensor[cuda12]' (CUDA 12) "
                "or 'blutensor[cuda13]' (CUDA 13)")


def cupy_module():
    """CuPy, imported on first use; None when it is not installed."""
    global _cupy, _cupy_error
    if _cupy is None and _cupy_error is None:
        try:
            import cupy

            _cupy = cupy
        except Exception as e:  # ImportError, or a broken CUDA install
            _cupy_error = f"{type(e).__name__}: {e}"
    return _cupy


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one GPU."""
    cp = cupy_module()
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def require_cuda(dev: device | None = None):
    """CuPy, or a DeviceError that says how to install it."""
    cp = cupy_module()
    if cp is None:
        raise DeviceError(f"device {dev or 'cuda'} requested but CuPy is not available ({_cupy_error}); "
                          f"{INSTALL_HINT}")
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as e:
        raise DeviceError(f"device {dev or 'cuda'} requested but no CUDA driver/GPU is usable: {e}") from None
    if n == 0:
        raise DeviceError(f"device {dev or 'cuda'} requested but this machine has no CUDA GPU")
    if dev is not None and dev.index is not None and dev.index >= n:
        raise DeviceError(f"device {dev} requested but only {n} CUDA device(s) exist")
    return cp


def xp_of(dev: device):
    """The array module for a device."""
    if dev.type == "cpu":
        return np
    return require_cuda(dev)


#: providers of array types other than NumPy's and CuPy's (a tracer's traced arrays): ``(array_type, provider)``
#: pairs, newest last (:func:`blutensor.ext.register_array_provider`); empty: one truthiness test off NumPy's path
array_providers: list = []


def array_provider(*arrays):
    """The newest registered provider whose array type one of ``arrays`` is, else None."""
    for typ, prov in reversed(array_providers):
        for a in arrays:
            if isinstance(a, typ):
                return prov
    return None


def array_module(arr):
    """NumPy or CuPy, whichever owns ``arr`` (a registered provider's module for its array type)."""
    if isinstance(arr, np.ndarray | np.generic):
        return np
    cp = cupy_module()
    if cp is not None and isinstance(arr, cp.ndarray):
        return cp
    if array_providers:
        prov = array_provider(arr)
        if prov is not None:
            return prov.module(arr)
    return np


def is_cuda_array(arr) -> bool:
    return not isinstance(arr, np.ndarray | np.generic) and type(arr).__module__.startswith("cupy")


# ---- bfloat16 as raw 16-bit storage: exact widening and round-to-nearest-even narrowing ----

def bf16_bits_to_f32(bits, xp):
    """uint16 bfloat16 bits -> float32 values (exact)."""
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def f32_to_bf16_bits(x, xp):
    """float32 values -> uint16 bfloat16 bits, rounding to nearest even (NaN kept NaN)."""
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    rounded = (u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16
    nan = (u & xp.uint32(0x7FFFFFFF)) > xp.uint32(0x7F800000)
    out = xp.where(nan, (u >> 16) | xp.uint32(0x40), rounded)
    return out.astype(xp.uint16)
