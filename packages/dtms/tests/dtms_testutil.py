"""Helpers for dtms tests: run a worker under mpiexec, run blurun, with hard time limits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from dtms import CollectiveError, Work
from dtms.mpi import find_mpiexec, mpi4py_available, mpiexec_command, mpiexec_env

WORKERS = Path(__file__).parent / "workers"

needs_mpi = pytest.mark.skipif(
    find_mpiexec() is None or not mpi4py_available(), reason="needs mpiexec and mpi4py (pip install dtms[mpi])"
)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher variables (the test itself may run under one)."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "BLUTRAIN_RUN_ID", "BLUTRAIN_STORE_SECRET", "BLUTRAIN_STORE_HOSTED", "SLURM_PROCID")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_"))}
    env.update(extra)
    return env


def run_mpi(n: int, script: Path, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """``mpiexec -n n python script args`` with a time limit; raises with its output on failure."""
    cmd = mpiexec_command(n, [sys.executable, str(script), *args])
    p = subprocess.run(cmd, env=mpiexec_env(clean_env()), capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"mpiexec -n {n} {script.name} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def run_blurun(*args: str, timeout: float = 60.0, cwd: Path | None = None,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m dtms.run args`` (the blurun entry point) with a time limit."""
    return subprocess.run([sys.executable, "-m", "dtms.run", *args], env=env or clean_env(), capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


def pid_alive(pid: int) -> bool:
    """True when ``pid`` is a live process (zombies count as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class FakeTensor:
    """Stands in for a blutensor Tensor: collectives use its ``_data``."""

    def __init__(self, data):
        self._data = data


def world1_checks(pg, xp):
    """The assertions shared by the local backend (NumPy) and NCCL at world size 1 (CuPy)."""
    ref = np.arange(12, dtype=np.float32).reshape(3, 4)
    for op in ("sum", "avg", "max", "min", "prod"):
        x = xp.asarray(ref.copy())
        assert pg.all_reduce(x, op=op) is None
        np.testing.assert_array_equal(xp.asnumpy(x) if xp is not np else x, ref)
    out = xp.zeros(12, dtype=xp.float32)
    pg.all_gather(out, xp.asarray(ref))
    rs = xp.zeros(12, dtype=xp.float32)
    pg.reduce_scatter(rs, xp.asarray(ref.reshape(-1)), op="avg")
    a2a = xp.zeros((3, 4), dtype=xp.float32)
    pg.all_to_all(a2a, xp.asarray(ref))
    b = xp.asarray(ref.copy())
    pg.broadcast(b, src=0)
    for got in (out, rs, a2a, b):
        np.testing.assert_array_equal(np.asarray(got.get() if hasattr(got, "get") else got).reshape(-1),
                                      ref.reshape(-1))
    t = FakeTensor(xp.asarray(ref.copy()))
    w = pg.all_reduce(t, op="avg", async_op=True)
    assert isinstance(w, Work)
    w.wait()
    w.synchronize()
    assert w.is_completed()
    pg.barrier()
    sub = pg.new_group([0])
    assert sub.size() == 1 and sub.rank() == 0
    with pytest.raises(CollectiveError, match="not C-contiguous"):
        pg.all_reduce(xp.zeros((4, 4), dtype=xp.float32)[:, 1])
    with pytest.raises(CollectiveError, match="unknown op 'mean'"):
        pg.all_reduce(xp.zeros(2, dtype=xp.float32), op="mean")
    with pytest.raises(CollectiveError, match="'avg' needs a floating dtype"):
        pg.all_reduce(xp.zeros(2, dtype=xp.int32), op="avg")
    with pytest.raises(CollectiveError, match="expected group size 1 x input size 12 = 12"):
        pg.all_gather(xp.zeros(5, dtype=xp.float32), xp.asarray(ref))
    with pytest.raises(CollectiveError, match="output dtype float64 differs from input dtype float32"):
        pg.all_gather(xp.zeros(12, dtype=xp.float64), xp.asarray(ref))
    with pytest.raises(CollectiveError, match="src=1 is not a rank of this group of size 1"):
        pg.broadcast(xp.zeros(2, dtype=xp.float32), src=1)
    with pytest.raises(CollectiveError, match="dst=0 is this rank"):
        pg.send(xp.zeros(2, dtype=xp.float32), 0)
    with pytest.raises(CollectiveError, match=r"new_group: ranks \[1\] are not in this group"):
        pg.new_group([1])
    with pytest.raises(TypeError, match="must be a NumPy/CuPy array or a blutensor Tensor, got list"):
        pg.all_reduce([1.0, 2.0])
