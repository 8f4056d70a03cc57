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
