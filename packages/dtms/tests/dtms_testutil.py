"""Helpers for dtms tests: run a worker under mpiexec, run blurun, with hard time limits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
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


def run_blurun(*args: str, timeout: float = 60.0, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m dtms.run args`` (the blurun entry point) with a time limit."""
    return subprocess.run([sys.executable, "-m", "dtms.run", *args], env=clean_env(), capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


def pid_alive(pid: int) -> bool:
    """True when ``pid`` is a live process (zombies count as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
