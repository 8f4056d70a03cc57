"""Fault injection through the orchestrator on 2 CPU ranks (mpiexec) running a toy data-parallel job
(NumPy + dtms all-reduce, per-rank checkpoints): an exception on one rank ends every rank; an OOM is
classified and recovered bit-exactly; NaN policies stop / skip / restart; the restart budget and the
no-progress limit end the run with their own exit codes; a rank stuck in Python is found by the progress
timeout with stacks; a relaunch right after the orchestrator is killed finds no stale port or state;
the metrics endpoint serves the run's step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from dtms.mpi import find_mpiexec
from dtms.orchestrator import EXIT_BUDGET, EXIT_FATAL, EXIT_NO_PROGRESS
from dtms.orchestrator.stacks import alive

pytestmark = [pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec (pip install dtms[mpi])"),
              pytest.mark.mpi]
WORKER = Path(__file__).parent / "workers" / "fault_toy.py"
STEPS = 20
FAST = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "2", "--progress-timeout", "3",
        "--startup-timeout", "60", "--grace-period", "3"]


def cmd(run: Path, steps=STEPS, extra=(), worker=(), entry="dtms.orchestrate"):
    return [sys.executable, "-m", entry, "--run-dir", str(run), "--nproc-per-node", "2", *FAST,
            *extra, str(WORKER), "--out", str(run / "job"), "--steps", str(steps), "--ckpt-every", "5", *worker]


def orchestrate(run: Path, fault=None, steps=STEPS, extra=(), worker=(), timeout=120, entry="dtms.orchestrate"):
    env = dict(os.environ, FAULT_SPEC=json.dumps(fault or []))
    return subprocess.run(cmd(run, steps, extra, worker, entry), env=env, capture_output=True, text=True,
                          timeout=timeout)


def events(run: Path, kind: str | None = None) -> list[dict]:
    ev = [json.loads(ln) for ln in (run / "events.jsonl").read_text().splitlines()]
    return [e for e in ev if kind is None or e["event"] == kind]


def losses(run: Path, rank: int = 0) -> list[tuple[int, str]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "job" / f"losses.rank{rank}.jsonl")
                                                .read_text().splitlines())]


def rank_pids(run: Path) -> list[int]:
    return [p for e in events(run, "attempt_teardown") for p in e["rank_pids"].values()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("toyref")
    p = orchestrate(run)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [s for s, _ in losses(run)] == list(range(STEPS))
    return run


def assert_bit_exact(run: Path, ref: Path) -> None:
    for r in (0, 1):
        assert losses(run, r) == losses(ref, r)
        assert np.array_equal(np.load(run / "job" / f"final.rank{r}.npy"), np.load(ref / "job" / f"final.rank{r}.npy"))


def test_exception_on_one_rank_ends_every_rank(tmp_path):
    """(3) rank 1 raises at step 4, no restarts allowed: EXCEPTION (rank 1, traceback) and exit 71;
    both ranks are gone and nothing hung."""
    t0 = time.monotonic()
    p = orchestrate(tmp_path, [{"kind": "raise", "rank": 1, "step": 4}], extra=["--max-restarts", "0"])
    assert p.returncode == EXIT_BUDGET, p.stderr[-3000:]
    assert time.monotonic() - t0 < 30
    (inc,) = events(tmp_path, "incident")
    assert inc["fault"] == "EXCEPTION" and inc["rank"] == 1 and inc["detected_by"] == "worker"
    assert "RuntimeError: injected failure at step 4" in inc["message"]
    assert "fault_toy.py" in inc["details"]["traceback"]
    pids = rank_pids(tmp_path)
    assert len(pids) == 2 and not any(alive(pid) for pid in pids)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exit_name"] == "restart-budget-exhausted" and summary["incidents"]


def test_oom_is_classified_and_recovered_bit_exact(tmp_path, reference):
    p = orchestrate(tmp_path, [{"kind": "oom", "rank": 0, "step": 8}])
    assert p.returncode == 0, p.stderr[-3000:]
    (inc,) = events(tmp_path, "incident")
    assert inc["fault"] == "OOM" and inc["rank"] == 0
    assert events(tmp_path, "attempt_end")[1]["resume_step"] == 5
    assert_bit_exact(tmp_path, reference)


def test_nan_policy_stop_is_fatal(tmp_path):
    """(7) policy 'stop': NAN_INF, no restart, exit 70. Started as ``blurun --run-dir ...`` (orchestrator mode)."""
    p = orchestrate(tmp_path, [{"kind": "nan", "rank": 1, "step": 6}], worker=["--nan-policy", "stop"],
                    entry="dtms.run")
    assert p.returncode == EXIT_FATAL, p.stderr[-3000:]
    inc = events(tmp_path, "incident")[0]
    assert inc["fault"] == "NAN_INF" and "non-finite gradient norm" in inc["message"]
    state = json.loads((tmp_path / "orchestrator_state.json").read_text())
    assert state["status"] == "FAILED" and state["restarts"] == 0


def test_nan_policy_skip_drops_the_update(tmp_path, reference):
    """(7) policy 'skip': the step's update is dropped on every rank, one NAN_INF incident per rank, the
    run finishes; the steps before are unchanged."""
    p = orchestrate(tmp_path, [{"kind": "nan", "rank": 1, "step": 6}], worker=["--nan-policy", "skip"])
    assert p.returncode == 0, p.stderr[-3000:]
    inc = events(tmp_path, "incident")
    assert sorted(i["rank"] for i in inc) == [0, 1] and {i["fault"] for i in inc} == {"NAN_INF"}
    got, ref = losses(tmp_path), losses(reference)
    assert got[:6] == ref[:6] and np.isnan(float.fromhex(got[6][1])) and got[7:] != ref[7:]
    assert all(np.isfinite(float.fromhex(v)) for _, v in got[7:])


def test_nan_policy_restart_recovers_bit_exact(tmp_path, reference):
    """(7) policy 'restart': a transient NaN restarts the gang from the last good checkpoint."""
    p = orchestrate(tmp_path, [{"kind": "nan", "rank": 0, "step": 12}], worker=["--nan-policy", "restart"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert [i["fault"] for i in events(tmp_path, "incident")][0] == "NAN_INF"
    assert_bit_exact(tmp_path, reference)


def test_restart_budget_exhausted(tmp_path):
    """A new fault on every attempt, each after some progress: stops after --max-restarts with 71."""
    fault = [{"kind": "raise", "rank": 0, "step": s, "attempt": a} for a, s in ((0, 3), (1, 7))]
    p = orchestrate(tmp_path, fault, extra=["--max-restarts", "1", "--max-no-progress", "5"])
    assert p.returncode == EXIT_BUDGET, p.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["attempts"] == 2 and s["restarts"] == 1 and "restart budget of 1 spent" in s["reason"]


def test_no_progress_exit_code(tmp_path):
    """The same fault at the same step each attempt: no new step, exit 72 after --max-no-progress."""
    fault = [{"kind": "raise", "rank": 1, "step": 7, "attempt": a} for a in range(5)]
    p = orchestrate(tmp_path, fault, extra=["--max-restarts", "9", "--max-no-progress", "0"])
    assert p.returncode == EXIT_NO_PROGRESS, p.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    # the step an attempt "reached" is the last one every rank reported before the fault; a rank that dies within
    # milliseconds of finishing step 7 may not have reported it yet, so attempt 1 can count as reaching 6 and
    # attempt 2 (reaching 7) as progress: 2 or 3 attempts, never more (seen on an idle CI machine)
    assert s["attempts"] in (2, 3) and s["status"] == "GAVE_UP" and s["exit_name"] == "no-progress", s


@pytest.mark.slow
def test_rank_stuck_in_python_found_by_progress_timeout(tmp_path, reference):
    """(2, progress path) rank 1 loops forever with its heartbeat alive: RANK_HUNG by the progress
    timeout (the other rank waits in its collective), stacks show where, then a bit-exact restart."""
    p = orchestrate(tmp_path, [{"kind": "python_hang", "rank": 1, "step": 9}])
    assert p.returncode == 0, p.stderr[-3000:]
    inc = events(tmp_path, "incident")[0]
    assert inc["fault"] == "RANK_HUNG" and inc["rank"] == 1 and "no step progress" in inc["message"]
    assert inc["details"]["phases"] == {"0": "collective", "1": "train"}
    assert "fault_toy.py" in Path(inc["details"]["stacks"]["1"]).read_text()
    assert_bit_exact(tmp_path, reference)


def test_collective_hang_is_a_collective_timeout(tmp_path):
    """Every live rank inside a collective and no progress: COLLECTIVE_TIMEOUT with stacks of both."""
    p = orchestrate(tmp_path, [{"kind": "collective_hang", "rank": 0, "step": 5}], extra=["--max-restarts", "0"])
    assert p.returncode == EXIT_BUDGET, p.stderr[-3000:]
    (inc,) = events(tmp_path, "incident")
    assert inc["fault"] == "COLLECTIVE_TIMEOUT" and inc["details"]["phases"] == {"0": "collective",
                                                                                 "1": "collective"}
    assert set(inc["details"]["stacks"]) == {"0", "1"}
    assert not any(alive(pid) for pid in rank_pids(tmp_path))


def test_launcher_refusal_is_fatal(tmp_path):
    """blurun cannot start the gang (script missing): LAUNCH_FAILED, no restarts, exit 70."""
    p = subprocess.run([sys.executable, "-m", "dtms.orchestrate", "--run-dir", str(tmp_path), "--quiet",
                        str(tmp_path / "missing.py")], capture_output=True, text=True, timeout=60)
    assert p.returncode == EXIT_FATAL, p.stderr[-3000:]
    (inc,) = events(tmp_path, "incident")
    assert inc["fault"] == "LAUNCH_FAILED" and "missing.py" in inc["message"]


@pytest.mark.slow
def test_relaunch_right_after_orchestrator_kill(tmp_path):
    """(9) SIGKILL the orchestrator mid-run and relaunch at once on the same run dir: the old gang is
    gone, a fresh store and attempt keys are used, and the run ends as an uninterrupted one does. The
    metrics endpoint (loopback) serves the step while it runs."""
    steps = 60
    ref = tmp_path / "ref"
    assert orchestrate(ref, steps=steps, worker=["--step-sleep", "0.01"]).returncode == 0
    run = tmp_path / "run"
    env = dict(os.environ, FAULT_SPEC="[]")
    first = subprocess.Popen(cmd(run, steps, ["--metrics-port", "0"], ["--step-sleep", "0.05"]), env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = run / "job" / "losses.rank0.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 15):
        time.sleep(0.05)
    url = json.loads((run / "metrics.json").read_text())["url"]
    assert url.startswith("http://127.0.0.1:")
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    assert "blutrain_step " in text and "blutrain_restarts_total 0" in text
    live = json.loads((run / "orchestrator_state.json").read_text())["live"]
    old = [int(p) for p in live["ranks"].values()]
    assert len(old) == 2
    first.send_signal(signal.SIGKILL)
    first.wait()
    p = subprocess.run(cmd(run, steps, (), ["--step-sleep", "0.01"]), env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not any(alive(pid) for pid in old)
    state = json.loads((run / "orchestrator_state.json").read_text())
    assert state["status"] == "SUCCEEDED" and state["attempt"] >= 1
    assert_bit_exact(run, ref)
