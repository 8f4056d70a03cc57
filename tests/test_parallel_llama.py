"""The llama family's parallel plan on 2 CPU processes gives the single-process result: 6 per-step losses and
global gradient norms (fp64 within 1e-10) under tensor parallelism (tied and untied embeddings) and FSDP (the
Trainer's tp/cp/fsdp runs of the family: tests/test_parallel_trainer.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from dtms.mpi import find_mpiexec, mpiexec_command, mpiexec_env

WORKER = Path(__file__).parent / "workers" / "parallel_llama_worker.py"
pytestmark = pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec (pip install dtms[mpi])")


@pytest.mark.parametrize("strategy,dp,tp,tie", [("tp", 1, 2, 1), ("tp", 1, 2, 0), ("fsdp", 2, 1, 1)])
def test_llama_strategy_equals_single_process(tmp_path, strategy, dp, tp, tie):
    out = tmp_path / "r.json"
    cmd = mpiexec_command(dp * tp, [sys.executable, str(WORKER), strategy, "float64", str(dp), str(tp), str(tie),
                                    str(out)])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=mpiexec_env())
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    r = json.loads(out.read_text())
    for key in ("losses", "norms"):
        for a, b in zip(r[key], r[f"ref_{key}"]):
            assert abs(a - b) <= 1e-10 * max(1.0, abs(b)), (key, r[key], r[f"ref_{key}"])
    assert max(r["ref_norms"]) > CLIP_SEEN
    assert r["heads"] == [[4 // tp, 2 // tp]] * 2


CLIP_SEEN = 0.5  # the clipping bound of the worker: the norms above it show clipping scaled the updates

