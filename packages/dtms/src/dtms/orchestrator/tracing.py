"""Incidents and recoveries as OpenTelemetry traces: one trace per run id, a span per attempt, per fault
and per recovery, exported over OTLP (HTTP/protobuf, or gRPC) and/or to an OTLP/JSON-lines file.

The orchestrator feeds :class:`RunTracer` the same records it appends to ``events.jsonl``; spans are built
from them with the maintained ``opentelemetry-sdk`` (extra ``dtms[otel]``), imported only when tracing is
configured. The trace id is derived from the run id (SHA-256), so every orchestrator process of one run
(a relaunch after preemption, or after the orchestrator itself was killed) writes into the same trace:

- ``blutrain.run``: the root, span id also derived from the run id, emitted once when the run ends for good
  (succeeded, failed, gave up); a preempted run's spans wait for it under the same parent;
- ``blutrain.attempt``: one per attempt, from its launch to its end (outcome, resume and reached steps,
  launcher exit code);
- ``blutrain.fault``: one per incident, child of its attempt, from when the fault was reported to when the
  orchestrator recorded it (fault class, rank, step, checkpoint step, exit code, how it was detected);
- ``blutrain.recovery``: one per gang restart, from the decision to restart to the first step every rank of
  the next attempt completed (or that attempt's end, ``recovered=false``).

Configured by ``--otel-endpoint URL`` (OTLP base URL, ``/v1/traces`` appended as the OTLP specification
says), ``--otel-file PATH``, or the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` variables (``OTEL_EXPORTER_OTLP_PROTOCOL=grpc`` picks the gRPC
exporter; ``OTEL_SDK_DISABLED=true`` turns tracing off).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
PROTOCOL_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
INSTALL_HINT = "pip install 'dtms[otel]'"
SERVICE_NAME = "blutrain-orchestrator"


class TracingConfigError(ValueError):
    """Tracing was asked for but cannot be set up (package missing, bad endpoint or protocol)."""


def run_trace_ids(run_id: str) -> tuple[int, int]:
    """(trace id, root span id) of a run: the first 16 and next 8 bytes of SHA-256(run id), never zero."""
    h = hashlib.sha256(f"blutrain-run:{run_id}".encode()).digest()
    return int.from_bytes(h[:16], "big") or 1, int.from_bytes(h[16:24], "big") or 1


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a base endpoint (``http://host:4318`` -> ``.../v1/traces``)."""
    from urllib.parse import urlsplit

    u = urlsplit(endpoint)
    if u.scheme not in ("http", "https") or not u.netloc:
        raise TracingConfigError(f"OTLP endpoint {endpoint!r} is not an http:// or https:// URL")
    return endpoint if u.path.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"


def _exit_code(text: Any) -> int | None:
    """A shell exit status from a launcher description ('failed (exit code 3)', 'killed by signal 9 ...')."""
    if text is None:
        return None
    if isinstance(text, int):
        return text
    m = re.search(r"exit code (-?\d+)", str(text))
    if m:
        return int(m.group(1))
    m = re.search(r"signal (\d+)", str(text))
    return 128 + int(m.group(1)) if m else None


def _ns(t: float | None) -> int:
    return int((time.time() if t is None else float(t)) * 1e9)


