"""Loss-curve PNG from a run's log.jsonl (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import json
from pathlib import Path


def read_log(path: str | Path) -> list[dict]:
    """The JSON objects of a log.jsonl file (blank lines skipped)."""
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line))
    return out


def plot_losses(log_path: str | Path, png_path: str | Path, title: str = "") -> Path:
    """Write train (and validation, when logged) loss against step to ``png_path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_log(log_path)
    tr = [(r["step"], r["loss"]) for r in recs if r.get("loss") is not None]
    va = [(r["step"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if tr:
        ax.plot(*zip(*tr), label="train", lw=1)
    if va:
        ax.plot(*zip(*va), "o-", label="validation", lw=1.5, ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = Path(png_path)
    fig.savefig(png)
    plt.close(fig)
    return png
