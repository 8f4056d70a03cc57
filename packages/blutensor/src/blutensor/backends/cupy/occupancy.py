"""Resident blocks per SM of a kernel (driver occupancy query, cached): grid sizes for grid-stride kernels.

A grid-stride kernel launched with more blocks than the SMs hold at once runs a second, partial wave at low
occupancy; sizing the grid to ``num_sms() * resident_blocks(...)`` keeps every block resident for the whole pass.
"""

from __future__ import annotations

from blutensor.backends.cupy._loader import _raise_smem_limit, cupy, function, num_sms

_cache: dict[tuple, int] = {}
#: why a query fell back to its guess, per kernel name (what a diagnosis of a slow launch reads)
errors: dict[str, str] = {}


def resident_blocks(file: str, name: str, block: int, smem: int = 0, default: int = 2) -> int:
    """Blocks of ``kernels/<file>:name`` (``block`` threads, ``smem`` dynamic bytes) one SM holds at once."""
    cp = cupy()
    key = (cp.cuda.runtime.getDevice(), file, name, block, smem)
    n = _cache.get(key)
    if n is None:
        try:
            fn = function(file, name)
            if smem > 48 * 1024:  # the query counts only what the kernel is allowed: opt in first
                _raise_smem_limit(fn, file, name, smem)
            ptr = fn.kernel.ptr if hasattr(fn, "kernel") else fn.ptr  # RawModule.get_function gives a RawKernel
            n = int(cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(ptr, block, smem))
        except Exception as e:  # the query is missing (old CuPy, stand-ins): a safe guess
            errors[name] = f"{type(e).__name__}: {e}"
            n = default
        n = _cache[key] = max(1, n)
    return n


def full_grid(file: str, name: str, block: int, work_blocks: int, smem: int = 0, default: int = 2) -> int:
    """min(work_blocks, one full wave of resident blocks): the grid of a grid-stride launch (``default``: blocks
    per SM assumed when the occupancy query is unavailable)."""
    return max(1, min(work_blocks, num_sms() * resident_blocks(file, name, block, smem, default)))
