"""bluallocator: caching device allocator with graph-safe private pools, pinned host buffers and stats.

Core logic (``CachingAllocator``) runs on any :class:`DeviceBackend`: ``FakeDeviceBackend`` on CPU,
``CudaBackend`` on a GPU. ``install()`` plugs it into CuPy. Does not import blutensor.
"""

from .__about__ import __version__
from .alignment import AlignmentChoice, AlignmentProfiler, choose_granularity, rounding_cost
from .backend import DeviceBackend, FakeDeviceBackend
from .caching import CachingAllocator, add_listener, remove_listener
from .cuda_backend import CudaBackend, cuda_available
from .cupy_glue import (
    empty_cache,
    get_allocator,
    install,
    is_installed,
    memory_stats,
    record_stream,
    reset_peak_stats,
    uninstall,
)
from .errors import BackendOutOfMemory, OutOfMemoryError
from .pinned import PinnedHostAllocator

__all__ = [
    "__version__", "AlignmentChoice", "AlignmentProfiler", "BackendOutOfMemory", "CachingAllocator",
    "CudaBackend", "DeviceBackend", "FakeDeviceBackend", "OutOfMemoryError", "PinnedHostAllocator",
    "add_listener", "remove_listener",
    "choose_granularity", "cuda_available", "empty_cache", "get_allocator", "install", "is_installed",
    "memory_stats", "record_stream", "rounding_cost", "uninstall",
    "reset_peak_stats",
]
