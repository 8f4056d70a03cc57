"""`blutrain profile` on 2 CPU ranks (mpiexec): DDP, FSDP, TP and CP runs write one folder per rank whose table,
summary and trace hold the run's collectives (CP's ring exchange as point-to-point send/recv)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from models_helpers import micro_data
from test_cli import MICRO

pytest.importorskip("bluprofiler")
from dtms.mpi import find_mpiexec, mpi4py_available, mpiexec_command, mpiexec_env  # noqa: E402

pytestmark = pytest.mark.skipif(find_mpiexec() is None or not mpi4py_available(),
                                reason="needs mpiexec and mpi4py (pip install dtms[mpi])")


@pytest.mark.parametrize("strategy,ops", [("ddp", {"all_reduce"}), ("fsdp", {"all_gather", "reduce_scatter"}),
                                          ("tp", {"all_reduce"}), ("cp", {"send", "recv"})])
def test_profile_on_two_ranks_shows_collectives(tmp_path, strategy, ops):
    out = tmp_path / "prof"
    blutrain = shutil.which("blutrain", path=str(Path(sys.executable).parent))
    assert blutrain, "the blutrain entry point is not installed next to this Python"
    extra = {"ddp": [], "fsdp": ["parallel.fsdp=2"], "tp": ["parallel.tp=2"], "cp": ["parallel.cp=2"]}[strategy]
    args = ["profile", "--preset", "tiny", "--device", "cpu", "--steps", "1", "--out", str(out), "--data",
            str(micro_data()), "--no-memory", *MICRO, "train.batch_tokens=256", "train.world_size=2", *extra]
    p = subprocess.run(mpiexec_command(2, [sys.executable, blutrain, *args]), env=mpiexec_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("collectives:") == 1  # rank 0 prints its table
    for r in (0, 1):
        d = out / "profile" / f"rank{r}"
        s = json.loads((d / "summary.json").read_text())
        assert {row["op"] for row in s["collectives"]} >= ops
        assert all(row["group"] == [0, 1] and row["bytes"] > 0 for row in s["collectives"] if row["op"] in ops)
        trace = json.loads((d / "trace.json").read_text())["traceEvents"]
        assert {e["name"] for e in trace if e.get("cat") == "collective"} >= ops
