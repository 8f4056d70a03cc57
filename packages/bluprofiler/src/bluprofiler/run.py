"""profile_steps: run a few steps of any training step under the profiler and write the results.

This is what ``blutrain profile`` calls: ``profile_steps(step_fn, n_steps, out_dir) -> summary``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bluprofiler.profiler import Profiler
from bluprofiler.sinks import get_sink


def _sync(cuda: bool) -> None:
    if cuda:
        import cupy

        cupy.cuda.Device().synchronize()


def time_steps(step_fn: Callable[[], Any], n: int, cuda: bool) -> list[float]:
    """Wall time in ms of each of ``n`` calls of ``step_fn`` (synchronised on CUDA)."""
    out = []
    for _ in range(n):
        _sync(cuda)
        t = time.perf_counter()
        step_fn()
        _sync(cuda)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def profile_steps(step_fn: Callable[[], Any], n_steps: int, out_dir: str | Path, warmup: int = 1,
                  timing: bool = True, memory: bool = True, nvtx: bool | None = None, device: str | None = None,
                  sinks: tuple[str, ...] = ("table", "chrome-trace", "jsonl"), plot: bool = True,
                  meta: dict | None = None) -> dict:
    """Run ``warmup`` unprofiled then ``n_steps`` profiled calls of ``step_fn()`` (each inside a
    ``step`` region, synchronised), write each sink and the memory PNG into ``out_dir``, and
    return the summary dict (also saved as ``summary.json`` by the "table" sink)."""
    if not callable(step_fn):
        raise TypeError(f"profile_steps: step_fn must be a callable, got {type(step_fn).__name__}")
    for name, v, lo in (("n_steps", n_steps, 1), ("warmup", warmup, 0)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"profile_steps: {name} must be an int, got {type(v).__name__} {v!r}")
        if v < lo:
            raise ValueError(f"profile_steps: {name} must be >= {lo}, got {v}")
    if isinstance(sinks, str):
        raise TypeError(f"profile_steps: sinks must be a list of sink names, got the string {sinks!r} "
                        f"(write sinks=({sinks!r},))")
    writers = [(name, get_sink(name)) for name in sinks]  # an unknown sink fails before the steps run
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"profile_steps: out_dir {str(out)!r} exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"profile_steps: cannot create out_dir {str(out)!r}: {e.strerror or e}") from None
    for _ in range(warmup):
        step_fn()
    prof = Profiler(timing=timing, memory=memory, nvtx=nvtx, device=device)
    losses = []
    with prof:
        cuda = prof.cuda
        _sync(cuda)
        for _i in range(n_steps):
            with prof.region("step"):
                losses.append(step_fn())
                _sync(cuda)
    res = prof.result
    res.meta.update({"n_steps": n_steps, "warmup": warmup, **(meta or {})})
    res.meta["losses"] = [float(x) for x in losses if isinstance(x, int | float)]
    files = {}
    for name, sink in writers:
        files[name] = str(sink.write(res, out))
    if plot and res.mem_events:
        from bluprofiler.plot import PlotUnavailable, plot_memory

        try:
            files["memory-png"] = str(plot_memory(res, out / "memory.png"))
        except PlotUnavailable as e:
            files["memory-png"] = f"skipped: {e}"
    summary = res.to_dict()
    summary["files"] = files
    summary["step_ms_each"] = [s.cpu_us / 1e3 for s in res.regions("step")]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
