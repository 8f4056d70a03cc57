"""Device memory for the Trainer: which allocator CuPy uses (``train.allocator``), the flush after step 0,
and the peak allocated/reserved bytes that go into every log record.

``"blu"`` (default on CUDA) installs bluallocator's caching allocator before the model is built, profiles
step 0's request sizes and, after the first step of the process, applies the chosen rounding and returns
the start-up cache (init temporaries, step-0-only buffers) to the driver. ``"cupy"`` keeps CuPy's pool.
Any other name is an allocator plugin (``blutrain_register_allocators``; "caching" and "cupy-default" are
bluallocator's two, the same as "blu" and "cupy"): the cuda backend installs it
(``bt.backends.get("cuda").install_allocator(name)``) and its ``memory_stats()`` gives the
numbers. On the CPU nothing is installed and the peaks are None.
"""

from __future__ import annotations

from typing import Any

ALLOCATORS = ("blu", "cupy")
ALIASES = {"caching": "blu", "cupy-default": "cupy"}  # bluallocator's plugin names for the two built-in choices


def allocator_names() -> tuple[str, ...]:
    """Values ``train.allocator`` accepts: "blu", "cupy" and every installed allocator plugin."""
    from blutensor.ext import get_host

    return tuple(dict.fromkeys((*ALLOCATORS, *get_host().registry("allocator").names())))


class DeviceMemory:
    """Installs the configured allocator on CUDA; ``after_step()`` flushes once and reports the peaks."""

    def __init__(self, device: str, allocator: str = "blu") -> None:
        allocator = ALIASES.get(allocator, allocator)
        if allocator not in ALLOCATORS and allocator not in allocator_names():
            raise ValueError(f"train.allocator must be one of {allocator_names()}, got {allocator!r}")
        self.device = device
        self.allocator = allocator
        self.alloc = None
        self.plugin: Any = None  # an allocator plugin class (a name other than "blu" / "cupy")
        self.flushed: dict[str, Any] | None = None
        self.note = ""
        if device.startswith("cuda") and allocator not in ALLOCATORS:
            import blutensor as bt

            cuda = bt.backends.get("cuda")  # the cuda backend's allocator hook installs it
            cuda.install_allocator(allocator)  # PluginError naming it when missing or unavailable
            self.plugin = cuda.allocator_plugin()
            return
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
        """Peak allocated/reserved bytes since the run started (flushing the start-up cache the first time) and the
        bytes reserved now; a peak the allocator does not keep (CuPy's own pool, a plugin without it) is None."""
        if self.alloc is not None:
            if self.flushed is None:
                self.flushed = self.alloc.flush_after_step0()
            st = self.alloc.memory_stats()
            return {"peak_allocated_bytes": st["peak_allocated_bytes"],
                    "peak_reserved_bytes": st["peak_reserved_bytes"], "reserved_bytes": st["reserved_bytes"]}
        if self.plugin is not None:  # a peak the plugin does not keep is unknown (None), not its current value
            st = self.plugin.memory_stats()
            return {"peak_allocated_bytes": st.get("peak_allocated_bytes"),
                    "peak_reserved_bytes": st.get("peak_reserved_bytes"), "reserved_bytes": st.get("reserved_bytes")}
        if self.device.startswith("cuda"):
            try:
                import cupy

                pool = cupy.get_default_memory_pool()  # CuPy keeps no peaks: only the current reservation is known
                return {"peak_allocated_bytes": None, "peak_reserved_bytes": None,
                        "reserved_bytes": int(pool.total_bytes())}
            except Exception:  # noqa: BLE001 - memory numbers are informative only
                pass
        return {"peak_allocated_bytes": None, "peak_reserved_bytes": None, "reserved_bytes": None}

    def empty_cache(self) -> int:
        """Return the allocator's free cached memory to the driver (bytes released; 0 where there is none): before a
        CUDA-graph capture, so the graph's private pool reuses the eager warm-up steps' activation memory instead
        of reserving a second copy beside it."""
        if self.alloc is not None:
            return int(self.alloc.empty_cache())
        if self.plugin is not None and hasattr(self.plugin, "empty_cache"):
            return int(self.plugin.empty_cache() or 0)
        if self.device.startswith("cuda"):
            import cupy

            pool = cupy.get_default_memory_pool()
            before = int(pool.total_bytes())
            pool.free_all_blocks()
            return before - int(pool.total_bytes())
        return 0

    def stats(self) -> dict[str, Any] | None:
        """The allocator's full statistics (None with CuPy's pool or on the CPU)."""
        if self.plugin is not None:
            return self.plugin.memory_stats()
        return self.alloc.memory_stats() if self.alloc is not None else None
