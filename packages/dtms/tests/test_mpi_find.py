"""find_mpiexec and the mpiexec command line (root handling, oversubscription)."""

import os
import sys
from pathlib import Path

import pytest
from dtms.mpi import find_mpiexec, is_open_mpi, mpiexec_command, mpiexec_env


def test_find_mpiexec_prefers_the_environment_bin():
    exe = find_mpiexec()
    if exe is None:
        pytest.skip("no MPI installed")
    assert os.access(exe, os.X_OK)
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        assert exe == str(local)


def test_override_by_env(monkeypatch, tmp_path):
    fake = tmp_path / "mympiexec"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("BLUTRAIN_MPIEXEC", str(fake))
    assert find_mpiexec() == str(fake)
    assert mpiexec_command(3, ["python", "x.py"]) == [str(fake), "-n", "3", "python", "x.py"]


def test_open_mpi_command_oversubscribes():
    exe = find_mpiexec()
    if exe is None or not is_open_mpi(exe):
        pytest.skip("needs Open MPI")
    cmd = mpiexec_command(4, ["python", "w.py"])
    assert cmd[:4] == [exe, "-n", "4", "--oversubscribe"] and cmd[-2:] == ["python", "w.py"]


def test_root_is_allowed_when_root():
    env = mpiexec_env({"PATH": "/bin"})
    if os.geteuid() == 0:
        assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1" and env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    else:
        assert "OMPI_ALLOW_RUN_AS_ROOT" not in env


def test_missing_mpi_names_the_extra(monkeypatch):
    import dtms.mpi as m

    monkeypatch.setattr(m, "find_mpiexec", lambda: None)
    with pytest.raises(RuntimeError, match=r"pip install dtms\[mpi\]"):
        m.mpiexec_command(2, ["x"])
