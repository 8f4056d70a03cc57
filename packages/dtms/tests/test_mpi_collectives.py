"""Every collective of the mpi backend on 2 and 4 CPU processes, checked against NumPy (see the worker)."""

import json

import pytest
from dtms_testutil import WORKERS, needs_mpi, run_mpi

EXPECTED = {
    "all_reduce_sum", "all_reduce_avg", "all_reduce_max", "all_reduce_min", "all_reduce_dtypes",
    "all_reduce_bf16", "all_reduce_2d", "reduce_scatter", "all_gather", "broadcast", "all_to_all",
    "send_recv", "async", "subgroups", "mismatch_shape", "mismatch_dtype", "mismatch_op", "local_errors",
}


@needs_mpi
@pytest.mark.mpi
@pytest.mark.parametrize("nproc", [2, 4])
def test_collectives_match_numpy(nproc, tmp_path):
    run_mpi(nproc, WORKERS / "collectives_worker.py", str(tmp_path), timeout=90)
    for r in range(nproc):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["world"] == nproc and got["rank"] == r
        assert set(got["passed"]) == EXPECTED, sorted(EXPECTED - set(got["passed"]))


@needs_mpi
@pytest.mark.mpi
def test_raising_rank_under_plain_mpiexec_ends_the_job():
    """init_process_group installs an excepthook: the raising rank exits at once (no MPI_Finalize hang)."""
    import subprocess
    import sys
    import time

    from dtms.mpi import mpiexec_command, mpiexec_env
    from dtms_testutil import clean_env

    t0 = time.monotonic()
    p = subprocess.run(mpiexec_command(2, [sys.executable, str(WORKERS / "raise_worker.py")]),
                       env=mpiexec_env(clean_env()), capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "ValueError: rank 1 gives up" in p.stderr
    assert "unreachable" not in p.stdout and time.monotonic() - t0 < 30
