"""Chrome trace export (the JSON that Perfetto and chrome://tracing load).

Lanes: process "host" with one thread per Python thread (op and region spans, nested by time);
process "GPU" with one thread per CUDA stream (the same spans at the time the GPU ran them, when
timed with CUDA events) linked to their launch by flow arrows; counters "memory" (allocated and
reserved MiB) on the host process; process "communication" with one thread per (process group,
stream): every dtms collective as a span (host start to completed wait, or its CUDA-event time on the
communication stream for NCCL) with op, group, bytes, bus bandwidth and the compute it overlapped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bluprofiler.result import ProfileResult

HOST_PID, GPU_PID, COMM_PID = 1, 2, 3


def chrome_trace(res: ProfileResult) -> dict:
    """The trace as a dict ``{"traceEvents": [...], "displayTimeUnit": "ms", ...}``."""
    t0 = res.t0
    ev: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": HOST_PID, "args": {"name": f"host (pid {res.pid})"}},
        {"ph": "M", "name": "process_sort_index", "pid": HOST_PID, "args": {"sort_index": 0}},
    ]
    tids: dict[int, int] = {}
    streams: dict[int, int] = {}
    flow = 0
    for e in sorted(res.events, key=lambda e: e.start_ns):
        tid = tids.setdefault(e.tid, len(tids) + 1)
        args = {"index": e.index, "phase": e.phase}
        if e.kernel:
            args["kernel"] = e.kernel
        if e.shapes is not None:
            args["shapes"] = [list(s) if s is not None else None for s in e.shapes]
        if e.out_shape is not None:
            args["out_shape"] = list(e.out_shape)
        if e.gpu_ms is not None:
            args["gpu_ms"] = round(e.gpu_ms, 6)
        if e.host_only:
            args["host_only"] = True  # a view op: no kernel, no GPU lane entry
        ts = (e.start_ns - t0) / 1e3
        cat = "region" if e.phase == "region" else e.phase
        ev.append({"ph": "X", "name": e.key, "cat": cat, "pid": HOST_PID, "tid": tid, "ts": ts,
                   "dur": max((e.end_ns - e.start_ns) / 1e3, 0.001), "args": args})
        if e.gpu_start_ms is not None and e.gpu_ms is not None and e.phase != "region":
            stid = streams.setdefault(e.stream, len(streams) + 1)
            gts = e.gpu_start_ms * 1e3
            ev.append({"ph": "X", "name": e.key, "cat": "gpu", "pid": GPU_PID, "tid": stid, "ts": gts,
                       "dur": max(e.gpu_ms * 1e3, 0.001), "args": {"index": e.index, "kernel": e.kernel}})
            flow += 1
            ev.append({"ph": "s", "id": flow, "name": "launch", "cat": "launch", "pid": HOST_PID, "tid": tid,
                       "ts": ts})
            ev.append({"ph": "f", "bp": "e", "id": flow, "name": "launch", "cat": "launch", "pid": GPU_PID,
                       "tid": stid, "ts": gts})
    for py_tid, tid in tids.items():
        ev.append({"ph": "M", "name": "thread_name", "pid": HOST_PID, "tid": tid, "args": {"name": f"thread {py_tid}"}})
    if streams:
        ev.append({"ph": "M", "name": "process_name", "pid": GPU_PID, "args": {"name": "GPU"}})
        ev.append({"ph": "M", "name": "process_sort_index", "pid": GPU_PID, "args": {"sort_index": 1}})
        for s, tid in streams.items():
            ev.append({"ph": "M", "name": "thread_name", "pid": GPU_PID, "tid": tid,
                       "args": {"name": f"stream 0x{s:x}" if s else "default stream"}})
    ev += comm_trace_events(res)
    if res.mem_events:
        ts_ns, alloc, resv = res.timeline()
        for t, a, r in zip(ts_ns, alloc, resv):
            args = {"allocated_MiB": a / 2**20}
            if res.device == "cuda":
                args["reserved_MiB"] = r / 2**20
            ev.append({"ph": "C", "name": "memory", "pid": HOST_PID, "ts": t / 1e3, "args": args})
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"producer": "bluprofiler", "device": res.device, "gpu_timing": res.gpu_timing,
                          "wall0_ns": res.wall0_ns, "step_ms": res.step_ms()}}


def comm_trace_events(res: ProfileResult) -> list[dict]:
    """The "communication" process of the trace: one lane per (group, stream), a span per collective."""
    if not res.comms:
        return []
    ev: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": COMM_PID, "args": {"name": "communication"}},
        {"ph": "M", "name": "process_sort_index", "pid": COMM_PID, "args": {"sort_index": 2}},
    ]
    lanes: dict[tuple, int] = {}
    for c in res.comms:
        lane = (c.group, c.stream)
        tid = lanes.setdefault(lane, len(lanes) + 1)
        alg, bus = c.bandwidth()
        args = {"op": c.op, "backend": c.backend, "group": list(c.group), "bytes": c.nbytes, "dtype": c.dtype,
                "async_op": c.async_op, "algbw_GBps": round(alg / 1e9, 6), "busbw_GBps": round(bus / 1e9, 6),
                "overlap": round(c.overlap, 4), "overlapped": dict(list(c.overlapped.items())[:10]),
                "host_start_us": (c.start_ns - res.t0) / 1e3, "host_end_us": (c.end_ns - res.t0) / 1e3}
        if c.reduce_op:
            args["reduce_op"] = c.reduce_op
        if c.gpu_start_ms is not None and c.gpu_ms is not None:
            ts, dur = c.gpu_start_ms * 1e3, c.gpu_ms * 1e3
            args["clock"] = "gpu"
        else:
            ts, dur = (c.start_ns - res.t0) / 1e3, (c.end_ns - c.start_ns) / 1e3
            args["clock"] = "host"
        ev.append({"ph": "X", "name": c.op, "cat": "collective", "pid": COMM_PID, "tid": tid, "ts": ts,
                   "dur": max(dur, 0.001), "args": args})
    for (group, stream), tid in lanes.items():
        name = "ranks " + ",".join(map(str, group)) + (f" stream 0x{stream:x}" if stream else "")
        ev.append({"ph": "M", "name": "thread_name", "pid": COMM_PID, "tid": tid, "args": {"name": name}})
    return ev


def write_chrome_trace(res: ProfileResult, path: str | Path) -> Path:
    """Write the trace JSON to ``path`` and return it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(res)))
    return path
