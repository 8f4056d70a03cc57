"""Orchestrator pieces in one process: fault taxonomy, persisted state, Prometheus exposition and
endpoint, NVML telemetry absent on CPU, the worker agent against a real store, stack collection."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from dtms.orchestrator import (
    CheckpointLoadError,
    FaultClass,
    Metrics,
    MetricsServer,
    NonFiniteError,
    RunState,
    WorkerAgent,
    classify_exception,
    gpu_telemetry,
)
from dtms.orchestrator.stacks import collect_stacks, process_state, stack_file
from dtms.orchestrator.worker import key_prefix
from dtms.store import TCPStore


class OutOfMemoryError(Exception):  # the name CuPy gives its allocation failure
    pass


@pytest.mark.parametrize("exc,cls", [
    (MemoryError("x"), FaultClass.OOM),
    (OutOfMemoryError("Out of memory allocating 1,024 bytes"), FaultClass.OOM),
    (RuntimeError("cudaErrorMemoryAllocation: out of memory"), FaultClass.OOM),
    (NonFiniteError("loss"), FaultClass.NAN_INF),
    (FloatingPointError("overflow"), FaultClass.NAN_INF),
    (CheckpointLoadError("bad"), FaultClass.CHECKPOINT_CORRUPT),
    (TimeoutError("allreduce"), FaultClass.COLLECTIVE_TIMEOUT),
    (ValueError("plain"), FaultClass.EXCEPTION),
])
def test_classify_exception(exc, cls):
    assert classify_exception(exc) is cls


def test_classify_follows_cause_chain():
    try:
        try:
            raise MemoryError("host")
        except MemoryError as e:
            raise RuntimeError("step failed") from e
    except RuntimeError as e:
        assert classify_exception(e) is FaultClass.OOM


def test_state_roundtrip_atomic_and_clear_errors(tmp_path):
    s = RunState("r1", attempt=2, restarts=1, last_good_step=6)
    s.incidents.append({"fault": "RANK_DEAD", "rank": 1})
    s.save(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["orchestrator_state.json"]  # no temp file left
    t = RunState.load(tmp_path)
    assert t.attempt == 2 and t.restarts == 1 and t.last_good_step == 6 and t.incidents == s.incidents
    assert RunState.load(tmp_path / "nowhere") is None
    (tmp_path / "orchestrator_state.json").write_text("{trunc")
    with pytest.raises(ValueError, match="orchestrator_state.json is unreadable"):
        RunState.load(tmp_path)


def test_metrics_exposition_and_endpoint():
    m = Metrics()
    m.declare("step", "gauge", "Step")
    m.declare("incidents_total", "counter", "Incidents")
    m.set("step", 12)
    m.inc("incidents_total", fault="RANK_DEAD")
    m.inc("incidents_total", fault="RANK_DEAD")
    m.inc("incidents_total", fault='we"ird')
    text = m.render()
    assert "# TYPE blutrain_step gauge\nblutrain_step 12\n" in text
    assert 'blutrain_incidents_total{fault="RANK_DEAD"} 2' in text
    assert 'blutrain_incidents_total{fault="we\\"ird"} 1' in text
    with pytest.raises(KeyError):
        m.set("undeclared", 1)
    srv = MetricsServer(m, port=0)
    try:
        assert srv.host == "127.0.0.1"
        with urllib.request.urlopen(srv.url, timeout=5) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert "blutrain_step 12" in r.read().decode()
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(srv.url.replace("/metrics", "/other"), timeout=5)
    finally:
        srv.close()


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="a GPU driver is present")
def test_gpu_telemetry_absent_on_cpu():
    assert gpu_telemetry() == [] and gpu_telemetry(0) == []


@pytest.fixture
def store():
    s = TCPStore("127.0.0.1", 0, is_server=True, secret="s3cret", timeout=10.0)
    yield s
    s.close()


def _agent(store, tmp_path, rank, world=2):
    os.environ["BLUTRAIN_STORE_SECRET"] = "s3cret"
    return WorkerAgent(rank, world, "127.0.0.1", store.port, "run", 0, str(tmp_path), interval=0.05)


def test_agent_heartbeats_resume_agreement_and_faults(store, tmp_path, monkeypatch):
    monkeypatch.setenv("BLUTRAIN_STORE_SECRET", "s3cret")
    prev = signal.getsignal(signal.SIGTERM)
    a0, a1 = _agent(store, tmp_path, 0), _agent(store, tmp_path, 1)
    try:
        a0.start()
        pre = key_prefix("run", 0)
        hb = json.loads(store.local_items(pre + "hb/0")[pre + "hb/0"])
        assert hb["pid"] == os.getpid() and hb["step"] is None
        a0.step_done(3, loss=1.5)
        time.sleep(0.3)
        hb = json.loads(store.local_items(pre + "hb/0")[pre + "hb/0"])
        assert hb["step"] == 3 and hb["loss"] == 1.5 and hb["n"] >= 2
        # resume agreement: newest step both ranks verified
        res = {}
        t = threading.Thread(target=lambda: res.setdefault(1, a1.agree_resume_step([3, 6])))
        t.start()
        res[0] = a0.agree_resume_step([3, 6, 9])
        t.join(5)
        assert res == {0: 6, 1: 6}
        # SIGTERM only raises the preemption flag
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert a0.preempt_requested and not a1.preempt_requested
        # NaN policies
        assert a0.check_finite(1.0, 4) is True
        assert a0.check_finite(float("nan"), 4, "skip") is False
        nan = json.loads(store.local_items(pre + "nan/0/4")[pre + "nan/0/4"])
        assert nan["fault"] == "NAN_INF" and nan["details"]["policy"] == "skip"
        with pytest.raises(NonFiniteError) as ei:
            a0.check_finite(float("inf"), 5, "stop")
        assert ei.value.fatal is True
        with pytest.raises(ValueError, match="nan policy"):
            a0.check_finite(1.0, 5, "ignore")
        # guard: a classified fault report, then the exception goes on
        with pytest.raises(MemoryError), a1.guard():
            raise MemoryError("injected")
        f = json.loads(store.local_items(pre + "fault/1")[pre + "fault/1"])
        assert f["fault"] == "OOM" and f["rank"] == 1 and "MemoryError: injected" in f["message"]
        a0.finish("ok", 9)
        assert json.loads(store.local_items(pre + "done/0")[pre + "done/0"])["status"] == "ok"
    finally:
        signal.signal(signal.SIGTERM, prev)
        a0.close()
        a1.close()


DUMPER = """
import sys, time
from dtms.orchestrator.stacks import register_dump
register_dump(sys.argv[1])
print("ready", flush=True)
def waiting_here():
    while True:
        time.sleep(0.05)
