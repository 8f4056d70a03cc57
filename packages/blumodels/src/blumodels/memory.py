"""Device memory for the Trainer: which allocator CuPy uses (``train.allocator``), the flush after step 0,
and the peak allocated/reserved bytes that go into every log record.

``"blu"`` (default on CUDA) installs bluallocator's caching allocator before the model is built, profiles
step 0's request sizes and, after the first step of the process, applies the chosen rounding and returns
the start-up cache (init temporaries, step-0-only buffers) to the driver. ``"cupy"`` keeps CuPy's pool.
On the CPU nothing is installed and the peaks are None.
"""

from __future__ import annotations

from typing import Any

ALLOCATORS = ("blu", "cupy")


class DeviceMemory:
    """Installs the configured allocator on CUDA; ``after_step()`` flushes once and reports the peaks."""

    def __init__(self, device: str, allocator: str = "blu") -> None:
        if allocator not in ALLOCATORS:
            raise ValueError(f"train.allocator must be one of {ALLOCATORS}, got {allocator!r}")
        self.device = device
        self.allocator = allocator
        self.alloc = None
        self.flushed: dict[str, Any] | None = None
        self.note = ""
        if device.startswith("cuda") and allocator == "blu":
            try:
                import bluallocator
            except ImportError:  # an optional package: keep CuPy's pool and say so
                self.note = "train.allocator = 'blu' but bluallocator is not installed: using CuPy's pool"
                return
            self.alloc = bluallocator.install()
            if not self.alloc.profiling and not self.alloc.startup_flushed:
                self.alloc.begin_profile()  # step 0's sizes choose the rounding

    def after_step(self) -> dict[str, Any]:
        """Peak allocated/reserved bytes since the run started (flushing the start-up cache the first time)."""
        if self.alloc is not None:
            if self.flushed is None:
                self.flushed = self.alloc.flush_after_step0()
            st = self.alloc.memory_stats()
            return {"peak_allocated_bytes": st["peak_allocated_bytes"],
                    "peak_reserved_bytes": st["peak_reserved_bytes"], "reserved_bytes": st["reserved_bytes"]}
        if self.device.startswith("cuda"):
            try:
                import cupy

                pool = cupy.get_default_memory_pool()  # CuPy keeps no peaks: the current values
                return {"peak_allocated_bytes": int(pool.used_bytes()), "peak_reserved_bytes": int(pool.total_bytes()),
                        "reserved_bytes": int(pool.total_bytes())}
            except Exception:  # noqa: BLE001 - memory numbers are informative only
                pass
        return {"peak_allocated_bytes": None, "peak_reserved_bytes": None, "reserved_bytes": None}

    def stats(self) -> dict[str, Any] | None:
        """bluallocator's full statistics (None when it is not the allocator)."""
        return self.alloc.memory_stats() if self.alloc is not None else None
