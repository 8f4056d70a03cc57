"""Communication profiling: collective spans, NCCL's bus-bandwidth formulas and compute overlap.

A running :class:`~bluprofiler.Profiler` listens to dtms through its public observer API
(``dtms.add_collective_observer``); every collective and point-to-point op of every process group
becomes a :class:`CommEvent`: op, group, bytes, stream, host start/end (around the call and its
wait) and, on NCCL, the GPU start/end from CUDA events on the communication stream.

Bandwidths follow NCCL's tests (``doc/PERFORMANCE.md``): algorithm bandwidth ``algbw = S / t`` with
S the bytes of the op as dtms counts them (the buffer of all_reduce/broadcast/send/recv, the whole
input of reduce_scatter/all_to_all, the whole output of all_gather), and bus bandwidth
``busbw = algbw * factor(n)``, the factor that makes the number comparable with the link's peak:
all_reduce ``2(n-1)/n``; reduce_scatter, all_gather and all_to_all ``(n-1)/n``; broadcast, reduce,
send and recv 1. On CPU ranks the time is host wall-clock from the call to the completed wait, so
for an async op that was waited on late it includes time the op was already done: its bandwidth is
a lower bound.

Overlap: the fraction of a collective's interval covered by compute, i.e. the union of the op spans
(forward and backward) of the same session on the same clock (GPU lane when both are GPU-timed,
host otherwise); the op names it overlapped are kept per collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: NCCL-tests bus-bandwidth factor per op as a function of the group size n
_BUS_FACTORS = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
    "barrier": lambda n: 0.0,
}


def bus_factor(op: str, world: int) -> float:
    """NCCL's bus-bandwidth factor of ``op`` on a group of ``world`` ranks (all_reduce: 2(n-1)/n)."""
    if op not in _BUS_FACTORS:
        raise ValueError(f"bus_factor: unknown collective {op!r}; known: {sorted(_BUS_FACTORS)}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"bus_factor: world must be an int >= 1, got {world!r}")
    return float(_BUS_FACTORS[op](world))


def bandwidth(op: str, nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algorithm bandwidth, bus bandwidth) in bytes per second of one ``op`` of ``nbytes`` that took
    ``seconds`` on ``world`` ranks, by NCCL's formulas; (0, 0) for a zero-length op or time."""
    f = bus_factor(op, world)
    if nbytes < 0:
        raise ValueError(f"bandwidth: nbytes must be >= 0, got {nbytes}")
    if not seconds >= 0:
        raise ValueError(f"bandwidth: seconds must be >= 0, got {seconds}")
    if nbytes == 0 or seconds == 0:
        return 0.0, 0.0
    alg = nbytes / seconds
    return alg, alg * f


@dataclass(slots=True)
class CommEvent:
    """One collective seen by the profiler; host times are ``perf_counter_ns`` values."""

    op: str
    backend: str
    group: tuple
    rank: int
    nbytes: int
    dtype: str
    reduce_op: str | None
    async_op: bool
    start_ns: int
    issued_ns: int
    end_ns: int
    stream: int = 0
    tid: int = 0
    gpu_start_ms: float | None = None
    gpu_ms: float | None = None
    #: fraction of the interval covered by compute spans, and the op keys it overlapped (by count)
    overlap: float = 0.0
    overlapped: dict = field(default_factory=dict)
    _events: Any = field(default=None, repr=False)

    @property
    def world(self) -> int:
        return len(self.group)

    @property
    def seconds(self) -> float:
        """The op's time: between its CUDA events when so timed, else host start to completed wait."""
        if self.gpu_ms is not None:
            return self.gpu_ms / 1e3
        return max(self.end_ns - self.start_ns, 0) / 1e9

    @property
    def group_name(self) -> str:
        return "ranks " + ",".join(str(r) for r in self.group)

    def bandwidth(self) -> tuple[float, float]:
        return bandwidth(self.op, self.nbytes, self.seconds, self.world)

    def as_dict(self, t0: int = 0) -> dict:
        alg, bus = self.bandwidth()
        d = {"type": "comm", "op": self.op, "backend": self.backend, "group": list(self.group), "rank": self.rank,
             "bytes": self.nbytes, "dtype": self.dtype, "reduce_op": self.reduce_op, "async_op": self.async_op,
             "start_ns": self.start_ns - t0, "issued_ns": self.issued_ns - t0, "end_ns": self.end_ns - t0,
             "stream": self.stream, "tid": self.tid, "ms": self.seconds * 1e3, "algbw_GBps": alg / 1e9,
             "busbw_GBps": bus / 1e9, "overlap": self.overlap, "overlapped": dict(self.overlapped)}
        if self.gpu_ms is not None:
            d["gpu_start_ms"], d["gpu_ms"] = self.gpu_start_ms, self.gpu_ms
        return d


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def compute_overlap(comms: list[CommEvent], ops: list) -> None:
    """Fill each CommEvent's ``overlap`` (covered fraction) and ``overlapped`` (op key -> count) from the
    op spans ``ops`` (OpEvents); GPU-lane times where both sides have them, else host times."""
    host = _union([(e.start_ns, e.end_ns) for e in ops])
    gpu = _union([(e.gpu_start_ms, e.gpu_start_ms + e.gpu_ms) for e in ops
                  if e.gpu_start_ms is not None and e.gpu_ms is not None])
    for c in comms:
        on_gpu = c.gpu_start_ms is not None and c.gpu_ms is not None and gpu
        if on_gpu:
            a, b, spans = c.gpu_start_ms, c.gpu_start_ms + c.gpu_ms, gpu
        else:
            a, b, spans = c.start_ns, c.end_ns, host
        covered = sum(max(0.0, min(b, y) - max(a, x)) for x, y in spans if y > a and x < b)
        c.overlap = covered / (b - a) if b > a else 0.0
        names: dict[str, int] = {}
        for e in ops:
            if on_gpu:
                if e.gpu_start_ms is None or e.gpu_ms is None:
                    continue
                x, y = e.gpu_start_ms, e.gpu_start_ms + e.gpu_ms
            else:
                x, y = e.start_ns, e.end_ns
            if y > a and x < b:
                names[e.key] = names.get(e.key, 0) + 1
        c.overlapped = dict(sorted(names.items(), key=lambda kv: -kv[1]))


def comm_summary(comms: list[CommEvent]) -> list[dict]:
    """One row per (op, group, backend): calls, bytes, total/mean ms, algbw/busbw (GB/s, over the
    summed time), mean overlap weighted by time; sorted by total time."""
    rows: dict[tuple, dict] = {}
    for c in comms:
        k = (c.op, c.group, c.backend)
        r = rows.get(k)
        if r is None:
            r = rows[k] = {"op": c.op, "group": list(c.group), "backend": c.backend, "calls": 0, "bytes": 0,
                           "total_ms": 0.0, "_covered": 0.0, "gpu_timed": c.gpu_ms is not None}
        t = c.seconds * 1e3
        r["calls"] += 1
        r["bytes"] += c.nbytes
        r["total_ms"] += t
        r["_covered"] += c.overlap * t
    out = []
    for (op, group, _), r in rows.items():
        s = r["total_ms"] / 1e3
        alg, bus = bandwidth(op, r["bytes"], s, len(group))
        r["mean_us"] = 1e3 * r["total_ms"] / r["calls"]
        r["algbw_GBps"], r["busbw_GBps"] = alg / 1e9, bus / 1e9
        r["overlap"] = r.pop("_covered") / r["total_ms"] if r["total_ms"] > 0 else 0.0
        out.append(r)
    out.sort(key=lambda r: -r["total_ms"])
    return out


def resolve_gpu_times(comms: list[CommEvent], gpu_timer: Any) -> None:
    """GPU start/duration of NCCL collectives from their CUDA events, relative to the session's base
    event (the GPU lane's zero); without a CUDA-event timer only the duration is filled."""
    for c in comms:
        if c._events is None:
            continue
        t0, t1 = c._events
        try:
            t1.synchronize()
            if gpu_timer is not None:
                c.gpu_start_ms = float(gpu_timer.elapsed(gpu_timer.base, t0.ptr))
            c.gpu_ms = float(gpu_timer.elapsed(t0.ptr, t1.ptr)) if gpu_timer is not None else \
                float(_elapsed_ms(t0, t1))
        except Exception:  # an event from another device or a destroyed group: host times only
            c.gpu_start_ms = c.gpu_ms = None
        c._events = None


def _elapsed_ms(t0: Any, t1: Any) -> float:
    import cupy

    return cupy.cuda.get_elapsed_time(t0, t1)
