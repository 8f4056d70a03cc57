"""The gang dies with its launcher: SIGKILL of blurun (which can then signal nothing) still ends every rank
within seconds, through mpiexec's parent-death signal and each supervisor's watchdog on the launcher."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from dtms.supervisor import launcher_alive, process_start_time, watch_launcher
from dtms_testutil import WORKERS, clean_env, needs_mpi, pid_alive

pytestmark = [pytest.mark.mpi]


def _pids(d):
    return [int(p.read_text()) for p in sorted(d.glob("pid*"))]


@needs_mpi
def test_sigkill_of_blurun_ends_the_cpu_gang(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "dtms.run", "--nproc-per-node", "2", "--grace-period", "1",
                             "--log-dir", str(tmp_path / "logs"), str(WORKERS / "launch_worker.py"),
                             str(tmp_path), "hang"], env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        seen = 0
        deadline = time.monotonic() + 45
        for line in proc.stdout:  # both ranks inside their 60 s sleep
            seen += "all ranks hanging" in line
            if seen == 2 or time.monotonic() > deadline:
                break
        assert seen == 2
        ranks = _pids(tmp_path)
        assert len(ranks) == 2 and all(pid_alive(p) for p in ranks)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        t0 = time.monotonic()
        while any(pid_alive(p) for p in ranks) and time.monotonic() - t0 < 15:
            time.sleep(0.1)
        assert not [p for p in ranks if pid_alive(p)], "ranks outlived their launcher"
        assert time.monotonic() - t0 < 10
    finally:
        for p in _pids(tmp_path):
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)


def test_watchdog_names_one_process_not_a_reused_pid():
    me = f"{os.getpid()}:{process_start_time(os.getpid())}"
    assert launcher_alive(me)
    assert not launcher_alive(f"{os.getpid()}:1")  # same pid, another start time: a reused pid is not it
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    spec = f"{child.pid}:{process_start_time(child.pid)}"
    gone = threading.Event()
    assert watch_launcher(gone.set, spec, interval=0.05) is not None
    assert not gone.wait(0.3)
    child.kill()
    child.wait()
    assert gone.wait(5)
    assert watch_launcher(gone.set, "") is None  # no launcher named: no watchdog
