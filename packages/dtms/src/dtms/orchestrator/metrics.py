"""A Prometheus metrics endpoint (text exposition format 0.0.4) on http.server; loopback by default."""

from __future__ import annotations

import http.server
import threading
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(v: float) -> str:
    if v != v:
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


class Metrics:
    """Gauges and counters with labels; ``render()`` gives the exposition text. Thread safe."""

    def __init__(self, prefix: str = "blutrain_"):
        self.prefix = prefix
        self._lock = threading.Lock()
        self._meta: dict[str, tuple[str, str]] = {}
        self._values: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}

    def declare(self, name: str, kind: str, help_text: str) -> None:
        if kind not in ("gauge", "counter"):
            raise ValueError(f"metric {name}: kind must be 'gauge' or 'counter', got {kind!r}")
        with self._lock:
            self._meta[name] = (kind, help_text)
            self._values.setdefault(name, {})

    def set(self, name: str, value: float, **labels: Any) -> None:
        if name not in self._meta:
            raise KeyError(f"metric {name!r} was not declared")
        key = tuple(sorted((k, str(v)) for k, v in labels.items()))
        with self._lock:
            self._values[name][key] = float(value)

    def inc(self, name: str, delta: float = 1.0, **labels: Any) -> None:
        key = tuple(sorted((k, str(v)) for k, v in labels.items()))
        with self._lock:
            d = self._values[name]
            d[key] = d.get(key, 0.0) + float(delta)

    def clear(self, name: str) -> None:
        with self._lock:
            self._values[name] = {}

    def get(self, name: str, **labels: Any) -> float | None:
        key = tuple(sorted((k, str(v)) for k, v in labels.items()))
        with self._lock:
            return self._values.get(name, {}).get(key)

    def render(self) -> str:
        out: list[str] = []
        with self._lock:
            for name, (kind, help_text) in self._meta.items():
                full = self.prefix + name
                out.append(f"# HELP {full} {help_text}")
                out.append(f"# TYPE {full} {kind}")
                for key, v in sorted(self._values[name].items()):
                    lab = ",".join(f'{k}="{_escape(val)}"' for k, val in key)
                    out.append(f"{full}{{{lab}}} {_fmt(v)}" if lab else f"{full} {_fmt(v)}")
        return "\n".join(out) + "\n"


class MetricsServer:
    """Serves ``metrics.render()`` at ``/metrics`` from a daemon thread; binds 127.0.0.1 unless told."""

    def __init__(self, metrics: Metrics, host: str = "127.0.0.1", port: int = 0):
        self.metrics = metrics
        m = metrics

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404, "only /metrics is served")
                    return
                body = m.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.host, self.port = host, self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="dtms-metrics", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def orchestrator_metrics() -> Metrics:
    """The metric families the orchestrator exports."""
    m = Metrics()
    m.declare("step", "gauge", "Lowest step completed by every rank of the current attempt")
    m.declare("tokens_per_second", "gauge", "Training throughput summed over ranks")
    m.declare("restarts_total", "counter", "Gang restarts after faults")
    m.declare("incidents_total", "counter", "Incidents detected, by fault class")
    m.declare("attempt", "gauge", "Index of the current attempt")
    m.declare("last_good_step", "gauge", "Newest checkpoint step committed by every rank")
    m.declare("heartbeat_age_seconds", "gauge", "Seconds since each rank's last heartbeat")
    m.declare("gpu_temperature_celsius", "gauge", "GPU temperature (NVML)")
    m.declare("gpu_utilization_ratio", "gauge", "GPU utilisation 0..1 (NVML)")
    m.declare("gpu_ecc_errors_total", "counter", "GPU ECC error counts (NVML, volatile)")
    m.declare("gpu_throttle_reasons", "gauge", "GPU clock throttle reasons bitmask (NVML)")
    m.declare("gpu_memory_used_bytes", "gauge", "GPU memory in use")
    m.declare("step_busy_seconds", "gauge", "Seconds per step a rank spent outside collectives (straggler input)")
    m.declare("stragglers", "gauge", "Ranks currently reported as stragglers")
    return m
