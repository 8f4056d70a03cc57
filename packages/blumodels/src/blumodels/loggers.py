"""Logger plugins: step metrics to TensorBoard and Prometheus through the ``blutrain_on_step_end`` hook.

Each logger is a pluggy plugin object: the Trainer registers the ones ``[log]`` asks for with the plugin host when
it starts (rank 0 only) and unregisters them in ``close()``. A third-party sink (W&B, MLflow, ...) is the same
thing shipped as an entry point of group ``blutrain``: a module or object with a ``blutrain_on_step_end(step,
metrics)`` hook implementation receives every step's record (``loss``, ``lr``, ``grad_norm``, ``tokens_per_s``,
``mfu``, ``mem_bytes``, ``tokens``, ``step_ms`` and, at validation steps, ``val_loss``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pluggy

from blumodels.config import ConfigError, RunConfig

hookimpl = pluggy.HookimplMarker("blutrain")

#: metrics-record key -> TensorBoard tag (grouped as TensorBoard shows them)
TB_TAGS = {"loss": "loss/train", "val_loss": "loss/val", "lr": "optim/lr", "grad_norm": "optim/grad_norm",
           "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "step_ms": "perf/step_ms",
           "mem_bytes": "memory/bytes", "peak_allocated_bytes": "memory/peak_allocated_bytes",
           "peak_reserved_bytes": "memory/peak_reserved_bytes", "tokens": "data/tokens"}


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


class TensorBoardLogger:
    """Scalars of every step record (``TB_TAGS``) into TensorBoard event files under ``logdir`` (tensorboardX)."""

    def __init__(self, logdir: str | Path) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ConfigError("log.tensorboard = true needs tensorboardX: pip install 'blumodels[tensorboard]'") \
                from None
        self.logdir = Path(logdir)
        self.writer = SummaryWriter(logdir=str(self.logdir), flush_secs=10)

    @hookimpl
    def blutrain_on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        for key, tag in TB_TAGS.items():
            v = _number(metrics.get(key))
            if v is not None and math.isfinite(v):
                self.writer.add_scalar(tag, v, global_step=step)

    @hookimpl
    def blutrain_on_checkpoint_saved(self, path: str, step: int) -> None:
        self.writer.flush()  # what a checkpoint covers is on disk in the event file too

    def close(self) -> None:
        self.writer.close()


class PrometheusLogger:
    """Gauges of the latest step (loss, val loss, lr, grad norm, tokens/s, MFU, memory, step) served on
    ``http://host:port/metrics`` by ``prometheus_client`` from a background thread."""

    GAUGES = {"loss": ("blutrain_train_loss", "training loss of the latest step (nats/token)"),
              "val_loss": ("blutrain_val_loss", "latest validation loss (nats/token)"),
              "lr": ("blutrain_learning_rate", "learning rate of the latest step"),
              "grad_norm": ("blutrain_grad_norm", "global gradient norm of the latest step"),
              "tokens_per_s": ("blutrain_tokens_per_second", "training throughput of the latest step"),
              "mfu": ("blutrain_mfu", "model FLOPs utilisation of the latest step (0..1)"),
              "mem_bytes": ("blutrain_memory_bytes", "device memory in use (CPU: peak RSS)"),
              "tokens": ("blutrain_tokens_total", "tokens trained on so far")}

    def __init__(self, host: str = "127.0.0.1", port: int = 9464) -> None:
        try:
            import prometheus_client as pc
        except ImportError:
            raise ConfigError("log.prometheus = true needs prometheus_client: pip install 'blumodels[prometheus]'") \
                from None
        self.registry = pc.CollectorRegistry()
        self.gauges = {k: pc.Gauge(name, doc, registry=self.registry) for k, (name, doc) in self.GAUGES.items()}
        self.step_gauge = pc.Gauge("blutrain_step", "optimisation steps completed", registry=self.registry)
        try:
            started = pc.start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise ConfigError(f"log.prometheus: cannot serve on {host}:{port} ({e.strerror or e}); set "
                              "log.prometheus_port (0 = any free port)") from None
        self._server, self._thread = started if isinstance(started, tuple) else (None, None)
        self.host = host
        self.port = int(self._server.server_port) if self._server is not None else int(port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    @hookimpl
    def blutrain_on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        self.step_gauge.set(step + 1)
        for key, g in self.gauges.items():
            v = _number(metrics.get(key))
            if v is not None:
                g.set(v)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def start_loggers(cfg: RunConfig, out_dir: str | Path, is_main: bool = True, log: Any = print) -> list[Any]:
    """The loggers ``cfg.log`` asks for, registered with the plugin host (none on ranks other than 0)."""
    if not is_main:
        return []
    from blutensor.ext import get_host

    lc = cfg.log
    loggers: list[Any] = []
    try:
        if lc.tensorboard:
            tb = TensorBoardLogger(lc.tensorboard_dir or Path(out_dir) / "tensorboard")
            loggers.append(tb)
            log(f"[blutrain] TensorBoard events in {tb.logdir} (tensorboard --logdir {tb.logdir})")
        if lc.prometheus:
            pm = PrometheusLogger(lc.prometheus_host, lc.prometheus_port)
            loggers.append(pm)
            log(f"[blutrain] Prometheus metrics on {pm.url}")
    except BaseException:
        stop_loggers(loggers)
        raise
    host = get_host()
    for lg in loggers:
        host.register(lg)
    return loggers


def stop_loggers(loggers: list[Any]) -> None:
    """Unregister and close loggers made by :func:`start_loggers` (idempotent)."""
    from blutensor.ext import get_host

    pm = get_host().pm
    while loggers:
        lg = loggers.pop()
        if pm.is_registered(lg):
            pm.unregister(lg)
        lg.close()
