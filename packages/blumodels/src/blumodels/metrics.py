"""Throughput, model FLOPs utilisation (MFU) and memory figures for the step log."""

from __future__ import annotations

import os
import resource
import sys

#: peak dense FLOP/s per device by (name fragment, precision); used when train.peak_flops is 0
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"fp32": 67e12, "tf32": 495e12, "bf16": 989e12},
    "H100": {"fp32": 67e12, "tf32": 495e12, "bf16": 989e12},
    "A100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12},
    "RTX 6000 Ada": {"fp32": 91.1e12, "tf32": 182e12, "bf16": 364e12},
}


def peak_flops(device_type: str, precision: str, configured: float = 0.0) -> float | None:
    """Peak FLOP/s of one device: ``configured`` if > 0, else the table for CUDA, else None (CPU)."""
    if configured > 0:
        return configured
    if device_type != "cuda":
        return None
    try:
        import blutensor as bt

        name = bt.cuda.get_device_name()
    except Exception:
        return None
    for frag, table in PEAK_FLOPS.items():
        if frag in name:
            return table.get(precision)
    return None


def mfu(flops_per_token: float, tokens_per_s: float, peak: float | None) -> float | None:
    """Achieved model FLOP/s over peak (None when the peak is unknown)."""
    if not peak:
        return None
    return flops_per_token * tokens_per_s / peak


def memory_bytes(device_type: str) -> int | None:
    """Bytes in use: on CUDA the live tensors' bytes as the active allocator counts them
    (``bt.cuda.memory_allocated``: bluallocator's when it is installed, else CuPy's pool), the process' peak RSS on
    CPU."""
    if device_type == "cuda":
        try:
            import blutensor as bt

            return int(bt.cuda.memory_allocated())
        except Exception:
            return None
    try:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)
    except Exception:  # pragma: no cover - platforms without getrusage
        return None


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
