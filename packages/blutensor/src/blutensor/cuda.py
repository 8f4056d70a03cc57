"""``blutensor.cuda``: whether CUDA is usable, device count, synchronisation."""

from __future__ import annotations

from blutensor.backends.cupy import INSTALL_HINT, cuda_available, cupy_module, require_cuda


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


def max_memory_allocated() -> int:
    """Peak bytes held by CuPy's pool (or the installed allocator's stats when it reports them)."""
    cp = require_cuda()
    return cp.get_default_memory_pool().total_bytes()


__all__ = ["INSTALL_HINT", "current_device", "device_count", "get_device_capability", "get_device_name",
           "is_available", "max_memory_allocated", "synchronize"]

from blutensor.cuda_graph import CUDAGraph, graph, make_graphed_step  # noqa: E402  (no CuPy import here)

__all__ += ["CUDAGraph", "graph", "make_graphed_step"]


from blutensor import amp  # noqa: E402,F401  (torch.cuda.amp: autocast and GradScaler live in blutensor.amp)
