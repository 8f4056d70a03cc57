"""The real backend: cudaMalloc/cudaFree/cudaMemGetInfo and events through ``cupy.cuda.runtime``."""

from __future__ import annotations

import contextlib
from typing import Any

from .errors import BackendOutOfMemory

_CUDA_ERROR_MEMORY_ALLOCATION = 2
_NULL_CONTEXT = contextlib.nullcontext()


def cuda_available() -> bool:
    """True if CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - any failure (no CuPy, no driver) means "not available"
        return False


class CudaBackend:
    """Device memory and events of one CUDA device, driven through CuPy's runtime bindings."""

    def __init__(self, device_id: int | None = None) -> None:
        try:
            import cupy
            runtime = cupy.cuda.runtime
        except ImportError as exc:  # pragma: no cover - depends on the machine
            raise RuntimeError("bluallocator.CudaBackend needs CuPy: "
                               "pip install 'bluallocator[cuda13]'") from exc
        self._cupy: Any = cupy
        self._rt: Any = runtime
        self.device_id = runtime.getDevice() if device_id is None else int(device_id)
        self._error = runtime.CUDARuntimeError

    def _on_device(self) -> Any:
        """Context making this device current; a no-op when it already is (the usual case)."""
        if self._rt.getDevice() == self.device_id:
            return _NULL_CONTEXT
        return self._cupy.cuda.Device(self.device_id)

    def malloc(self, nbytes: int) -> int:
        """cudaMalloc on this device; an out-of-memory error becomes ``BackendOutOfMemory``."""
        try:
            with self._on_device():
                return int(self._rt.malloc(nbytes))
        except self._error as exc:
            if getattr(exc, "status", None) == _CUDA_ERROR_MEMORY_ALLOCATION:
                raise BackendOutOfMemory(f"cudaMalloc({nbytes}) on device {self.device_id}: {exc}") from exc
            raise

    def free(self, ptr: int) -> None:
        """cudaFree (synchronises the device, which is why the allocator caches)."""
        with self._on_device():
            self._rt.free(ptr)

    def mem_get_info(self) -> tuple[int, int]:
        """cudaMemGetInfo: (free, total)."""
        with self._on_device():
            free, total = self._rt.memGetInfo()
        return int(free), int(total)

    def current_stream(self) -> int:
        """Handle of CuPy's current stream (0 for the legacy default stream)."""
        return int(self._cupy.cuda.get_current_stream().ptr)

    def event_create(self) -> int:
        """cudaEventCreateWithFlags(cudaEventDisableTiming)."""
        with self._on_device():
            return int(self._rt.eventCreateWithFlags(self._rt.eventDisableTiming))

    def event_record(self, event: int, stream: int) -> None:
        """cudaEventRecord."""
        self._rt.eventRecord(event, stream)

    def event_query(self, event: int) -> bool:
        """cudaEventQuery == cudaSuccess."""
        return self._rt.eventQuery(event) == 0

    def event_synchronize(self, event: int) -> None:
        """cudaEventSynchronize."""
        self._rt.eventSynchronize(event)

    def event_destroy(self, event: int) -> None:
        """cudaEventDestroy."""
        self._rt.eventDestroy(event)

    def is_capturing(self, stream: int) -> bool:
        """cudaStreamIsCapturing (False for the legacy stream or when the query itself is refused)."""
        if stream in (0, 1):
            return False
        try:
            return bool(self._rt.streamIsCapturing(stream))
        except self._error:
            return False
