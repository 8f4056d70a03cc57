"""Launch details that must hold under every launcher: srun with pmix (PMIX_RANK without a size) and pmi2 (no
local rank from MPI), the store address from the Slurm allocation, one BLAS thread per CPU rank set by blurun
before the rank's interpreter starts, per-rank logs under the script's --out, and a CPU world without MPI
refused in one line instead of a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from dtms.env import LaunchError, detect_launch, first_host
from dtms.run import blas_thread_env, out_dir_of
from dtms.world import default_backend
from dtms_testutil import clean_env, needs_mpi, run_blurun

LIMIT = 45


def test_srun_pmix_rank_without_size_uses_slurm():
    i = detect_launch({"PMIX_RANK": "3", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
                       "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1"})
    assert (i.launcher, i.rank, i.world_size, i.local_rank, i.local_world_size, i.under_mpi) == (
        "srun", 3, 4, 1, 2, True)


def test_srun_pmi2_local_rank_and_size_from_slurm(monkeypatch):
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
           "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODEID": "0"}
    i = detect_launch(env)
    assert (i.rank, i.world_size, i.local_rank, i.local_world_size) == (1, 2, 1, 2)  # was local 1 of 4 ranks' world
    import dtms.world as w

    monkeypatch.setattr(w, "gpu_count", lambda: 2)  # two GPUs for the node's two tasks: NCCL, not MPI
    assert default_backend(i) == "nccl"


@pytest.mark.parametrize("spec,node,want", [("4", 0, 4), ("2(x3),1", 3, 1), ("2(x3),1", 1, 2), ("3,1", 1, 1)])
def test_slurm_tasks_per_node(spec, node, want):
    i = detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "7", "SLURM_TASKS_PER_NODE": spec,
                       "SLURM_NODEID": str(node)})
    assert i.local_world_size == want


def test_slurm_store_from_the_allocation():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "gpu[07-09,12]",
           "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "2"}
    i = detect_launch(env)
    assert (i.master_addr, i.master_port) == ("gpu07", 15000 + (123456 + 2) % 20000) and i.has_store
    i = detect_launch({**env, "MASTER_ADDR": "head", "MASTER_PORT": "29400"})
    assert (i.master_addr, i.master_port) == ("head", 29400)
    # under srun --mpi=pmix without a store secret: MPI forms the world, no store address is invented
    assert not detect_launch({**env, "PMIX_RANK": "0"}).has_store
    assert detect_launch({**env, "PMIX_RANK": "0", "BLUTRAIN_STORE_SECRET": "s"}).master_addr == "gpu07"
    assert first_host("a1,b[1-2]") == "a1" and first_host("n[3]") == "n3"


def test_bad_slurm_task_list():
    with pytest.raises(LaunchError, match="SLURM_TASKS_PER_NODE='2\\(xz\\)' is not a Slurm task count list"):
        detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2(xz)"})


def test_blas_thread_env_and_out_dir():
    assert blas_thread_env({}, cpu=True) == {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
                                             "MKL_NUM_THREADS": "1"}
    assert blas_thread_env({"OMP_NUM_THREADS": "4"}, cpu=True) == {}  # the user's choice stays
    assert blas_thread_env({}, cpu=False) == {}
    assert out_dir_of(["train", "--out", "runs/x"]) == "runs/x" and out_dir_of(["--out=y"]) == "y"
    assert out_dir_of(["train"]) is None


@needs_mpi
def test_blurun_cpu_ranks_get_one_blas_thread_and_logs_under_out(tmp_path):
    script = tmp_path / "thr.py"
    script.write_text("import os, sys\nimport dtms\ndtms.init_process_group()\n"
                      "print('threads', os.environ.get('OPENBLAS_NUM_THREADS'), os.environ.get('OMP_NUM_THREADS'),"
                      " 'numpy' in sys.modules)\n")
    env = clean_env()
    for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(v, None)
    out = tmp_path / "run"
    p = run_blurun("--nproc-per-node", "2", str(script), "--out", str(out), cwd=tmp_path, env=env, timeout=LIMIT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("threads 1 1 True") == 2  # numpy was loaded before the script: the env did it
    logs = sorted((out / "blurun-logs").glob("*/rank*.out"))
    assert len(logs) == 2 and not (tmp_path / "blurun-logs").exists()


def test_cpu_torchrun_style_launch_is_one_line(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import dtms\ndtms.init_process_group()\n")
    env = clean_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-m", "dtms.runscript", str(script)], env=env, capture_output=True,
                       text=True, timeout=LIMIT)
    assert p.returncode == 1
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "needs an MPI world" in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_blutrain_cpu_torchrun_style_launch_is_one_line(tmp_path):
    pytest.importorskip("blumodels")
    env = clean_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-m", "blumodels.cli", "train", "--preset", "tiny", "--device", "cpu",
                        "--out", str(tmp_path / "r"), "train.world_size=2", "train.batch_tokens=4096"],
                       env=env, capture_output=True, text=True, timeout=LIMIT, cwd=str(tmp_path))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "needs an MPI world" in p.stderr and len([ln for ln in p.stderr.splitlines() if ln.strip()]) == 1
    assert not os.path.exists(tmp_path / "r")  # refused before the run directory is made
