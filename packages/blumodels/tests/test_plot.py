"""Loss PNG: raw curve faded, a debiased EMA, validation points, the LR schedule and a tokens axis."""

import json

import numpy as np
import pytest
from blumodels.plot import auto_smoothing, ema, loss_series, plot_losses


def test_ema_matches_a_float64_reference():
    x = np.random.default_rng(0).normal(3.0, 0.5, 200)
    for w in (0.0, 0.6, 0.95):
        ref, m = [], 0.0
        for i, v in enumerate(x):
            m = w * m + (1 - w) * v
            ref.append(m / (1 - w ** (i + 1)))
        np.testing.assert_allclose(ema(x, w), ref, rtol=1e-12)
    assert ema(x, 0.9)[0] == x[0]  # debiased: the first point is not pulled towards 0
    assert np.std(np.diff(ema(x, 0.95))) < 0.1 * np.std(np.diff(x))
    with pytest.raises(ValueError, match="weight"):
        ema(x, 1.0)
    assert auto_smoothing(5) == 0.0 and auto_smoothing(300) == pytest.approx(1 - 10 / 300)


def test_plot_series_and_png(tmp_path):
    rng = np.random.default_rng(1)
    recs = [{"step": s, "loss": 6.0 - s / 100 + rng.normal(0, 0.5), "lr": 1e-3 * min(1, (s + 1) / 10),
             "tokens": (s + 1) * 4096} for s in range(300)]
    for s in (0, 100, 299):
        recs[s]["val_loss"] = 6.0 - s / 100
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    s = loss_series(recs)
    assert len(s["loss"]) == 300 and s["tokens_per_step"] == 4096
    assert s["val_steps"].tolist() == [0, 100, 299] and len(s["lr"]) == 300
    trend = 6.0 - s["steps"] / 100
    # the smoothed curve follows the trend far closer than the raw steps (lag of a ~30-step window: ~0.15)
    assert np.abs(s["smoothed"] - trend)[50:].mean() < 0.25 < np.abs(s["loss"] - trend)[50:].mean()
    png = plot_losses(log, tmp_path / "loss.png", title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
