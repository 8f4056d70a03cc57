"""Plugin registration: the ``caching`` (ours) and ``cupy-default`` (CuPy's pool) device allocators."""

from __future__ import annotations

from typing import Any

import pluggy

from .cuda_backend import cuda_available

hookimpl = pluggy.HookimplMarker("blutrain")


class CachingAllocatorPlugin:
    """bluallocator's caching allocator installed into CuPy."""

    PLUGIN_NAME = "caching"

    @classmethod
    def is_available(cls) -> bool:
        """Needs CuPy and a CUDA device."""
        return cuda_available()

    @classmethod
    def install(cls, **kwargs: Any) -> Any:
        """Route CuPy allocations through bluallocator; returns the current device's CachingAllocator."""
        from .cupy_glue import install
        return install(**kwargs)

    @classmethod
    def uninstall(cls) -> None:
        """Restore CuPy's previous allocator."""
        from .cupy_glue import uninstall
        uninstall()

    @classmethod
    def memory_stats(cls, device: int | None = None) -> dict[str, Any]:
        """Statistics of the caching allocator of ``device`` (the current device when None)."""
        from .cupy_glue import memory_stats
        return memory_stats(device)

    @classmethod
    def reset_peak_stats(cls, device: int | None = None) -> None:
        """Restart the peaks (allocated and reserved) of ``device``'s allocator from the current values."""
        from .cupy_glue import reset_peak_stats
        reset_peak_stats(device)

    @classmethod
    def is_installed(cls) -> bool:
        """True while CuPy allocates through bluallocator (``install()``, however it was called)."""
        from .cupy_glue import is_installed
        return is_installed()

    @classmethod
    def empty_cache(cls) -> int:
        """Return cached free segments to the driver."""
        from .cupy_glue import empty_cache
        return empty_cache()

    @classmethod
    def graph_allocator(cls) -> Any:
        """The installed caching allocator (it has ``graph_pool()``: private pools for CUDA-graph capture), else
        None. blutensor's CUDA graphs find it here, through the plugin host, without importing bluallocator."""
        from .cupy_glue import get_allocator, is_installed
        return get_allocator() if is_installed() else None


class CupyDefaultAllocatorPlugin:
    """CuPy's own memory pool (not graph-safe), for comparison and as a fallback."""

    PLUGIN_NAME = "cupy-default"

    @classmethod
    def is_available(cls) -> bool:
        """Needs CuPy and a CUDA device."""
        return cuda_available()

    @classmethod
    def install(cls, **kwargs: Any) -> Any:
        """``cupy.cuda.set_allocator(default_pool.malloc)``; returns the pool."""
        import cupy
        pool = cupy.get_default_memory_pool()
        cupy.cuda.set_allocator(pool.malloc)
        return pool

    @classmethod
    def uninstall(cls) -> None:
        """Leaves CuPy on its default pool (which is what it starts with)."""
        import cupy
        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)

    @classmethod
    def memory_stats(cls) -> dict[str, Any]:
        """allocated (used) and reserved (total) bytes of CuPy's default pool, same keys as ours."""
        import cupy
        pool = cupy.get_default_memory_pool()
        used, total = int(pool.used_bytes()), int(pool.total_bytes())
        return {"allocated_bytes": used, "reserved_bytes": total, "cached_free_bytes": total - used,
                "free_blocks": int(pool.n_free_blocks())}

    @classmethod
    def empty_cache(cls) -> int:
        """``free_all_blocks`` on the default pool; bytes released."""
        import cupy
        pool = cupy.get_default_memory_pool()
        before = int(pool.total_bytes())
        pool.free_all_blocks()
        return before - int(pool.total_bytes())


@hookimpl
def blutrain_register_allocators() -> list[type]:
    """bluallocator's device allocators."""
    return [CachingAllocatorPlugin, CupyDefaultAllocatorPlugin]


@hookimpl
def blutrain_on_step_begin(step: int, state: dict[str, Any]) -> None:
    """Step 0 with our allocator installed: start the alignment profile (unless the trainer already did)."""
    from . import cupy_glue
    if step != 0 or not cupy_glue.is_installed():
        return
    for a in list(cupy_glue._allocators.values()):
        if not a.profiling and not a.startup_flushed:
            a.begin_profile()


@hookimpl
def blutrain_on_step_end(step: int, metrics: dict[str, Any]) -> None:
    """After step 0 with our allocator installed: apply the profile and return start-up memory."""
    from . import cupy_glue
    if step != 0 or not cupy_glue.is_installed():
        return
    for a in list(cupy_glue._allocators.values()):
        if not a.startup_flushed:
            a.flush_after_step0()
