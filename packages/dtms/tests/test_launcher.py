"""blurun: environment, per-rank logs, failure of one rank ends the gang (named, no hang), port reuse."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from dtms.run import visible_gpus
from dtms_testutil import WORKERS, clean_env, needs_mpi, pid_alive, run_blurun

pytestmark = [pytest.mark.mpi]
LIMIT = 45  # seconds: a launcher test that takes longer than this has hung


def pids(d):
    return [int(p.read_text()) for p in sorted(d.glob("pid*"))]


def no_stale(d):
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids(d)):
        time.sleep(0.1)
    return [p for p in pids(d) if pid_alive(p)]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@needs_mpi
def test_two_ranks_ok_env_logs_prefix(tmp_path):
    logs = tmp_path / "logs"
    p = run_blurun("--nproc-per-node", "2", "--log-dir", str(logs), str(WORKERS / "launch_worker.py"),
                   str(tmp_path), "ok", timeout=LIMIT)
    assert p.returncode == 0, p.stderr
    for r in (0, 1):
        assert re.search(rf"^\[rank {r}\] hello from rank {r} of 2 backend=mpi", p.stdout, re.M)
        assert f"[rank {r}] stderr line of rank {r}" in p.stderr
        out = (logs / f"rank{r}.out").read_text()
        assert f"hello from rank {r} of 2" in out and "[rank" not in out  # log files are unprefixed
        assert f"'RANK': '{r}', 'WORLD_SIZE': '2', 'LOCAL_RANK': '{r}'" in out
        assert "stderr line" in (logs / f"rank{r}.err").read_text()
    assert not no_stale(tmp_path)


@needs_mpi
@pytest.mark.parametrize("mode, nproc, bad, how, code", [
    ("raise", 3, 2, "exit code 1", 1),
    ("kill", 2, 1, r"killed by signal 9 \(SIGKILL\)", 137),
    ("exit3", 2, 0, "exit code 3", 3),
])
def test_failing_rank_ends_the_gang(tmp_path, mode, nproc, bad, how, code):
    t0 = time.monotonic()
    p = run_blurun("--nproc-per-node", str(nproc), "--grace-period", "2", "--log-dir", str(tmp_path / "logs"),
                   str(WORKERS / "launch_worker.py"), str(tmp_path), mode, str(bad), timeout=LIMIT)
    assert time.monotonic() - t0 < LIMIT
    assert p.returncode == code, p.stderr
    assert re.search(rf"blurun: rank {bad} failed \({how}\)", p.stderr), p.stderr
    if mode == "raise":
        assert f"RuntimeError: deliberate failure on rank {bad}" in p.stderr.split("blurun: rank")[-1]
    assert len(pids(tmp_path)) == nproc and not no_stale(tmp_path)


@needs_mpi
def test_port_released_for_an_immediate_relaunch(tmp_path):
    port = str(free_port())
    for i in range(2):
        d = tmp_path / str(i)
        d.mkdir()
        p = run_blurun("--nproc-per-node", "2", "--master-port", port, "--log-dir", str(d / "logs"),
                       str(WORKERS / "launch_worker.py"), str(d), "ok", timeout=LIMIT)
        assert p.returncode == 0, p.stderr
        assert f"store 127.0.0.1:{port}" in p.stderr


@needs_mpi
def test_sigterm_to_blurun_stops_everything(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "dtms.run", "--nproc-per-node", "2", "--grace-period", "2",
                             "--log-dir", str(tmp_path / "logs"), str(WORKERS / "launch_worker.py"),
                             str(tmp_path), "hang"], env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = 0
    for line in proc.stdout:  # wait until both ranks are inside their sleep
        seen += "all ranks hanging" in line
        if seen == 2:
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=LIMIT)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "received SIGTERM; stopped all ranks" in err
    assert len(pids(tmp_path)) == 2 and not no_stale(tmp_path)


def test_direct_mode_failure_and_teardown(tmp_path):
    """Direct spawning (the GPU path) tested on CPU with ranks that form no process group."""
    p = run_blurun("--launcher", "direct", "--nproc-per-node", "3", "--grace-period", "2", "--log-dir",
                   str(tmp_path / "logs"), str(WORKERS / "plain_worker.py"), str(tmp_path), "1", "5",
                   timeout=LIMIT)
    assert p.returncode == 5, p.stderr
    assert "blurun: rank 1 failed (exit code 5)" in p.stderr and "plain stderr 1" in p.stderr
    gpus = visible_gpus()
    for r in range(3):
        assert f"[rank {r}] env {r} 3 {r} {gpus[r] if gpus else None}" in p.stdout
        assert (tmp_path / "logs" / f"rank{r}.err").read_text() == f"plain stderr {r}\n"
    assert len(pids(tmp_path)) == 3 and not no_stale(tmp_path)


def test_launcher_argument_errors(tmp_path, monkeypatch):
    p = run_blurun("--nproc-per-node", "2", str(tmp_path / "missing.py"))
    assert p.returncode == 2 and "script" in p.stderr and "not found" in p.stderr
    script = tmp_path / "s.py"
    script.write_text("")
    p = run_blurun("--launcher", "direct", "--nnodes", "2", "--node-rank", "0", "--master-port", "1234",
                   str(script))
    assert p.returncode == 2 and "BLUTRAIN_STORE_SECRET" in p.stderr
    p = run_blurun("--launcher", "mpi", "--nnodes", "2", str(script))
    assert p.returncode == 2 and "CPU (mpiexec) mode runs on one node" in p.stderr
    p = run_blurun("--nnodes", "2", "--node-rank", "2", str(script))
    assert p.returncode == 2 and "--node-rank" in p.stderr


def test_default_log_dir_and_single_rank(tmp_path):
    script = tmp_path / "one.py"
    script.write_text("import dtms\npg = dtms.init_process_group()\n"
                      "print('backend', pg.backend, dtms.get_world_size())\n")
    p = run_blurun(str(script), cwd=tmp_path, timeout=LIMIT)
    assert p.returncode == 0, p.stderr
    assert "[rank 0] backend" in p.stdout
    logs = list((tmp_path / "blurun-logs").glob("*/rank0.out"))
    assert len(logs) == 1 and "backend" in logs[0].read_text()


def test_python_m_dtms_run_help():
    p = subprocess.run([sys.executable, "-m", "dtms.run", "--help"], capture_output=True, text=True, timeout=30,
                       env=dict(os.environ))
    assert p.returncode == 0 and "--nproc-per-node" in p.stdout


def test_two_node_rendezvous_through_the_store(tmp_path):
    """Two blurun 'nodes' on this machine (direct mode, 2 ranks each) meet in node 0's store."""
    port = str(free_port())
    env = clean_env(BLUTRAIN_STORE_SECRET="shared-secret-of-the-job")
    common = ["--launcher", "direct", "--nnodes", "2", "--nproc-per-node", "2", "--master-port", port]
    node1 = subprocess.Popen([sys.executable, "-m", "dtms.run", *common, "--node-rank", "1", "--log-dir",
                              str(tmp_path / "logs1"), str(WORKERS / "store_worker.py"), str(tmp_path)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p0 = run_blurun(*common, "--node-rank", "0", "--log-dir", str(tmp_path / "logs0"),
                    str(WORKERS / "store_worker.py"), str(tmp_path), env=env, timeout=LIMIT)
    _, err1 = node1.communicate(timeout=LIMIT)
    assert p0.returncode == 0 and node1.returncode == 0, (p0.stderr, err1)
    want = [f"rank {r} on node {r // 2}" for r in range(4)]
    for r in range(4):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got == {"rank": r, "local": r % 2, "world": 4, "seen": want}
    assert (tmp_path / "logs1" / "rank3.err").exists() and (tmp_path / "logs0" / "rank0.out").exists()


def test_visible_gpus_are_cuda_ordinals_not_device_node_numbers(monkeypatch):
    """Without CUDA_VISIBLE_DEVICES the n device nodes become CUDA ordinals 0..n-1: a container exposing
    /dev/nvidia3 and /dev/nvidia5 has CUDA devices 0 and 1 (handing out "3" would hide every GPU)."""
    import dtms.run as run

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(run, "glob", lambda pattern: ["/dev/nvidia5", "/dev/nvidia3"])
    assert run.visible_gpus() == ["0", "1"]
    monkeypatch.setattr(run, "glob", lambda pattern: [])
    assert run.visible_gpus() == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert run.visible_gpus() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert run.visible_gpus() == []
