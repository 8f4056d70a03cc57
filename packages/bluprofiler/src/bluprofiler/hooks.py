"""bluprofiler's plugin registrations: the profiler sinks "chrome-trace", "table" and "jsonl"."""

from __future__ import annotations

import pluggy

hookimpl = pluggy.HookimplMarker("blutrain")


@hookimpl
def blutrain_register_profiler_sinks() -> list[type]:
    from bluprofiler.sinks import ChromeTraceSink, JsonlSink, TableSink

    return [ChromeTraceSink, TableSink, JsonlSink]
