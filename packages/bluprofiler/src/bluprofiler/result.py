"""ProfileResult: what a session recorded, plus the views the writers need (table rows, memory)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bluprofiler import memory as _memory
from bluprofiler.comm import CommEvent, comm_summary
from bluprofiler.events import MemEvent, OpEvent


@dataclass
class ProfileResult:
    """Op/region spans and memory events of one session; times are ``perf_counter_ns`` values."""

    events: list[OpEvent]
    mem_events: list[MemEvent]
    t0: int
    t1: int
    wall0_ns: int
    device: str
    gpu_timing: bool
    baseline_bytes: int = 0
    pid: int = 0
    meta: dict = field(default_factory=dict)
    #: collectives of dtms process groups completed during the session (bluprofiler.comm)
    comms: list[CommEvent] = field(default_factory=list)

    @property
    def wall_ms(self) -> float:
        return (self.t1 - self.t0) / 1e6

    def ops(self) -> list[OpEvent]:
        """Op spans (forward and backward), without regions."""
        return [e for e in self.events if e.phase != "region"]

    def regions(self, name: str | None = None) -> list[OpEvent]:
        return [e for e in self.events if e.phase == "region" and (name is None or e.name == name)]

    def step_ms(self) -> float:
        """Total time of the ``step`` regions if any (CUDA-event time when timed), else the session's wall time."""
        steps = self.regions("step")
        if not steps:
            return self.wall_ms
        return sum(e.cpu_us for e in steps) / 1e3

    def self_times(self) -> dict[int, tuple[float, float | None]]:
        """id(op span) -> (self host us, self GPU ms): its time minus that of the op spans nested
        directly inside it (an op run inside another op's span, e.g. a checkpointed forward
        recomputed inside a backward), so that nested work is not counted twice."""
        out: dict[int, list] = {}
        by_tid: dict[int, list[OpEvent]] = {}
        for e in self.events:
            by_tid.setdefault(e.tid, []).append(e)
        for evs in by_tid.values():
            evs.sort(key=lambda e: (e.start_ns, -e.end_ns))
            stack: list[OpEvent] = []
            for e in evs:
                while stack and stack[-1].end_ns <= e.start_ns:
                    stack.pop()
                if e.phase != "region":
                    out[id(e)] = [e.cpu_us, e.gpu_ms]
                    parent = next((p for p in reversed(stack) if p.phase != "region"), None)
                    if parent is not None:
                        rec = out[id(parent)]
                        rec[0] -= e.cpu_us
                        if rec[1] is not None and e.gpu_ms is not None:
                            rec[1] -= e.gpu_ms
                stack.append(e)
        return {k: (max(v[0], 0.0), None if v[1] is None else max(v[1], 0.0)) for k, v in out.items()}

    def summary(self, sort_by: str = "total", top: int | None = None) -> list[dict]:
        """One row per (op, phase, kernel): calls, total/self/mean time (GPU if timed, else host), share.

        ``host_only`` is True for rows whose every call was a view op on a GPU-timed session (no
        kernel, no CUDA events: CUDA-event time 0, host time in ``cpu_ms``).

        ``total_ms`` includes op spans nested inside (rare: ops run inside another op's span);
        ``self_ms`` excludes them, and ``share`` is ``self_ms`` over the step time (``step_ms``) in
        percent, so the shares of all rows add up to at most 100.
        """
        rows: dict[tuple, dict] = {}
        selft = self.self_times()
        for e in self.ops():
            k = (e.name, e.phase, e.kernel)
            r = rows.get(k)
            if r is None:
                r = rows[k] = {"name": e.key, "op": e.name, "phase": e.phase, "kernel": e.kernel, "calls": 0,
                               "cpu_ms": 0.0, "gpu_ms": 0.0 if self.gpu_timing else None, "self_ms": 0.0,
                               "host_only": self.gpu_timing}
            r["calls"] += 1
            if not e.host_only:
                r["host_only"] = False
            r["cpu_ms"] += e.cpu_us / 1e3
            sc, sg = selft[id(e)]
            if e.gpu_ms is not None:
                r["gpu_ms"] += e.gpu_ms
            r["self_ms"] += sg if (self.gpu_timing and sg is not None) else sc / 1e3
        step = self.step_ms() or 1e-9
        out = []
        for r in rows.values():
            t = r["gpu_ms"] if r["gpu_ms"] is not None else r["cpu_ms"]
            r["total_ms"] = t
            r["mean_us"] = 1e3 * t / r["calls"]
            r["share"] = 100.0 * r["self_ms"] / step
            out.append(r)
        key = {"total": "total_ms", "self": "self_ms", "calls": "calls", "mean": "mean_us"}.get(sort_by)
        if key is None:
            raise ValueError(f"summary(sort_by={sort_by!r}): expected 'total', 'self', 'calls' or 'mean'")
        out.sort(key=lambda r: -r[key])
        return out[:top] if top else out

    def comm_summary(self) -> list[dict]:
        """One row per (collective, group): calls, bytes, time, algbw/busbw (GB/s), overlap fraction."""
        return comm_summary(self.comms)

    def timeline(self) -> tuple[list[int], list[int], list[int]]:
        """(ns since start, allocated bytes, reserved bytes) after each memory event."""
        ts, a, r = _memory.timeline(self.mem_events)
        return [t - self.t0 for t in ts], a, r

    def peak_memory(self) -> dict:
        """Peak allocated bytes above the session's start and the live bytes at the peak by owner."""
        p = _memory.peak(self.mem_events)
        if p["peak_ts_ns"] is not None:
            p["peak_ts_ns"] -= self.t0
        p["baseline_bytes"] = self.baseline_bytes
        return p

    def table(self, top: int = 25, sort_by: str = "total") -> str:
        from bluprofiler.table import format_table

        return format_table(self, top=top, sort_by=sort_by)

    def chrome_trace(self) -> dict:
        from bluprofiler.trace import chrome_trace

        return chrome_trace(self)

    def to_dict(self) -> dict:
        """JSON-ready summary: device, wall/step time, rows, peak memory."""
        return {"device": self.device, "gpu_timing": self.gpu_timing, "wall_ms": self.wall_ms,
                "step_ms": self.step_ms(), "n_ops": len(self.ops()), "n_mem_events": len(self.mem_events),
                "rows": self.summary(), "memory": self.peak_memory(), "collectives": self.comm_summary(),
                **self.meta}
