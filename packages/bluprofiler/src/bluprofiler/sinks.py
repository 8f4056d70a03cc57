"""Profiler sinks (plugin kind ``profiler_sink``): where a ProfileResult is written.

Each has ``PLUGIN_NAME`` and ``write(result, out_dir) -> Path``; third parties register more
through ``blutrain_register_profiler_sinks``.
"""

from __future__ import annotations

import json
from pathlib import Path

from bluprofiler.result import ProfileResult
from bluprofiler.trace import write_chrome_trace


class ChromeTraceSink:
    """``trace.json``: Chrome trace with host/GPU lanes and memory counters (Perfetto, chrome://tracing)."""

    PLUGIN_NAME = "chrome-trace"

    @staticmethod
    def write(result: ProfileResult, out_dir: str | Path) -> Path:
        return write_chrome_trace(result, Path(out_dir) / "trace.json")


class TableSink:
    """``summary.txt`` (the table) and ``summary.json`` (rows, peak memory)."""

    PLUGIN_NAME = "table"

    @staticmethod
    def write(result: ProfileResult, out_dir: str | Path) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(result.to_dict(), indent=1))
        p = out / "summary.txt"
        p.write_text(result.table())
        return p


class JsonlSink:
    """``events.jsonl``: one JSON object per op span, memory event and collective (times in ns since start)."""

    PLUGIN_NAME = "jsonl"

    @staticmethod
    def write(result: ProfileResult, out_dir: str | Path) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        p = out / "events.jsonl"
        items = [(e.start_ns, e.as_dict(result.t0)) for e in result.events]
        items += [(m.ts_ns, m.as_dict(result.t0)) for m in result.mem_events]
        items += [(c.start_ns, c.as_dict(result.t0)) for c in result.comms]
        items.sort(key=lambda it: it[0])
        with p.open("w") as f:
            f.write(json.dumps(session_header(result)) + "\n")
            for _, d in items:
                f.write(json.dumps(d) + "\n")
        return p


def session_header(result: ProfileResult) -> dict:
    """The first line of events.jsonl: what :func:`load_jsonl` needs to rebuild the result."""
    return {"type": "session", "device": result.device, "gpu_timing": result.gpu_timing, "t0": 0,
            "t1": result.t1 - result.t0, "wall0_ns": result.wall0_ns, "baseline_bytes": result.baseline_bytes,
            "pid": result.pid}


def load_jsonl(path: str | Path) -> ProfileResult:
    """Rebuild a ProfileResult from ``events.jsonl`` (e.g. to plot on a machine with matplotlib)."""
    from bluprofiler.events import MemEvent, OpEvent

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_jsonl: {path} " + ("is a folder, not an events.jsonl file" if path.is_dir()
                                                           else "does not exist"))
    from bluprofiler.comm import CommEvent

    head, ops, mems, comms = None, [], [], []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({e.msg}, column {e.colno}); a truncated "
                                 f"or foreign file?") from None
            if not isinstance(d, dict) or "type" not in d:
                raise ValueError(f"{path}:{lineno}: expected a JSON object with a 'type' field, got {line[:80]!r}")
            t = d.pop("type")
            try:
                if t == "session":
                    head = (lineno, d)
                elif t == "op":
                    e = OpEvent(d["name"], d["phase"], d["kernel"], d["index"], d["depth"], d["tid"], d["start_ns"],
                                d["end_ns"], tuple(tuple(s) if s is not None else None for s in d["shapes"])
                                if "shapes" in d else None, tuple(d["out_shape"]) if "out_shape" in d else None,
                                d.get("stream", 0), d.get("gpu_start_ms"), d.get("gpu_ms"), d.get("host_only", False))
                    ops.append(e)
                elif t == "comm":
                    comms.append(CommEvent(d["op"], d["backend"], tuple(d["group"]), d["rank"], d["bytes"], d["dtype"],
                                           d["reduce_op"], d["async_op"], d["start_ns"], d["issued_ns"], d["end_ns"],
                                           d.get("stream", 0), d.get("tid", 0), d.get("gpu_start_ms"),
                                           d.get("gpu_ms"), d.get("overlap", 0.0), d.get("overlapped", {})))
                else:
                    mems.append(MemEvent(d["ts_ns"], d["kind"], d["nbytes"], d["addr"], d["stream"], d["owner"],
                                         d["device"]))
            except KeyError as e:
                raise ValueError(f"{path}:{lineno}: {t!r} event lacks the field {e.args[0]!r}") from None
    if head is None:
        raise ValueError(f"{path}: no session header line (written by an older bluprofiler?)")
    lineno, h = head
    missing = [k for k in ("t1", "wall0_ns", "device", "gpu_timing", "baseline_bytes", "pid") if k not in h]
    if missing:
        raise ValueError(f"{path}:{lineno}: the session header lacks {', '.join(map(repr, missing))}")
    return ProfileResult(events=ops, mem_events=mems, t0=0, t1=h["t1"], wall0_ns=h["wall0_ns"],
                         device=h["device"], gpu_timing=h["gpu_timing"],
                         baseline_bytes=h["baseline_bytes"], pid=h["pid"], comms=comms)


BUILTIN_SINKS = {c.PLUGIN_NAME: c for c in (ChromeTraceSink, TableSink, JsonlSink)}


def get_sink(name: str) -> type:
    """A sink by name: the built-ins, then any registered through the blutrain plugin host."""
    if name in BUILTIN_SINKS:
        return BUILTIN_SINKS[name]
    from blutensor.ext import get_host

    return get_host().registry("profiler_sink").get(name)
