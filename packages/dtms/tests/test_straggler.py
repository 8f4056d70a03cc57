"""Straggler detection: the detector's rule on recorded step times, and 2 CPU ranks under the orchestrator
where one rank computes longer every step (the other waits for it in the all-reduce)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dtms.mpi import find_mpiexec
from dtms.orchestrator.faults import FaultClass
from dtms.orchestrator.straggler import StragglerDetector

WORKER = Path(__file__).parent / "workers" / "fault_toy.py"


def test_detector_reports_a_rank_over_the_margin_for_n_steps_once():
    d = StragglerDetector(margin=0.2, steps=3)
    seen = []
    for step in range(1, 8):
        slow = 1.5 if step != 2 else 1.0  # rank 2 is slow except at step 2 (the count restarts there)
        seen += [(step, r.rank) for r in d.observe(step, {0: 1.0, 1: 1.1, 2: slow, 3: 0.9})]
    assert seen == [(5, 2)]  # steps 3, 4, 5 in a row; reported once
    assert d.flagged == {2}
    # within the margin (median of {1.0, 1.1, 1.15, 0.9} = 1.05; 1.15 < 1.2 * 1.05): never
    d = StragglerDetector(margin=0.2, steps=1)
    assert d.observe(1, {0: 1.0, 1: 1.1, 2: 1.15, 3: 0.9}) == []
    r = StragglerDetector(margin=0.2, steps=1).observe(9, {0: 1.0, 1: 3.0, 2: 1.0})[0]
    assert (r.rank, r.step, r.median_s, r.ratio) == (1, 9, 1.0, 3.0)
    # recovered, then slow again: reported again
    d = StragglerDetector(margin=0.2, steps=1)
    slow, fine = {0: 1.0, 1: 2.0, 2: 1.0}, {0: 1.0, 1: 1.0, 2: 1.0}
    assert [len(d.observe(i, x)) for i, x in enumerate([slow, slow, fine, slow])] == [1, 0, 0, 1]
    assert StragglerDetector(margin=0.2, steps=1).observe(1, {0: 1.0}) == []  # one rank: nothing to compare


def test_detector_bad_settings_are_named():
    with pytest.raises(ValueError, match="margin must be > 0"):
        StragglerDetector(margin=0)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        StragglerDetector(steps=0)


@pytest.mark.mpi
@pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec (pip install dtms[mpi])")
def test_orchestrator_reports_the_slow_rank_as_straggler(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "dtms.orchestrate", "--run-dir", str(run), "--nproc-per-node", "2",
           "--heartbeat-interval", "0.1", "--startup-timeout", "60", "--quiet", "--straggler-margin", "0.5",
           "--straggler-steps", "3", str(WORKER), "--out", str(run / "job"), "--steps", "12", "--ckpt-every", "50",
           "--step-sleep", "0.01", "--slow-rank", "1", "--slow-s", "0.08"]
    p = subprocess.run(cmd, env=dict(os.environ, FAULT_SPEC="[]"), capture_output=True, text=True, timeout=90)
    assert p.returncode == 0, p.stdout + p.stderr
    ev = [json.loads(ln) for ln in (run / "events.jsonl").read_text().splitlines()]
    strag = [e for e in ev if e["event"] == "incident" and e["fault"] == FaultClass.STRAGGLER]
    assert [e["rank"] for e in strag] == [1], strag
    d = strag[0]["details"]
    # rank 1 computes ~90 ms a step, rank 0 ~10 ms (the rest of its wall time it waits in the all-reduce)
    assert d["busy_s"] > 1.5 * d["median_s"] and d["busy_s"] >= 0.08
    assert all(e["fault"] != FaultClass.STRAGGLER for e in ev if e["event"] == "incident" and e["rank"] == 0)
