"""``blutensor.cuda``: whether CUDA is usable, device count, synchronisation, device memory statistics."""

from __future__ import annotations

import numbers

from blutensor.backends.cupy import (
    INSTALL_HINT,
    PEAKS_HINT,
    CupyBackend,
    allocator_name,
    cuda_available,
    cupy_module,
    require_cuda,
)
from blutensor.device import as_device
from blutensor.device import device as _device
from blutensor.errors import ArgumentError, DeviceError, DTypeError

#: what the memory functions' ``device=`` accepts (PyTorch's: an index, "cuda", "cuda:N", a device)
_DeviceArg = int | str | _device


def is_available() -> bool:
    """True only when CuPy imports and a CUDA GPU is present (never raises)."""
    return cuda_available()


def device_count() -> int:
    cp = cupy_module()
    if cp is None:
        return 0
    try:
        return cp.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def is_bf16_supported() -> bool:
    """True when a CUDA GPU of compute capability 8.0 or newer is usable (blutensor's bf16 kernels use the
    sm_80 bfloat16 instructions); False without one (never raises)."""
    if not cuda_available():
        return False
    try:
        return int(cupy_module().cuda.Device().compute_capability) >= 80
    except Exception:
        return False


def synchronize(device: int | None = None) -> None:
    """Wait for all work on the current (or given) GPU to finish."""
    cp = require_cuda()
    if device is None:
        cp.cuda.Device().synchronize()
    else:
        cp.cuda.Device(device).synchronize()


def current_device() -> int:
    return require_cuda().cuda.Device().id


def get_device_name(device: int = 0) -> str:
    cp = require_cuda()
    return cp.cuda.runtime.getDeviceProperties(device)["name"].decode()


def get_device_capability(device: int = 0) -> tuple[int, int]:
    cp = require_cuda()
    cc = cp.cuda.Device(device).compute_capability
    return int(cc[:-1]), int(cc[-1])


# ---- device memory, as torch.cuda reports it: allocated = live tensors' blocks, reserved = held from the driver ----


def _device_index(device: _DeviceArg | None, fn: str) -> int:
    """The CUDA device index PyTorch's ``device=`` argument names: None or ``"cuda"`` (the current device), an
    int, ``"cuda:N"`` or a ``bt.device``; anything else, or an index past the last GPU, is an error naming ``fn``."""
    cp = require_cuda()
    if device is None or (isinstance(device, str) and device.strip() == "cuda"):
        return int(cp.cuda.runtime.getDevice())
    if isinstance(device, bool) or not isinstance(device, numbers.Integral | str | _device):
        raise DTypeError(f"bt.cuda.{fn}: device must be None, an int, 'cuda', 'cuda:N' or a bt.device, got "
                         f"{type(device).__name__} {device!r}")
    if isinstance(device, numbers.Integral):
        index = int(device)
    else:
        try:
            d = as_device(device)
        except ValueError as e:
            raise ArgumentError(f"bt.cuda.{fn}: {e}") from None
        if d.type != "cuda":
            raise ArgumentError(f"bt.cuda.{fn}: expected a CUDA device, got {d}")
        index = d.index
    n = int(cp.cuda.runtime.getDeviceCount())
    if not 0 <= index < n:
        raise DeviceError(f"bt.cuda.{fn}: device {index} does not exist (this machine has {n} CUDA device(s))")
    return index


def _stat(device: _DeviceArg | None, fn: str, key: str) -> int:
    index = _device_index(device, fn)
    st = CupyBackend.memory_stats(index) or {}
    if key not in st:
        what = "keeps no peaks" if key.startswith("peak_") else "reports no allocated/reserved bytes"
        raise DeviceError(f"bt.cuda.{fn}: {allocator_name(CupyBackend.stats_plugin())} {what} (no {key} in its "
                          f"statistics of device {index}); {PEAKS_HINT}")
    return int(st[key])


def memory_allocated(device: _DeviceArg | None = None) -> int:
    """Bytes of device memory in live tensors' blocks on ``device`` (current GPU when None), as
    ``torch.cuda.memory_allocated``: the allocator's block sizes, not what the driver holds."""
    return _stat(device, "memory_allocated", "allocated_bytes")


def max_memory_allocated(device: _DeviceArg | None = None) -> int:
    """Peak of :func:`memory_allocated` on ``device`` since the program started or the last
    :func:`reset_peak_memory_stats`, as ``torch.cuda.max_memory_allocated``. Needs an allocator that keeps peaks
    (bluallocator's ``caching``); with CuPy's own pool, which keeps none, a DeviceError says so."""
    return _stat(device, "max_memory_allocated", "peak_allocated_bytes")


def memory_reserved(device: _DeviceArg | None = None) -> int:
    """Bytes the allocator holds from the driver on ``device`` (live blocks and its cache), as
    ``torch.cuda.memory_reserved``."""
    return _stat(device, "memory_reserved", "reserved_bytes")


def max_memory_reserved(device: _DeviceArg | None = None) -> int:
    """Peak of :func:`memory_reserved` on ``device`` since the start or :func:`reset_peak_memory_stats`, as
    ``torch.cuda.max_memory_reserved`` (an allocator that keeps peaks, as for :func:`max_memory_allocated`)."""
    return _stat(device, "max_memory_reserved", "peak_reserved_bytes")


def reset_peak_memory_stats(device: _DeviceArg | None = None) -> None:
    """Restart the peaks of ``device`` (:func:`max_memory_allocated`, :func:`max_memory_reserved`) from the
    current values, as ``torch.cuda.reset_peak_memory_stats``."""
    index = _device_index(device, "reset_peak_memory_stats")
    CupyBackend.reset_peak_memory_stats(index)


__all__ = ["INSTALL_HINT", "current_device", "device_count", "get_device_capability", "get_device_name",
           "is_available", "max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved",
           "reset_peak_memory_stats", "synchronize"]

from blutensor.cuda_graph import CUDAGraph, graph, make_graphed_step  # noqa: E402  (no CuPy import here)

__all__ += ["CUDAGraph", "graph", "make_graphed_step"]


from blutensor import amp  # noqa: E402,F401  (torch.cuda.amp: autocast and GradScaler live in blutensor.amp)
