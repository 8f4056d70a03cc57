"""Logger plugins: TensorBoard event files read back by tensorboard's own reader; Prometheus scraped mid-run."""

import re
import urllib.request

import numpy as np
import pluggy
import pytest
from blumodels.config import ConfigError, apply_overrides
from blumodels.trainer import Trainer
from blutensor.ext import get_host
from models_helpers import micro_config, micro_data

hookimpl = pluggy.HookimplMarker("blutrain")


class _Scraper:
    """Reads the Prometheus page from inside the run (at the end of step ``at``)."""

    def __init__(self, url: str, at: int) -> None:
        self.url, self.at, self.page = url, at, None

    @hookimpl
    def blutrain_on_step_end(self, step, metrics):
        if step == self.at:
            with urllib.request.urlopen(self.url, timeout=10) as r:
                self.page = r.read().decode()


def _gauge(page: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", page, re.M)
    assert m, f"{name} not on the page"
    return float(m.group(1))


def test_tensorboard_and_prometheus_during_a_run(tmp_path):
    pytest.importorskip("tensorboardX")
    pytest.importorskip("prometheus_client")
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    cfg = apply_overrides(micro_config(micro_data(), steps=6, checkpoint_interval=0),
                          ["log.tensorboard=true", "log.prometheus=true", "log.prometheus_port=0"])
    tr = Trainer(cfg, tmp_path / "run", quiet=True)
    try:
        prom = next(lg for lg in tr.loggers if hasattr(lg, "url"))
        assert prom.url.startswith("http://127.0.0.1:") and prom.port > 0
        scraper = _Scraper(prom.url, at=4)  # registered last: pluggy calls it before the Prometheus logger
        get_host().register(scraper)
        try:
            tr.fit()
        finally:
            get_host().pm.unregister(scraper)
    finally:
        tr.close()
    h = tr.history
    page = scraper.page
    assert _gauge(page, "blutrain_step") == 4  # steps 0..3 done when step 4 ends
    assert _gauge(page, "blutrain_train_loss") == pytest.approx(h[3]["loss"], rel=1e-12)
    assert _gauge(page, "blutrain_learning_rate") == pytest.approx(h[3]["lr"], rel=1e-12)
    assert _gauge(page, "blutrain_val_loss") == pytest.approx(h[0]["val_loss"], rel=1e-12)  # eval at 0 and 4
    assert _gauge(page, "blutrain_tokens_total") == h[3]["tokens"]
    with pytest.raises(OSError):  # closed with the Trainer
        urllib.request.urlopen(prom.url, timeout=2)

    ea = ea_mod.EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert {"loss/train", "loss/val", "optim/lr", "optim/grad_norm", "perf/tokens_per_s", "memory/bytes",
            "data/tokens"} <= tags
    train = ea.Scalars("loss/train")
    assert [e.step for e in train] == list(range(6))
    np.testing.assert_allclose([e.value for e in train], [r["loss"] for r in h], rtol=1e-6)
    assert [e.step for e in ea.Scalars("loss/val")] == [0, 4, 5]
    np.testing.assert_allclose([e.value for e in ea.Scalars("optim/lr")], [r["lr"] for r in h], rtol=1e-6)


def test_logger_config_errors(tmp_path):
    import socket

    with socket.socket() as s:  # a port in use is named before training
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cfg = apply_overrides(micro_config(micro_data()), ["log.prometheus=true", f"log.prometheus_port={port}"])
        with pytest.raises(ConfigError, match=f"cannot serve on 127.0.0.1:{port}"):
            Trainer(cfg, tmp_path / "run", quiet=True)
    with pytest.raises(ConfigError, match="log.prometheus_port=70000 is past its bound of 65535"):
        apply_overrides(micro_config(micro_data()), ["log.prometheus_port=70000"])
    with pytest.raises(ConfigError, match="unknown key log.tensorbord; did you mean 'log.tensorboard'"):
        apply_overrides(micro_config(micro_data()), ["log.tensorbord=true"])
