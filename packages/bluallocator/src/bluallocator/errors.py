"""Errors raised by the allocators."""

from __future__ import annotations


def format_bytes(n: int) -> str:
    """Human-readable byte count with the exact number, e.g. ``'2.00 MiB (2097152 bytes)'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024.0 or unit == "TiB":
            text = f"{int(value)} {unit}" if unit == "B" else f"{value:.2f} {unit}"
            return f"{text} ({n} bytes)" if unit != "B" else text
        value /= 1024.0
    raise AssertionError("unreachable")


class BackendOutOfMemory(MemoryError):
    """Raised by a backend's ``malloc`` when the driver has no memory left for the request."""


class OutOfMemoryError(MemoryError):
    """The allocator could not serve a request even after returning its cached blocks to the driver.

    Carries the numbers in attributes as well as in the message, so callers can log or react.
    """

    def __init__(
        self,
        requested: int,
        device_free: int,
        device_total: int,
        reserved: int,
        cached_free: int,
        largest_free_block: int,
        *,
        allocated: int = 0,
        stream: int = 0,
        pool: str = "default",
        note: str = "",
    ) -> None:
        self.requested = requested
        self.device_free = device_free
        self.device_total = device_total
        self.reserved = reserved
        self.cached_free = cached_free
        self.largest_free_block = largest_free_block
        self.allocated = allocated
        self.stream = stream
        self.pool = pool
        super().__init__(
            f"bluallocator: out of device memory: tried to allocate {format_bytes(requested)}; "
            f"free on device {format_bytes(device_free)} of total {format_bytes(device_total)}; "
            f"reserved by allocator {format_bytes(reserved)} (allocated {format_bytes(allocated)}, "
            f"cached free {format_bytes(cached_free)}, largest cached free block "
            f"{format_bytes(largest_free_block)}); stream {stream:#x}, pool {pool}"
            + (f"; {note}" if note else "")
        )
