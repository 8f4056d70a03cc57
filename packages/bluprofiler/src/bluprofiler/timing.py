"""Timers: CUDA events around each op (resolved once, when the session stops) and NVTX ranges.

On CPU an op's time is its host wall time (``perf_counter_ns``); on CUDA each span also gets a
start/end ``cupy.cuda.Event`` on the current stream, so GPU time is attributed to the op that
launched the work, and the GPU lane of the trace shows when it actually ran.
"""

from __future__ import annotations

from typing import Any


def cupy_or_none() -> Any:
    """CuPy when it imports and sees a GPU, else None (never raises)."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:
        pass
    return None


class GpuTimer:
    """Brackets spans with CUDA events and converts them to (start_ms, duration_ms) at the end."""

    def __init__(self, cupy: Any):
        self.cp = cupy
        self.Event = cupy.cuda.Event
        self.stream = cupy.cuda.get_current_stream
        self.base = self.Event()
        self.base.record()

    def begin(self) -> tuple:
        ev = self.Event()
        ev.record()
        return ev, self.stream().ptr

    def end(self) -> Any:
        ev = self.Event()
        ev.record()
        return ev

    def resolve(self, events) -> None:
        """Fill ``gpu_start_ms``/``gpu_ms`` of every span that carries events (synchronises once)."""
        elapsed = self.cp.cuda.get_elapsed_time
        self.cp.cuda.Device().synchronize()
        for e in events:
            if e._ev is None:
                continue
            a, b = e._ev
            e.gpu_start_ms = elapsed(self.base, a)
            e.gpu_ms = elapsed(a, b)
            e._ev = None


class Nvtx:
    """NVTX push/pop through ``cupy.cuda.nvtx`` so Nsight Systems/Compute show our op names."""

    def __init__(self, cupy: Any):
        nv = getattr(getattr(cupy, "cuda", None), "nvtx", None) if cupy is not None else None
        ok = nv is not None and getattr(nv, "available", True)
        self.push = nv.RangePush if ok else None
        self.pop = nv.RangePop if ok else None

    @property
    def available(self) -> bool:
        return self.push is not None