waiting_here()
"""


def test_collect_stacks_of_running_and_stopped_ranks(tmp_path):
    procs = {}
    for r in (0, 1):
        p = subprocess.Popen([sys.executable, "-c", DUMPER, str(stack_file(tmp_path, 0, r))],
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        procs[r] = p
    try:
        time.sleep(0.3)  # both inside waiting_here()
        os.kill(procs[1].pid, signal.SIGSTOP)
        time.sleep(0.1)
        assert process_state(procs[1].pid) == "T"
        stacks = collect_stacks({r: p.pid for r, p in procs.items()}, tmp_path, 0, timeout=5)
        assert set(stacks) == {0, 1}
        for text in stacks.values():
            assert "waiting_here" in text and "most recent call first" in text
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    assert process_state(procs[0].pid) is None


def _monitor(tmp_path, n=2):
    from dtms.orchestrator.orchestrator import Orchestrator, OrchestratorConfig, _Attempt

    o = Orchestrator(OrchestratorConfig("x.py", run_dir=str(tmp_path), nproc_per_node=n, heartbeat_timeout=2,
                                        progress_timeout=5, startup_timeout=30, quiet=True))
    return o, _Attempt(0)


def test_hang_classification(tmp_path):
    """Which class a stall gets: launch failure, silent rank, rank stuck outside / all inside collectives."""
    o, att = _monitor(tmp_path)
    now = 100.0
    att.hb = {0: {"pid": 1, "step": None, "phase": "startup"}}
    att.hb_seen = {0: (1, now)}
    assert o._hang(att, now, t0=now - 10) is None  # rank 1 still starting
    inc = o._hang(att, now, t0=now - 31)
    assert inc.fault is FaultClass.LAUNCH_FAILED and inc.rank == 1
    att.hb[1] = {"pid": 2, "step": 4, "phase": "collective"}
    att.hb[0].update(step=4, phase="collective")
    att.hb_seen = {0: (9, now), 1: (3, now - 2.5)}
    inc = o._hang(att, now, t0=0)
    assert inc.fault is FaultClass.RANK_HUNG and inc.rank == 1 and "no heartbeat from rank 1" in inc.message
    att.hb_seen = {0: (9, now), 1: (9, now)}
    att.reached, att.last_progress = 4, now - 1
    assert o._hang(att, now, t0=0) is None
    att.last_progress = now - 6
    inc = o._hang(att, now, t0=0)
    assert inc.fault is FaultClass.COLLECTIVE_TIMEOUT and "no step progress" in inc.message
    att.hb[1]["phase"] = "train"
    inc = o._hang(att, now, t0=0)
    assert inc.fault is FaultClass.RANK_HUNG and inc.rank == 1 and inc.details["phases"] == {0: "collective",
                                                                                              1: "train"}


def test_blurun_switches_to_orchestrator_mode_on_its_flags():
    from dtms.orchestrate import orchestrator_requested

    assert orchestrator_requested(["--nproc-per-node", "2", "--max-restarts", "3", "train.py"])
    assert orchestrator_requested(["--run-dir=r", "train.py", "--x"])
    assert not orchestrator_requested(["--nproc-per-node", "2", "train.py", "--run-dir", "r"])  # script's own
    assert not orchestrator_requested(["train.py"])


def test_rank_without_report_classified_by_exit():
    from dtms.orchestrator.orchestrator import _dead_class

    assert _dead_class("rank 1 failed (killed by signal 9 (SIGKILL)); the other ranks were stopped") \
        is FaultClass.RANK_DEAD
    assert _dead_class("rank 0 failed (exit code 1); the other ranks were stopped") is FaultClass.EXCEPTION
    assert _dead_class("see the launcher log") is FaultClass.RANK_DEAD


def _gpu_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001
        return 0


needs_gpu = pytest.mark.skipif(_gpu_count() == 0, reason="needs CuPy and a CUDA GPU")


@pytest.mark.cuda
@needs_gpu
def test_gpu_telemetry_reads_every_visible_gpu():
    """NVML (or CuPy alone) gives a reading with the memory in use for every GPU; one GPU on request."""
    tel = gpu_telemetry()
    assert len(tel) == _gpu_count()
    assert all(g["memory_used_bytes"] >= 0 for g in tel)
    one = gpu_telemetry(0)
    assert len(one) == 1 and "memory_used_bytes" in one[0]


def _orchestrated_toy(run, fault: list, scrape: bool) -> tuple[int, dict, list[str]]:
    """A 1-rank orchestrated toy job (direct launcher, local backend) with the metrics endpoint; the GPU gauge
    lines of its scraped metrics."""
    worker = os.path.join(os.path.dirname(__file__), "workers", "fault_toy.py")
    env = dict(os.environ, FAULT_SPEC=json.dumps(fault), BLUTRAIN_DIST_BACKEND="local", BLUTRAIN_DETERMINISTIC="1")
    cmd = [sys.executable, "-m", "dtms.orchestrate", "--run-dir", str(run), "--nproc-per-node", "1",
           "--heartbeat-interval", "0.1", "--heartbeat-timeout", "5", "--metrics-port", "0", "--quiet",
           worker, "--out", str(run / "job"), "--steps", "40", "--ckpt-every", "5", "--step-sleep", "0.05"]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    while p.poll() is None and scrape:
        try:
            url = json.loads((run / "metrics.json").read_text())["url"]
            text = urllib.request.urlopen(url, timeout=2).read().decode()
            lines = [ln for ln in text.splitlines() if ln.startswith("blutrain_gpu_")] or lines
        except Exception:  # noqa: BLE001 - the endpoint is not up yet, or already closed
            pass
        time.sleep(0.2)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-2000:]
    return p.returncode, json.loads((run / "orchestrator_state.json").read_text()), lines


@pytest.mark.cuda
@needs_gpu
def test_orchestrated_job_on_a_gpu_machine_exports_gpu_gauges_and_restarts_bit_exactly(tmp_path):
    """The metrics endpoint carries blutrain_gpu_* gauges; the same job with its rank killed at step 8 restarts
    once and ends with the clean run's final weights (CPU twin: test_fault_injection's kill cases)."""
    import numpy as np

    _, _, lines = _orchestrated_toy(tmp_path / "clean", [], scrape=True)
    assert lines, "no blutrain_gpu_* gauge in the scraped metrics"
    _, state, _ = _orchestrated_toy(tmp_path / "killed", [{"kind": "kill", "rank": 0, "step": 8}], scrape=False)
    assert state["restarts"] == 1
    np.testing.assert_array_equal(np.load(tmp_path / "clean" / "job" / "final.rank0.npy"),
                                  np.load(tmp_path / "killed" / "job" / "final.rank0.npy"))
