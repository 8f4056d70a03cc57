"""Incidents and recoveries as OpenTelemetry traces: a 2-rank orchestrated job with an OOM that is recovered
exports one trace (id derived from the run id) to a loopback OTLP/HTTP collector, which parses the protobuf it
receives, and to an OTLP/JSON-lines file; the same spans reach both. In process: the span tree of a synthetic
run, a relaunch writing into the same trace, and clean one-line errors for a missing SDK or a bad endpoint."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from dtms.orchestrator import RunState
from dtms.orchestrator.tracing import RunTracer, TracingConfigError, make_tracer, run_trace_ids, traces_url

pytest.importorskip("opentelemetry.sdk.trace", reason="needs dtms[otel]")
trace_pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

WORKER = Path(__file__).parent / "workers" / "fault_toy.py"


def file_spans(path: Path) -> list[dict]:
    """Every span of an OTLP/JSON-lines file, attributes flattened."""
    out = []
    for line in path.read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            service = {a["key"]: a["value"] for a in rs["resource"]["attributes"]}["service.name"]
            for ss in rs["scopeSpans"]:
                for sp in ss["spans"]:
                    attrs = {}
                    for a in sp.get("attributes", []):
                        (kind, v), = a["value"].items()
                        attrs[a["key"]] = int(v) if kind == "intValue" else v  # int64 travels as a JSON string
                    out.append({"name": sp["name"], "trace": sp["traceId"], "id": sp["spanId"],
                                "parent": sp.get("parentSpanId", ""), "attrs": attrs, "service": service["stringValue"],
                                "start": int(sp["startTimeUnixNano"]), "end": int(sp["endTimeUnixNano"]),
                                "error": sp.get("status", {}).get("code") == "STATUS_CODE_ERROR"})
    return out


def proto_spans(bodies: list[bytes]) -> list[dict]:
    out = []
    for body in bodies:
        req = trace_pb2.ExportTraceServiceRequest()
        req.ParseFromString(body)
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    attrs = {}
                    for a in sp.attributes:
                        v = a.value
                        attrs[a.key] = getattr(v, v.WhichOneof("value"))
                    out.append({"name": sp.name, "trace": sp.trace_id.hex(), "id": sp.span_id.hex(),
                                "parent": sp.parent_span_id.hex(), "attrs": attrs,
                                "start": sp.start_time_unix_nano, "end": sp.end_time_unix_nano,
                                "error": sp.status.code == 2})
    return out


class Collector:
    """A loopback OTLP/HTTP receiver: keeps the protobuf bodies POSTed to /v1/traces."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.paths: list[str] = []
        owner = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                owner.paths.append(self.path)
                owner.bodies.append(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(trace_pb2.ExportTraceServiceResponse().SerializeToString())

            def log_message(self, *a: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _by_name(spans: list[dict], name: str) -> list[dict]:
    return sorted((s for s in spans if s["name"] == name), key=lambda s: s["start"])


def test_synthetic_run_span_tree_and_relaunch_same_trace(tmp_path):
    """attempt 0 (OOM at step 8, checkpoint 5) -> recovery -> attempt 1 ok; a second tracer of the same run
    (a relaunched orchestrator) writes into the same trace; the root span id is the run's."""
    f = tmp_path / "trace.jsonl"
    st = RunState("run-abc", started=1000.0)
    tr = RunTracer("run-abc", file=str(f))
    st.attempt = 0
    tr.on_event({"event": "attempt_start", "time": 1001.0, "attempt": 0, "nproc": 2, "pid": 11}, st)
    tr.on_event({"event": "first_step", "time": 1002.0, "attempt": 0, "step": 0}, st)
    tr.on_event({"event": "attempt_teardown", "time": 1004.0, "attempt": 0, "launcher_exit": 1}, st)
    tr.on_event({"event": "incident", "time": 1004.1, "attempt": 0, "fault": "OOM", "rank": 1, "step": 8,
                 "message": "MemoryError: x", "detected_by": "worker", "details": {"type": "MemoryError"},
                 "checkpoint_step": 5}, st)
    tr.on_event({"event": "attempt_end", "time": 1004.2, "attempt": 0, "outcome": "fault", "resume_step": None,
                 "reached_step": 7}, st)
    st.restarts, st.last_good_step = 1, 5
    tr.on_event({"event": "restart", "time": 1004.3, "attempt": 0, "restarts": 1, "after": "OOM",
                 "last_good_step": 5}, st)
    tr.shutdown()
    st.attempt = 1
    tr2 = RunTracer("run-abc", file=str(f))  # the relaunched orchestrator
    tr2.on_event({"event": "attempt_start", "time": 1005.0, "attempt": 1, "nproc": 2, "pid": 12}, st)
    tr2.on_event({"event": "attempt_teardown", "time": 1007.0, "attempt": 1, "launcher_exit": 0}, st)
    tr2.on_event({"event": "attempt_end", "time": 1007.1, "attempt": 1, "outcome": "ok", "resume_step": 5,
                  "reached_step": 19}, st)
    st.status, st.exit_code, st.reason, st.best_step = "SUCCEEDED", 0, "all ranks finished", 19
    tr2.on_event({"event": "final", "time": 1007.2, "attempt": 1, "exit_name": "ok"}, st)
    tr2.shutdown()

    spans = file_spans(f)
    trace_id, root_id = run_trace_ids("run-abc")
    assert {s["trace"] for s in spans} == {f"{trace_id:032x}"}
    assert {s["service"] for s in spans} == {"blutrain-orchestrator"}
    (root,) = _by_name(spans, "blutrain.run")
    assert root["id"] == f"{root_id:016x}" and root["parent"] == "" and not root["error"]
    assert root["start"] == 1000 * 10**9 and root["attrs"]["blutrain.restarts"] == 1
    a0, a1 = _by_name(spans, "blutrain.attempt")
    assert a0["parent"] == a1["parent"] == root["id"]
    assert a0["error"] and a0["attrs"]["blutrain.exit_code"] == 1 and a0["attrs"]["blutrain.outcome"] == "fault"
    assert not a1["error"] and a1["attrs"]["blutrain.resume_step"] == 5
    (fault,) = _by_name(spans, "blutrain.fault")
    assert fault["parent"] == a0["id"] and fault["error"]
    assert {k: fault["attrs"][k] for k in ("blutrain.fault.class", "blutrain.rank", "blutrain.step",
                                           "blutrain.checkpoint_step", "blutrain.exit_code")} == \
        {"blutrain.fault.class": "OOM", "blutrain.rank": 1, "blutrain.step": 8, "blutrain.checkpoint_step": 5,
         "blutrain.exit_code": 1}
    (rec,) = _by_name(spans, "blutrain.recovery")
    # the first tracer left before the restarted attempt ran: its recovery span ended unrecovered at exit
    assert rec["parent"] == root["id"] and rec["attrs"]["blutrain.after_fault"] == "OOM"
    assert rec["attrs"]["blutrain.recovered"] is False


def test_missing_sdk_is_one_line_error_before_any_rank(tmp_path):
    code = ("import sys; sys.modules['opentelemetry'] = None; sys.modules['opentelemetry.sdk'] = None\n"
            "from dtms.orchestrate import main\n"
            f"sys.exit(main(['--run-dir', {str(tmp_path / 'r')!r}, '--otel-file', {str(tmp_path / 't.jsonl')!r}, "
            f"{str(WORKER)!r}]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "opentelemetry-sdk is not installed" in lines[0] and "dtms[otel]" in lines[0]
    assert not (tmp_path / "r" / "logs").exists()


def test_bad_endpoint_and_env_config(monkeypatch, tmp_path):
    with pytest.raises(TracingConfigError, match="'ftp://x' is not an http"):
        make_tracer("r", "ftp://x", None)
    assert traces_url("http://h:4318") == "http://h:4318/v1/traces"
    assert traces_url("http://h:4318/v1/traces") == "http://h:4318/v1/traces"
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert make_tracer("r", None, None) is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(TracingConfigError, match="'http/json' is not supported"):
        make_tracer("r", None, None)
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert make_tracer("r", None, None) is None


@pytest.mark.mpi
def test_orchestrated_oom_recovery_trace_reaches_collector_and_file(tmp_path):
    from dtms.mpi import find_mpiexec

    if find_mpiexec() is None:
        pytest.skip("no mpiexec (pip install dtms[mpi])")
    col = Collector()
    run, tf = tmp_path / "run", tmp_path / "trace.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["FAULT_SPEC"] = json.dumps([{"kind": "oom", "rank": 0, "step": 8}])
    try:
        p = subprocess.run(
            [sys.executable, "-m", "dtms.orchestrate", "--run-dir", str(run), "--run-id", "otel-run",
             "--nproc-per-node", "2", "--heartbeat-interval", "0.2", "--heartbeat-timeout", "5",
             "--startup-timeout", "60", "--grace-period", "3", "--otel-endpoint", col.url, "--otel-file", str(tf),
             str(WORKER), "--out", str(run / "job"), "--steps", "12", "--ckpt-every", "5"],
            env=env, capture_output=True, text=True, timeout=120)
    finally:
        col.close()
    assert p.returncode == 0, p.stderr[-3000:]
    assert col.paths and set(col.paths) == {"/v1/traces"}
    got, from_file = proto_spans(col.bodies), file_spans(tf)
    key = lambda s: (s["name"], s["id"])  # noqa: E731
    assert sorted(map(key, got)) == sorted(map(key, from_file))  # the same spans reach both exporters
    trace_id, root_id = run_trace_ids("otel-run")
    assert {s["trace"] for s in got} == {f"{trace_id:032x}"}
    (root,) = _by_name(got, "blutrain.run")
    assert root["id"] == f"{root_id:016x}" and root["attrs"]["blutrain.status"] == "SUCCEEDED"
    a0, a1 = _by_name(got, "blutrain.attempt")
    assert a0["parent"] == a1["parent"] == root["id"]
    assert a0["attrs"]["blutrain.outcome"] == "fault" and a1["attrs"]["blutrain.outcome"] == "ok"
    assert a1["attrs"]["blutrain.resume_step"] == 5 and a1["attrs"]["blutrain.exit_code"] == 0
    (fault,) = _by_name(got, "blutrain.fault")
    assert fault["parent"] == a0["id"] and fault["error"]
    assert fault["attrs"]["blutrain.fault.class"] == "OOM" and fault["attrs"]["blutrain.rank"] == 0
    assert fault["attrs"]["blutrain.step"] == 8 and fault["attrs"]["blutrain.checkpoint_step"] == 5
    (rec,) = _by_name(got, "blutrain.recovery")
    assert rec["parent"] == root["id"] and rec["attrs"]["blutrain.recovered"] is True
    assert rec["attrs"]["blutrain.checkpoint_step"] == 5 and rec["attrs"]["blutrain.first_step"] >= 5
    assert a0["end"] <= rec["start"] <= rec["end"] and a1["start"] <= rec["end"] <= a1["end"]
    # the events.jsonl records and the trace tell the same story
    ev = [json.loads(ln) for ln in (run / "events.jsonl").read_text().splitlines()]
    (inc,) = [e for e in ev if e["event"] == "incident"]
    assert inc["fault"] == "OOM" and inc["checkpoint_step"] == 5
