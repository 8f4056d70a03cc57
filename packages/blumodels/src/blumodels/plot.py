"""Loss-curve PNG from a run's log.jsonl (matplotlib, Agg backend: no display needed).

The top panel shows the raw per-step training loss faded, an exponential moving average over it (debiased as
TensorBoard's smoothing is, so the first steps are not pulled towards 0), the validation points, and a second
x axis with the tokens seen; the bottom panel shows the learning-rate schedule.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


def read_log(path: str | Path) -> list[dict]:
    """The JSON objects of a log.jsonl file (blank lines skipped)."""
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line))
    return out


def auto_smoothing(n: int) -> float:
    """EMA weight for ``n`` points: an effective window of about n/10 steps (0 for 10 points or fewer)."""
    return float(min(0.98, max(0.0, 1.0 - 10.0 / max(n, 1))))


def ema(values: np.ndarray, weight: float) -> np.ndarray:
    """Debiased exponential moving average: s_t = (w*m_{t-1} + (1-w)*x_t) / (1 - w^(t+1))."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"ema: weight must be in [0, 1), got {weight}")
    out = np.empty(len(values), dtype=np.float64)
    m = 0.0
    for i, x in enumerate(np.asarray(values, dtype=np.float64)):
        m = weight * m + (1.0 - weight) * x
        out[i] = m / (1.0 - weight ** (i + 1))
    return out


def loss_series(recs: list[dict[str, Any]], smoothing: float | None = None) -> dict[str, Any]:
    """What the plot draws: steps, raw and smoothed train loss, validation points, lr, tokens per step."""
    tr = [r for r in recs if isinstance(r.get("loss"), int | float) and np.isfinite(r["loss"])]
    steps = np.array([r["step"] for r in tr], dtype=np.int64)
    loss = np.array([r["loss"] for r in tr], dtype=np.float64)
    w = auto_smoothing(len(loss)) if smoothing is None else smoothing
    va = [(r["step"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
    lr = [(r["step"], r["lr"]) for r in recs if r.get("lr") is not None]
    tok = [r["tokens"] / (r["step"] + 1) for r in recs if r.get("tokens")]
    return {"steps": steps, "loss": loss, "smoothed": ema(loss, w) if len(loss) else loss, "smoothing": w,
            "val_steps": np.array([s for s, _ in va], dtype=np.int64),
            "val": np.array([v for _, v in va], dtype=np.float64),
            "lr_steps": np.array([s for s, _ in lr], dtype=np.int64),
            "lr": np.array([v for _, v in lr], dtype=np.float64),
            "tokens_per_step": float(tok[-1]) if tok else None}


def _human(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.3g}"


def plot_losses(log_path: str | Path, png_path: str | Path, title: str = "",
                smoothing: float | None = None) -> Path:
    """Write the loss figure of ``log_path`` to ``png_path`` (``smoothing``: EMA weight, default by length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    s = loss_series(read_log(log_path), smoothing)
    fig, (ax, axlr) = plt.subplots(2, 1, figsize=(8, 5.5), dpi=100, sharex=True,
                                   gridspec_kw={"height_ratios": [3, 1]})
    if len(s["loss"]):
        ax.plot(s["steps"], s["loss"], color="tab:blue", alpha=0.25, lw=0.8, label="train (per step)")
        ax.plot(s["steps"], s["smoothed"], color="tab:blue", lw=1.8,
                label=f"train (EMA {s['smoothing']:.2f})")
    if len(s["val"]):
        ax.plot(s["val_steps"], s["val"], "o-", color="tab:orange", lw=1.2, ms=4, label="validation")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    tps = s["tokens_per_step"]
    if tps:
        top = ax.secondary_xaxis("top", functions=(lambda x: x * tps, lambda t: t / tps))
        top.set_xlabel("tokens seen")
        top.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _human(v)))
    if len(s["lr"]):
        axlr.plot(s["lr_steps"], s["lr"], color="tab:green", lw=1.2)
    axlr.set_ylabel("learning rate")
    axlr.set_xlabel("step")
    axlr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    axlr.grid(alpha=0.3)
    fig.tight_layout()
    png = Path(png_path)
    fig.savefig(png)
    plt.close(fig)
    return png
