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
    """``events.jsonl``: one JSON object per op span and per memory event (times in ns since start)."""

    PLUGIN_NAME = "jsonl"

    @staticmethod
    def write(result: ProfileResult, out_dir: str | Path) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        p = out / "events.jsonl"
        items = [(e.start_ns, e.as_dict(result.t0)) for e in result.events]
        items += [(m.ts_ns, m.as_dict(result.t0)) for m in result.mem_events]
        items.sort(key=lambda it: it[0])
        with p.open("w") as f:
            for _, d in items:
                f.write(json.dumps(d) + "\n")
        return p


BUILTIN_SINKS = {c.PLUGIN_NAME: c for c in (ChromeTraceSink, TableSink, JsonlSink)}


def get_sink(name: str) -> type:
    """A sink by name: the built-ins, then any registered through the blutrain plugin host."""
    if name in BUILTIN_SINKS:
        return BUILTIN_SINKS[name]
    from blutensor.plugin import get_host

    return get_host().registry("profiler_sink").get(name)
