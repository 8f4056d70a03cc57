"""Every parallel strategy on several CPU processes gives the single-process GPT-2 result: step-0
gradients and 10 per-step losses (fp64 within 1e-10, fp32 within 1e-5)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from dtms.mpi import find_mpiexec, mpiexec_command, mpiexec_env

WORKER = Path(__file__).parent / "workers" / "parallel_gpt2_worker.py"
pytestmark = pytest.mark.skipif(find_mpiexec() is None, reason="no mpiexec (pip install dtms[mpi])")


def run(tmp_path, strategy, dtype, dp, cp, tp, rotator="p2p", chunks=1):
    W = dp * cp * tp
    out = tmp_path / f"{strategy}_{dtype}_{dp}{cp}{tp}_{rotator}_{chunks}.json"
    cmd = mpiexec_command(W, [sys.executable, str(WORKER), strategy, dtype, str(dp), str(cp), str(tp), str(out),
                              rotator, str(chunks)])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=mpiexec_env())
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return json.loads(out.read_text())


def check(r, tol):
    for a, b in zip(r["losses"], r["ref_losses"]):
        assert abs(a - b) <= tol * max(1.0, abs(b)), (r["losses"], r["ref_losses"])
    assert r["grad_err_max"] <= tol, r["grad_err_max"]
    for a, b in zip(r["norms"], r["ref_norms"]):  # global grad norm of the sharded model = single-process norm
        assert abs(a - b) <= tol * max(1.0, abs(b)), (r["norms"], r["ref_norms"])
    assert max(r["ref_norms"]) > 0.5  # clipping (max_norm 0.5) changed the updates


@pytest.mark.parametrize("W", [2, 4])
def test_fsdp(tmp_path, W):
    r = run(tmp_path, "fsdp", "float64", W, 1, 1)
    check(r, 1e-10)
    # per-rank parameter state ~1/W of the full model (plus padding)
    assert r["state_bytes"] <= r["full_bytes"] / W * 1.05 + 64 * 8
    assert r["stats"]["fsdp_all_gather"] > 0 and r["stats"]["fsdp_reduce_scatter"] > 0


def test_hybrid_sharding(tmp_path):
    """HSDP on 4 ranks: 2 replicas of 2-way shards; fp64-exact, and each rank holds half the parameters."""
    r = run(tmp_path, "hsdp", "float64", 4, 1, 1)
    check(r, 1e-10)
    assert r["full_bytes"] / 2 * 0.95 <= r["state_bytes"] <= r["full_bytes"] / 2 * 1.05 + 64 * 8
    assert r["stats"]["fsdp_replicate_all_reduce"] == r["stats"]["fsdp_reduce_scatter"] > 0


def test_fsdp_fp32(tmp_path):
    check(run(tmp_path, "fsdp", "float32", 2, 1, 1), 1e-5)


@pytest.mark.parametrize("chunks", [1, 4])
def test_tensor_parallel(tmp_path, chunks):
    r = run(tmp_path, "tp", "float64", 1, 1, 2, chunks=chunks)
    check(r, 1e-10)
    if chunks > 1:  # async TP issues its row-parallel all-reduces per token chunk
        # 2 layers x 2 row-parallel linears x 10 steps x 4 chunks
        assert r["stats"]["tp_async_chunk"] == 2 * 2 * 10 * chunks
        # and the column-parallel backward its input-gradient all-reduces (QKV and MLP-up of 2 layers)
        assert r["stats"]["tp_async_bwd_chunk"] == 2 * 2 * 10 * chunks


def test_tensor_parallel_fp32(tmp_path):
    check(run(tmp_path, "tp", "float32", 1, 1, 2), 1e-5)


@pytest.mark.parametrize("rotator", ["p2p", "allgather", "alltoall"])
def test_context_parallel_rotators(tmp_path, rotator):
    check(run(tmp_path, "cp", "float64", 1, 2, 1, rotator=rotator), 1e-10)


def test_context_parallel_fp32(tmp_path):
    check(run(tmp_path, "cp", "float32", 1, 2, 1), 1e-5)


def test_dp_x_tp(tmp_path):
    check(run(tmp_path, "tp", "float64", 2, 1, 2), 1e-10)


def test_dp_x_cp(tmp_path):
    check(run(tmp_path, "cp", "float64", 2, 2, 1, rotator="allgather"), 1e-10)


def test_cp_four_ranks(tmp_path):
    check(run(tmp_path, "cp", "float64", 1, 4, 1, rotator="p2p"), 1e-10)
