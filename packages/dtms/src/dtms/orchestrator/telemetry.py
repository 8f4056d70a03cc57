"""GPU telemetry through NVML (pynvml / nvidia-ml-py when importable, else CuPy's runtime for what it
knows); an empty dict on machines without a GPU, never an error."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

_nvml: dict[str, Any] = {"mod": None, "tried": False}


def _has_driver() -> bool:
    if not sys.platform.startswith("linux"):
        return True
    return any(os.path.exists(d) for d in ("/dev/nvidiactl", "/dev/dxg"))


def _load_nvml() -> Any:
    if _nvml["tried"]:
        return _nvml["mod"]
    _nvml["tried"] = True
    if not _has_driver() or importlib.util.find_spec("pynvml") is None:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        _nvml["mod"] = pynvml
    except Exception:
        _nvml["mod"] = None
    return _nvml["mod"]


def _nvml_device(nv: Any, index: int) -> dict[str, Any]:
    h = nv.nvmlDeviceGetHandleByIndex(index)
    out: dict[str, Any] = {"index": index, "source": "nvml"}
    readers = {
        "temperature_c": lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
        "utilization": lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0,
        "memory_used_bytes": lambda: nv.nvmlDeviceGetMemoryInfo(h).used,
        "throttle_reasons": lambda: nv.nvmlDeviceGetCurrentClocksThrottleReasons(h),
        "ecc_corrected": lambda: nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                                                nv.NVML_VOLATILE_ECC),
        "ecc_uncorrected": lambda: nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                                  nv.NVML_VOLATILE_ECC),
    }
    for k, fn in readers.items():
        try:
            out[k] = fn()
        except Exception:  # a counter this GPU or driver does not support: absent, not an error
            pass
    return out


def _cupy_device(index: int) -> dict[str, Any]:
    import cupy

    with cupy.cuda.Device(index):
        free, total = cupy.cuda.runtime.memGetInfo()
    return {"index": index, "source": "cupy", "memory_used_bytes": total - free}


def _visible() -> list[str] | None:
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if cvd is None else [d.strip() for d in cvd.split(",") if d.strip()]


def rank_gpu() -> int:
    """NVML index of this rank's GPU: the first of $CUDA_VISIBLE_DEVICES (blurun pins one per rank),
    else $LOCAL_RANK."""
    pinned = os.environ.get("BLUTRAIN_GPU_NVML_INDEX", "")
    if pinned.isdigit():  # blurun's placement: CUDA_VISIBLE_DEVICES holds a UUID, this the NVML index
        return int(pinned)
    vis = _visible()
    if vis and vis[0].isdigit():
        return int(vis[0])
    return int(os.environ.get("LOCAL_RANK", "0"))


def gpu_telemetry(device: int | None = None) -> list[dict[str, Any]]:
    """Per-GPU readings (temperature, ECC counts, throttle reasons, utilisation, memory); [] without GPUs.

    ``device`` selects one GPU by NVML index (a rank's own: :func:`rank_gpu`); None reads every GPU."""
    if not _has_driver():
        return []
    nv = _load_nvml()
    try:
        if nv is not None:
            n = nv.nvmlDeviceGetCount()
            idx = [device] if device is not None and device < n else range(n)
            return [_nvml_device(nv, i) for i in idx]
        if importlib.util.find_spec("cupy") is not None:
            import cupy

            n = cupy.cuda.runtime.getDeviceCount()
            vis = _visible()
            if device is not None and vis is not None:  # CuPy numbers the visible GPUs from 0
                device = vis.index(str(device)) if str(device) in vis else None
            idx = [device] if device is not None and device < n else range(n)
            return [_cupy_device(i) for i in idx]
    except Exception:
        return []
    return []
