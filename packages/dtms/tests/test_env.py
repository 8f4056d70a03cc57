"""Launch detection from (fake) environments: blurun, torchrun-style, mpirun, Hydra PMI, srun, alone."""

import subprocess
import sys

import dtms
import pytest
from dtms.env import LaunchError, detect_launch
from dtms.world import default_backend
from dtms_testutil import clean_env


def test_blurun_env():
    i = detect_launch({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "BLUTRAIN_RUN_ID": "r1"})
    assert (i.launcher, i.rank, i.world_size, i.local_rank, i.local_world_size) == ("blurun", 3, 4, 1, 2)
    assert i.has_store and i.master_port == 29500 and i.run_id == "r1" and not i.under_mpi


def test_plain_rank_env_is_env_launcher():
    i = detect_launch({"RANK": "0", "WORLD_SIZE": "1"})
    assert i.launcher == "env" and not i.has_store


def test_mpirun_open_mpi_env():
    i = detect_launch({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                       "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (i.launcher, i.rank, i.world_size, i.local_rank, i.local_world_size, i.under_mpi) == (
        "mpirun", 2, 4, 0, 2, True)


def test_hydra_pmi_env():
    i = detect_launch({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (i.launcher, i.rank, i.world_size, i.local_rank) == ("mpirun", 1, 2, 1)


def test_srun_env():
    i = detect_launch({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                       "SLURM_NTASKS_PER_NODE": "4", "MASTER_ADDR": "node01", "MASTER_PORT": "1234"})
    assert (i.launcher, i.rank, i.world_size, i.local_rank, i.local_world_size) == ("srun", 5, 8, 1, 4)
    assert i.has_store and not i.under_mpi


def test_single_process():
    i = detect_launch({})
    assert (i.launcher, i.rank, i.world_size) == ("single", 0, 1)
    assert default_backend(i) in ("local", "nccl")


@pytest.mark.parametrize("env, msg", [
    ({"RANK": "1", "WORLD_SIZE": "2", "BLUTRAIN_RUN_ID": "x", "OMPI_COMM_WORLD_RANK": "0",
      "OMPI_COMM_WORLD_SIZE": "2"}, r"world/rank mismatch: blurun environment says rank 1 of 2 but the MPI"),
    ({"RANK": "4", "WORLD_SIZE": "4"}, r"rank 4 is not in \[0, 4\)"),
    ({"RANK": "0"}, "WORLD_SIZE missing"),
    ({"RANK": "zero", "WORLD_SIZE": "2"}, "RANK='zero' is not an integer"),
    ({"SLURM_PROCID": "0"}, "SLURM_NTASKS is missing"),
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "2"}, r"rank 3 is not in \[0, 2\) \(srun"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "0"}, "world size 0 < 1"),
])
def test_bad_environments(env, msg):
    with pytest.raises(LaunchError, match=msg):
        detect_launch(env)


def test_cpu_world_without_mpi_is_a_clear_error():
    i = detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"})
    if dtms.cuda_available():
        pytest.skip("a GPU makes nccl the default")
    with pytest.raises(LaunchError, match=r"world size 4 on CPU needs an MPI world.*blurun.*mpirun"):
        default_backend(i)


def test_init_under_fake_srun_single_task(monkeypatch):
    for k, v in clean_env(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0").items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("RANK", raising=False)
    dtms.init_process_group("local")
    try:
        assert dtms.get_rank() == 0 and dtms.get_world_size() == 1 and dtms.get_local_rank() == 0
    finally:
        dtms.destroy_process_group()


def test_local_backend_refuses_bigger_world(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    with pytest.raises(LaunchError, match="backend 'local' runs one process.*world size 2"):
        dtms.init_process_group("local")
    assert not dtms.is_initialized()


def test_mpi_world_mismatch_with_environment():
    """RANK/WORLD_SIZE say 2 processes, but MPI (a singleton here) has one: a clear error, not a hang."""
    code = "import dtms; dtms.init_process_group('mpi')"
    p = subprocess.run([sys.executable, "-c", code], env=clean_env(RANK="0", WORLD_SIZE="2"),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "world/rank mismatch: the env environment says rank 0 of 2 but MPI says rank 0 of 1" in p.stderr


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'gloo'"):
        dtms.init_process_group("gloo")


@pytest.mark.parametrize("gpus, env, pinned, want", [
    (1, {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, False, "mpi"),  # 2 CPU ranks, 1 GPU
    (2, {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, False, "nccl"),
    (1, {"RANK": "1", "WORLD_SIZE": "2", "BLUTRAIN_RUN_ID": "x"}, True, "nccl"),  # blurun pinned a GPU
    (0, {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"}, False, "mpi"),
    (0, {}, False, "local"),
])
def test_default_backend_choice(monkeypatch, gpus, env, pinned, want):
    import dtms.world as w

    monkeypatch.setattr(w, "gpu_count", lambda: gpus)
    if pinned:
        monkeypatch.setenv("BLUTRAIN_GPU_PINNED", "1")
    else:
        monkeypatch.delenv("BLUTRAIN_GPU_PINNED", raising=False)
    assert default_backend(detect_launch(env)) == want