def _attrs(d: Mapping[str, Any]) -> dict[str, Any]:
    """OTel attribute values: drop None, keep bool/int/float/str, stringify the rest."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if v is None:
            continue
        out[k] = v if isinstance(v, (bool, int, float, str)) else json.dumps(v, default=str)
    return out


def _import_sdk() -> dict[str, Any]:
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
        from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
        from opentelemetry.trace import (
            NonRecordingSpan,
            SpanContext,
            SpanKind,
            Status,
            StatusCode,
            TraceFlags,
            set_span_in_context,
        )
    except ImportError as e:
        raise TracingConfigError(f"OpenTelemetry tracing was configured but opentelemetry-sdk is not installed "
                                 f"({e.name or e}); {INSTALL_HINT}") from None
    return dict(Resource=Resource, TracerProvider=TracerProvider, BatchSpanProcessor=BatchSpanProcessor,
                SpanExporter=SpanExporter, SpanExportResult=SpanExportResult, IdGenerator=IdGenerator,
                RandomIdGenerator=RandomIdGenerator, NonRecordingSpan=NonRecordingSpan, SpanContext=SpanContext,
                SpanKind=SpanKind, Status=Status, StatusCode=StatusCode, TraceFlags=TraceFlags,
                set_span_in_context=set_span_in_context)


def _otlp_exporter(endpoint: str | None) -> Any:
    """The OTLP span exporter for ``endpoint`` (None: the SDK reads the OTEL_EXPORTER_OTLP_* variables)."""
    proto = next((os.environ[k].strip().lower() for k in PROTOCOL_ENVS if os.environ.get(k, "").strip()),
                 "http/protobuf")
    if proto == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
        except ImportError:
            raise TracingConfigError("OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs opentelemetry-exporter-otlp-proto-grpc "
                                     "(pip install opentelemetry-exporter-otlp-proto-grpc)") from None
        return Grpc(endpoint=endpoint) if endpoint else Grpc()
    if proto != "http/protobuf":
        raise TracingConfigError(f"OTLP protocol {proto!r} is not supported (use http/protobuf or grpc)")
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http
    except ImportError:
        raise TracingConfigError(f"OTLP export was configured but opentelemetry-exporter-otlp-proto-http is not "
                                 f"installed; {INSTALL_HINT}") from None
    return Http(endpoint=traces_url(endpoint)) if endpoint else Http()


def otlp_json(spans: Sequence[Any]) -> dict[str, Any]:
    """OTLP/JSON (an ExportTraceServiceRequest, ids as hex as the specification asks) of SDK spans."""
    try:
        from google.protobuf.json_format import MessageToDict
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    except ImportError:
        raise TracingConfigError(f"--otel-file needs opentelemetry-exporter-otlp-proto-common; {INSTALL_HINT}") \
            from None
    import base64

    d = MessageToDict(encode_spans(spans))
    for rs in d.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for sp in ss.get("spans", []):
                for k in ("traceId", "spanId", "parentSpanId"):
                    if sp.get(k):
                        sp[k] = base64.b64decode(sp[k]).hex()
    return d


def _file_exporter(sdk: dict[str, Any], path: Path) -> Any:
    class OTLPJsonLinesExporter(sdk["SpanExporter"]):  # type: ignore[misc]
        """One OTLP/JSON ExportTraceServiceRequest per line (the collector's file exporter format)."""

        def __init__(self) -> None:
            self._lock = threading.Lock()

        def export(self, spans: Sequence[Any]) -> Any:
            line = json.dumps(otlp_json(spans), separators=(",", ":")) + "\n"
            try:
                with self._lock, open(path, "a") as f:
                    f.write(line)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError:
                return sdk["SpanExportResult"].FAILURE
            return sdk["SpanExportResult"].SUCCESS

        def shutdown(self) -> None:
            pass

    return OTLPJsonLinesExporter()


def tracing_requested(endpoint: str | None, file: str | None, environ: Mapping[str, str] | None = None) -> bool:
    """True when an endpoint or file is given, or an OTLP endpoint variable is set (and OTel is not disabled)."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(endpoint or file or env.get(ENDPOINT_ENV, "").strip() or env.get(TRACES_ENDPOINT_ENV, "").strip())


class RunTracer:
    """Turns the orchestrator's event records into spans of the run's trace (see the module docstring)."""

    def __init__(self, run_id: str, endpoint: str | None = None, file: str | os.PathLike | None = None) -> None:
        sdk = self._sdk = _import_sdk()
        self.run_id = run_id
        self.trace_id, self.root_span_id = run_trace_ids(run_id)
        exporters = []
        if endpoint or not file:  # an explicit endpoint, or the OTEL_EXPORTER_OTLP_* variables
            exporters.append(_otlp_exporter(endpoint))
        if file:
            p = Path(file)
            if p.parent and not p.parent.is_dir():
                raise TracingConfigError(f"--otel-file {str(file)!r}: directory {str(p.parent)!r} does not exist")
            exporters.append(_file_exporter(sdk, p))
        tracer_self = self

        class _RunIds(sdk["IdGenerator"]):  # type: ignore[misc]
            """The run's trace id for every span; the root span's id when asked for it."""

            def __init__(self) -> None:
                self._random = sdk["RandomIdGenerator"]()

            def generate_trace_id(self) -> int:
                return tracer_self.trace_id

            def generate_span_id(self) -> int:
                forced, tracer_self._forced_span_id = tracer_self._forced_span_id, None
                return forced if forced is not None else self._random.generate_span_id()

        self._forced_span_id: int | None = None
        attrs = {"blutrain.run_id": run_id}
        if not os.environ.get("OTEL_SERVICE_NAME"):
            attrs["service.name"] = SERVICE_NAME
        self.provider = sdk["TracerProvider"](resource=sdk["Resource"].create(attrs), id_generator=_RunIds())
        for ex in exporters:
            self.provider.add_span_processor(sdk["BatchSpanProcessor"](ex, schedule_delay_millis=1000))
        from dtms.__about__ import __version__

        self.tracer = self.provider.get_tracer("dtms.orchestrator", __version__)
        root = sdk["SpanContext"](self.trace_id, self.root_span_id, is_remote=False,
                                  trace_flags=sdk["TraceFlags"](sdk["TraceFlags"].SAMPLED))
        self._root_ctx = sdk["set_span_in_context"](sdk["NonRecordingSpan"](root))
        self._attempts: dict[int, Any] = {}
        self._recovery: Any = None
        self._launcher_exit: dict[int, int | None] = {}

    # ------------------------------------------------------------------ spans
    def _span(self, name: str, start: float | None, parent: Any, attrs: Mapping[str, Any]) -> Any:
        return self.tracer.start_span(name, context=parent, kind=self._sdk["SpanKind"].INTERNAL,
                                      attributes=_attrs({"blutrain.run_id": self.run_id, **attrs}),
                                      start_time=_ns(start))

    def _error(self, span: Any, message: str) -> None:
        span.set_status(self._sdk["Status"](self._sdk["StatusCode"].ERROR, message[:500]))

    def on_event(self, rec: Mapping[str, Any], state: Any) -> None:
        """One ``events.jsonl`` record (``state``: the orchestrator's RunState after it)."""
        kind, t, attempt = rec.get("event"), rec.get("time"), rec.get("attempt")
        if kind == "attempt_start":
            self._attempts[attempt] = self._span("blutrain.attempt", t, self._root_ctx, {
                "blutrain.attempt": attempt, "blutrain.nproc": rec.get("nproc"), "blutrain.launcher_pid":
                rec.get("pid"), "blutrain.checkpoint_step": state.last_good_step, "blutrain.restarts": state.restarts})
        elif kind == "attempt_teardown":
            self._launcher_exit[attempt] = rec.get("launcher_exit")
        elif kind == "incident":
            self._fault(rec, state)
        elif kind == "first_step":
            self._end_recovery(t, True, rec.get("step"))
        elif kind == "attempt_end":
            span = self._attempts.pop(attempt, None)
            if span is not None:
                span.set_attributes(_attrs({
                    "blutrain.outcome": rec.get("outcome"), "blutrain.resume_step": rec.get("resume_step"),
                    "blutrain.reached_step": rec.get("reached_step"), "blutrain.progress": rec.get("progress"),
                    "blutrain.exit_code": self._launcher_exit.get(attempt)}))
                if rec.get("outcome") == "fault":
                    self._error(span, "the attempt ended in a fault")
                span.end(end_time=_ns(t))
            self._end_recovery(t, False, None)
        elif kind == "restart":
            self._recovery = self._span("blutrain.recovery", t, self._root_ctx, {
                "blutrain.restarts": rec.get("restarts"), "blutrain.after_fault": rec.get("after"),
                "blutrain.checkpoint_step": rec.get("last_good_step"), "blutrain.from_attempt": attempt})
        elif kind == "final":
            self._end_recovery(t, False, None)
            if state.status in ("SUCCEEDED", "FAILED", "GAVE_UP"):
                self._root(rec, state)

    def _fault(self, rec: Mapping[str, Any], state: Any) -> None:
        d = rec.get("details") or {}
        attempt = rec.get("attempt")
        exit_code = _exit_code(d.get("exit"))
        if exit_code is None:
            exit_code = self._launcher_exit.get(attempt)
        parent = self._attempts.get(attempt)
        ctx = self._sdk["set_span_in_context"](parent) if parent is not None else self._root_ctx
        fault = rec.get("fault")
        span = self._span("blutrain.fault", rec.get("time"), ctx, {
            "blutrain.fault.class": fault, "blutrain.rank": rec.get("rank"), "blutrain.attempt": attempt,
            "blutrain.step": rec.get("step"), "blutrain.checkpoint_step": rec.get("checkpoint_step",
                                                                                  state.last_good_step),
            "blutrain.exit_code": exit_code, "blutrain.detected_by": rec.get("detected_by"),
            "blutrain.fatal": d.get("fatal"), "blutrain.message": str(rec.get("message", ""))[:1000],
            "exception.type": d.get("type")})
        if fault not in ("PREEMPTED", "STRAGGLER"):
            self._error(span, f"{fault}: {rec.get('message', '')}")
        span.end(end_time=max(_ns(None), _ns(rec.get("time"))))  # reported -> recorded by the orchestrator

    def _end_recovery(self, t: float | None, recovered: bool, step: int | None) -> None:
        span, self._recovery = self._recovery, None
        if span is None:
            return
        span.set_attributes(_attrs({"blutrain.recovered": recovered, "blutrain.first_step": step}))
        if not recovered:
            self._error(span, "the restarted attempt completed no step")
        span.end(end_time=_ns(t))

    def _root(self, rec: Mapping[str, Any], state: Any) -> None:
        self._forced_span_id = self.root_span_id
        from opentelemetry.context import Context

        span = self.tracer.start_span(
            "blutrain.run", context=Context(), kind=self._sdk["SpanKind"].INTERNAL,
            start_time=_ns(state.started or rec.get("time")),
            attributes=_attrs({"blutrain.run_id": self.run_id, "blutrain.status": state.status,
                               "blutrain.exit_code": state.exit_code, "blutrain.exit_name": rec.get("exit_name"),
                               "blutrain.reason": state.reason, "blutrain.attempts": state.attempt + 1,
                               "blutrain.restarts": state.restarts, "blutrain.incidents": len(state.incidents),
                               "blutrain.checkpoint_step": state.last_good_step,
                               "blutrain.best_step": state.best_step}))
        self._forced_span_id = None
        if state.exit_code:
            self._error(span, state.reason)
        span.end(end_time=_ns(rec.get("time")))

    def shutdown(self) -> None:
        """End spans still open (the orchestrator is leaving), export everything, stop the exporters."""
        now = time.time()
        for span in self._attempts.values():
            span.set_attributes({"blutrain.outcome": "orchestrator-exit"})
            span.end(end_time=_ns(now))
        self._attempts.clear()
        self._end_recovery(now, False, None)
        self.provider.force_flush(10_000)
        self.provider.shutdown()


def make_tracer(run_id: str, endpoint: str | None, file: str | None) -> RunTracer | None:
    """A RunTracer when tracing is configured (flags or environment), else None; TracingConfigError when it
    is configured but cannot work."""
    if not tracing_requested(endpoint, file):
        return None
    if endpoint:
        traces_url(endpoint)
    return RunTracer(run_id, endpoint, file)


__all__ = ["RunTracer", "TracingConfigError", "make_tracer", "otlp_json", "run_trace_ids", "traces_url",
           "tracing_requested"]
