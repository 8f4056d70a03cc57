"""Timers: CUDA events around each op (recorded into a reused pool, resolved once, when the session
stops) and NVTX ranges.

On CPU an op's time is its host wall time (``perf_counter_ns``); on CUDA each span also records a
start and an end event of a preallocated pool on the current stream, so GPU time is attributed to
the op that launched the work, and the GPU lane of the trace shows when it actually ran. Nothing is
created or converted while the session runs: the span keeps the pool index, ``resolve`` turns
indices into milliseconds after one synchronisation.
"""

from __future__ import annotations

from typing import Any

#: event pools kept between sessions: (Event class, device) -> list of events (creating one costs ~us)
_POOLS: dict[tuple, list] = {}
POOL_START = 4096


def cupy_or_none() -> Any:
    """CuPy when it imports and sees a GPU, else None (never raises)."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:
        pass
    return None


def _device_id(cupy: Any) -> int:
    try:
        return int(cupy.cuda.runtime.getDevice())
    except Exception:
        return 0


class GpuTimer:
    """A pool of CUDA events; a span takes the next two (``take``), ``resolve`` converts them to
    (start_ms since the base event, duration_ms) at the end."""

    def __init__(self, cupy: Any):
        self.cp = cupy
        self.Event = cupy.cuda.Event
        self.stream = cupy.cuda.get_current_stream
        key = (self.Event, _device_id(cupy))
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = [self.Event() for _ in range(POOL_START)]
        self.events = pool
        self.n = 0  # next free index
        self.base = self.Event()
        self.base.record()

    def grow(self) -> None:
        """Double the pool (a long session); the new events stay in the pool for later sessions."""
        self.events.extend(self.Event() for _ in range(len(self.events)))

    def begin(self) -> int:
        """Record the start event of a span; returns its index (the end event is index + 1)."""
        i = self.n
        if i + 2 > len(self.events):
            self.grow()
        self.n = i + 2
        self.events[i].record()
        return i

    def end(self, i: int) -> None:
        self.events[i + 1].record()

    def resolve(self, events) -> None:
        """Fill ``gpu_start_ms``/``gpu_ms`` of every span that carries events (synchronises once)."""
        elapsed = self.cp.cuda.get_elapsed_time
        self.cp.cuda.Device().synchronize()
        pool, base = self.events, self.base
        for e in events:
            i = e._ev
            if i is None:
                continue
            a = pool[i]
            e.gpu_start_ms = elapsed(base, a)
            e.gpu_ms = elapsed(a, pool[i + 1])
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
