"""A stand-in for the slice of CuPy that bluallocator's glue touches, backed by FakeDeviceBackend.

Used by the CPU twins of test_cupy.py: the glue code (install, GC-driven frees, record_stream, the
OOM retry) runs for real; only the device is simulated.
"""

from __future__ import annotations

import types

from bluallocator import FakeDeviceBackend
from bluallocator.errors import BackendOutOfMemory


class CUDARuntimeError(RuntimeError):
    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"cudaError {status}")


class UnownedMemory:
    def __init__(self, ptr: int, size: int, owner: object, device_id: int = -1) -> None:
        self.ptr, self.size, self._owner, self.device_id = ptr, size, owner, device_id


class MemoryPointer:
    def __init__(self, mem: UnownedMemory, offset: int) -> None:
        self.mem, self.ptr = mem, mem.ptr + offset


class Stream:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class FakeArray:
    """Holds a MemoryPointer like a cupy.ndarray; views share it."""

    def __init__(self, data: MemoryPointer, nbytes: int) -> None:
        self.data, self.nbytes = data, nbytes
        self.device = types.SimpleNamespace(id=0)

    def view(self) -> FakeArray:
        return FakeArray(self.data, self.nbytes)


def make_fake_cupy(capacity: int = 1 << 30) -> types.ModuleType:
    """A fresh fake ``cupy`` module with its own simulated device."""
    be = FakeDeviceBackend(capacity)
    state = {"allocator": "cupy-pool", "stream": Stream(0)}

    def malloc(n: int) -> int:
        try:
            return be.malloc(n)
        except BackendOutOfMemory:
            raise CUDARuntimeError(2) from None

    runtime = types.SimpleNamespace(
        CUDARuntimeError=CUDARuntimeError, eventDisableTiming=2,
        getDeviceCount=lambda: 1, getDevice=lambda: 0, malloc=malloc, free=be.free,
        memGetInfo=be.mem_get_info, eventCreateWithFlags=lambda flags: be.event_create(),
        eventRecord=be.event_record, eventQuery=lambda e: 0 if be.event_query(e) else 600,
        eventSynchronize=be.event_synchronize, eventDestroy=be.event_destroy,
        streamIsCapturing=be.is_capturing)

    def set_allocator(fn: object) -> None:
        state["allocator"] = fn

    cuda = types.SimpleNamespace(
        runtime=runtime, UnownedMemory=UnownedMemory, MemoryPointer=MemoryPointer,
        get_allocator=lambda: state["allocator"], set_allocator=set_allocator,
        get_current_stream=lambda: state["stream"], Device=lambda i=None: _NullDevice(),
        MemoryPool=lambda: FakePool(be))
    runtime.getDeviceProperties = lambda i: {"name": b"fake device"}
    default_pool = FakePool(be)

    mod = types.ModuleType("cupy")
    mod.cuda = cuda
    mod.backend = be
    mod.state = state

    def empty(nbytes: int, dtype: object = None) -> FakeArray:
        return FakeArray(state["allocator"](nbytes), nbytes)

    def use_stream(ptr: int) -> None:
        state["stream"] = Stream(ptr)

    mod.empty = empty
    mod.use_stream = use_stream
    mod.uint8 = "uint8"
    mod.__version__ = "fake"
    mod.get_default_memory_pool = lambda: default_pool
    return mod


class FakePool:
    """CuPy MemoryPool look-alike without caching (for dry runs of dev scripts)."""

    def __init__(self, be: FakeDeviceBackend) -> None:
        self.be, self.used = be, 0

    def malloc(self, n: int) -> MemoryPointer:
        n = max(512, -(-n // 512) * 512)
        ptr = self.be.malloc(n)
        self.used += n
        pool = self

        class Owner:
            def __del__(self) -> None:
                pool.be.free(ptr)
                pool.used -= n

        return MemoryPointer(UnownedMemory(ptr, n, Owner()), 0)

    def used_bytes(self) -> int:
        return self.used

    total_bytes = used_bytes

    def n_free_blocks(self) -> int:
        return 0

    def free_all_blocks(self) -> None:
        return None


class _NullDevice:
    def synchronize(self) -> None:
        return None

    def __enter__(self) -> _NullDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        return None
