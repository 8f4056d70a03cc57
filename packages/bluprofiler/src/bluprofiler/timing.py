"""Timers: CUDA events around each op (raw events of a reused pool, recorded with one runtime call,
resolved once, when the session stops) and NVTX ranges.

On CPU an op's time is its host wall time (``perf_counter_ns``); on CUDA each span that launches
GPU work also records a start and an end event of a preallocated pool on the session's stream, so
CUDA-event time is attributed to the op that launched the work, and the GPU lane of the trace shows when
it actually ran. The pool holds raw ``cudaEvent_t`` handles (``eventCreateWithFlags(0)``: timing on,
no blocking sync, not interprocess) and a span records them with ``runtime.eventRecord(event,
stream)`` on a stream pointer cached at session start: no Event objects, no current-stream lookup
per span. Nothing is created or converted while the session runs: the span keeps the pool index,
``resolve`` turns indices into milliseconds after one synchronisation.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

#: raw event pools kept between sessions: (runtime module, device id) -> list of cudaEvent_t handles
#: (ints); each creation costs ~us, so the pool lives as long as the process (a few KiB of driver state)
_POOLS: dict[tuple, list[int]] = {}
#: one base event per device (the zero of the GPU lane's clock), re-recorded at each session start
_BASES: dict[tuple, int] = {}
POOL_START = 4096
#: cudaEventDefault: timing enabled, spin (not blocking) sync, not interprocess
EVENT_FLAGS = 0


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
    """A pool of raw CUDA events; the profiler takes the next two per span (``events[i]`` and
    ``events[i + 1]``, recorded with ``record(event, stream)``), ``resolve`` converts them to
    (start_ms since the base event, duration_ms) at the end."""

    def __init__(self, cupy: Any):
        self.cp = cupy
        rt = cupy.cuda.runtime
        self.record = rt.eventRecord
        self._create = rt.eventCreateWithFlags
        self.elapsed = rt.eventElapsedTime
        dev = (rt, _device_id(cupy))
        pool = _POOLS.get(dev)
        if pool is None:
            pool = _POOLS[dev] = [self._create(EVENT_FLAGS) for _ in range(POOL_START)]
        self.events = pool
        self.n = 0  # next free index (the profiler keeps its own copy on the hot path)
        #: raw pointer of the stream current at session start: every span records on it
        self.stream = int(cupy.cuda.get_current_stream().ptr)
        base = _BASES.get(dev)
        if base is None:
            base = _BASES[dev] = self._create(EVENT_FLAGS)
        self.base = base
        self.record(base, self.stream)

    def grow(self) -> None:
        """Double the pool (a long session); the new events stay in the pool for later sessions."""
        create = self._create
        self.events.extend([create(EVENT_FLAGS) for _ in range(len(self.events))])

    def begin(self) -> int:
        """Record the start event of a span; returns its index (the end event is index + 1)."""
        i = self.n
        if i + 2 > len(self.events):
            self.grow()
        self.n = i + 2
        self.record(self.events[i], self.stream)
        return i

    def end(self, i: int) -> None:
        self.record(self.events[i + 1], self.stream)

    def resolve(self, events, host_only_gpu_ms: float = 0.0) -> None:
        """Fill ``gpu_start_ms``/``gpu_ms`` of every span that carries events (synchronises once);
        spans without events on a timed session (``host_only``: view ops) get ``gpu_ms = 0``."""
        elapsed = self.elapsed
        self.cp.cuda.Device().synchronize()
        pool, base = self.events, self.base
        for e in events:
            ev = e._ev
            if ev is None:
                if e.host_only:
                    e.gpu_ms = host_only_gpu_ms
                continue
            i, j = ev  # start (-1: the base event; "end" mode chains spans) and end pool indices
            a = base if i < 0 else pool[i]
            e.gpu_start_ms = elapsed(base, a) if i >= 0 else 0.0
            e.gpu_ms = elapsed(a, pool[j])
            e._ev = None


def nvtx_tool_attached() -> bool:
    """True when an NVTX tool (Nsight Systems/Compute) is injected: NVTX_INJECTION64_PATH is set.

    Without a tool NVTX calls are no-ops, so ranges are only worth their Python call cost when
    one is attached; ``Profiler(nvtx=None)`` (the default) pushes ranges exactly then.
    """
    return bool(os.environ.get("NVTX_INJECTION64_PATH") or os.environ.get("NVTX_INJECTION32_PATH"))


class Nvtx:
    """NVTX push/pop through ``cupy.cuda.nvtx`` so Nsight Systems/Compute show our op names."""

    def __init__(self, cupy: Any):
        nv = getattr(getattr(cupy, "cuda", None), "nvtx", None) if cupy is not None else None
        if nv is None and cupy is not None:
            try:  # a submodule that ``import cupy`` may not have loaded yet
                nv = importlib.import_module(cupy.__name__ + ".cuda.nvtx")
            except Exception:
                nv = None
        ok = nv is not None and getattr(nv, "available", True)
        self.push = nv.RangePush if ok else None
        self.pop = nv.RangePop if ok else None

    @property
    def available(self) -> bool:
        return self.push is not None
