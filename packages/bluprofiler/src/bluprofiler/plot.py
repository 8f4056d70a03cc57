"""Memory timeline PNG (matplotlib, Agg backend; an optional dependency: ``pip install bluprofiler[plot]``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bluprofiler.result import ProfileResult


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("bluprofiler's memory plot needs matplotlib: pip install 'bluprofiler[plot]' "
                              "(the table and the trace do not)") from None
    return plt


def plot_memory(res: ProfileResult, path: str | Path, title: str | None = None) -> Path:
    """Allocated (and on CUDA reserved) MiB over time, steps shaded, the peak marked with its top owners."""
    plt = _pyplot()
    ts, alloc, resv = res.timeline()
    fig, ax = plt.subplots(figsize=(11, 4.5), dpi=110)
    x = [t / 1e6 for t in ts]
    base = res.baseline_bytes
    ax.step(x, [(a + base) / 2**20 for a in alloc], where="post", label="allocated", lw=1.2)
    if res.device == "cuda" and any(resv):
        ax.step(x, [r / 2**20 for r in resv], where="post", label="reserved (new cudaMalloc)", lw=0.8, alpha=0.7)
    for i, s in enumerate(res.regions("step")):
        ax.axvspan((s.start_ns - res.t0) / 1e6, (s.end_ns - res.t0) / 1e6, color="grey" if i % 2 else "silver",
                   alpha=0.15, lw=0)
    p = res.peak_memory()
    if p["peak_ts_ns"] is not None:
        top = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in list(p["by_owner"].items())[:4])
        ax.annotate(f"peak {(p['peak_bytes'] + base) / 2**20:.1f} MiB\n{top}", xy=(p["peak_ts_ns"] / 1e6,
                    (p["peak_bytes"] + base) / 2**20), xytext=(10, -30), textcoords="offset points", fontsize=7,
                    arrowprops={"arrowstyle": "->", "lw": 0.6})
    ax.set_xlabel("time since profiler start (ms)")
    ax.set_ylabel("MiB")
    ax.set_title(title or f"bluprofiler memory timeline ({res.device})")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m bluprofiler.plot OUT_DIR``: (re)draw OUT_DIR/memory.png from OUT_DIR/events.jsonl."""
    import argparse

    from bluprofiler.sinks import load_jsonl

    ap = argparse.ArgumentParser(prog="python -m bluprofiler.plot",
                                 description="(Re)draw OUT_DIR/memory.png from OUT_DIR/events.jsonl.")
    ap.add_argument("out_dir", type=Path, help="a folder written by profile_steps (blutrain profile)")
    out = ap.parse_args(argv).out_dir
    events = out / "events.jsonl"
    if not events.is_file():
        print(f"error: {events} does not exist: OUT_DIR must be a folder written by profile_steps")
        return 2
    try:
        res = load_jsonl(events)
    except (OSError, ValueError) as e:
        print(f"error: {e}")
        return 2
    p = plot_memory(res, out / "memory.png")
    print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
