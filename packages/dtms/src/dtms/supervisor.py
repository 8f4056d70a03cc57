"""One rank's process, supervised: its stdout/stderr drained into per-rank log files and the terminal
(prefixed ``[rank k]``), its process group terminated on request, its exit reported to the store.

``RankProcess`` is used by ``blurun`` for every rank it spawns directly (GPU mode); under mpiexec
(CPU mode) each MPI slot runs ``python -m dtms.supervisor`` which supervises one rank the same way.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

_term_lock = threading.Lock()
EXIT_KEY = "blurun/{run_id}/exit/{rank}"
LAUNCHER_ENV = "BLUTRAIN_LAUNCHER"  # "pid:start time" of the blurun whose gang this rank belongs to
WATCH_INTERVAL = 0.5  # seconds between checks that the launcher still lives


def process_start_time(pid: int) -> str:
    """The kernel's start time of ``pid`` (field 22 of /proc/PID/stat), '' where unknown: with the pid it names
    one process, never a later one that reuses the pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[19]


def launcher_alive(spec: str) -> bool:
    """True while the process named by a ``pid:start time`` spec (see LAUNCHER_ENV) runs."""
    pid_s, _, start = spec.partition(":")
    try:
        pid = int(pid_s)
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return not start or process_start_time(pid) in ("", start)


def watch_launcher(on_gone: Any, spec: str | None = None, interval: float = WATCH_INTERVAL) -> threading.Thread | None:
    """A daemon thread calling ``on_gone()`` once the launcher (``spec``, default $BLUTRAIN_LAUNCHER) is gone;
    None when no launcher is named. The watchdog of every node: a SIGKILLed blurun cannot signal its gang."""
    spec = os.environ.get(LAUNCHER_ENV) if spec is None else spec
    if not spec:
        return None

    def loop() -> None:
        while launcher_alive(spec):
            time.sleep(interval)
        on_gone()

    t = threading.Thread(target=loop, name="dtms-launcher-watchdog", daemon=True)
    t.start()
    return t


def _pdeathsig(sig: int) -> Any:
    """A preexec function making the child receive ``sig`` when its parent dies (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return None

    def set_it() -> None:
        prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG

    return set_it


def _preexec(first: Any, cpus: list[int] | None) -> Any:
    """``first`` (or nothing), then pin the child to ``cpus`` before it executes: every thread the rank
    ever starts (BLAS pools included) inherits that affinity."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return first
    cores = list(cpus)

    def run() -> None:
        if first is not None:
            first()
        os.sched_setaffinity(0, cores)

    return run


def describe_exit(returncode: int) -> str:
    """'exit code 3' or 'killed by signal 9 (SIGKILL)'."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "?"
        return f"killed by signal {-returncode} ({name})"
    return f"exit code {returncode}"


def shell_code(returncode: int) -> int:
    """The shell's view of a return code: 128 + signal for a killed process."""
    return 128 - returncode if returncode < 0 else returncode


class RankProcess:
    """A rank's child process with drained, logged, prefixed output."""

    def __init__(self, rank: int, argv: list[str], env: dict[str, str], log_dir: Path, tail_lines: int = 20,
                 out: IO[bytes] | None = None, err: IO[bytes] | None = None, cpus: list[int] | None = None):
        self.rank = rank
        log_dir.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = log_dir / f"rank{rank}.out", log_dir / f"rank{rank}.err"
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, preexec_fn=_preexec(_pdeathsig(signal.SIGKILL), cpus),
        )
        self.pid = self.proc.pid
        prefix = f"[rank {rank}] ".encode()
        self._threads = [
            threading.Thread(target=self._drain, args=(self.proc.stdout, self.out_path,
                             out or sys.stdout.buffer, prefix, None), daemon=True),
            threading.Thread(target=self._drain, args=(self.proc.stderr, self.err_path,
                             err or sys.stderr.buffer, prefix, self.tail), daemon=True),
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _drain(pipe: IO[bytes], path: Path, term: IO[bytes], prefix: bytes,
               tail: collections.deque | None) -> None:
        with open(path, "wb") as log:
            for line in iter(pipe.readline, b""):
                log.write(line)
                log.flush()
                if tail is not None:
                    tail.append(line.decode(errors="replace").rstrip("\n"))
                with _term_lock:
                    try:
                        term.write(prefix + (line if line.endswith(b"\n") else line + b"\n"))
                        term.flush()
                    except (OSError, ValueError):
                        pass
        pipe.close()

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the rank's whole process group (its own helpers included)."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def join_output(self, timeout: float = 5.0) -> None:
        """Wait for the drain threads to reach end of output."""
        for t in self._threads:
            t.join(timeout)


def stop_all(ranks: list[RankProcess], grace: float) -> None:
    """SIGTERM every live rank's process group, then SIGKILL whatever is left after ``grace`` seconds."""
    for r in ranks:
        if r.poll() is None:
            r.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for r in ranks:
        r.wait(max(0.0, deadline - time.monotonic()))
    for r in ranks:
        if r.poll() is None:
            r.signal_group(signal.SIGKILL)
        r.wait(5.0)
        r.signal_group(signal.SIGKILL)  # stragglers left in the group after the leader exited


def exit_report(rank: int, rc: int, torn_down: bool, tail: list[str], pid: int) -> dict:
    """What the launcher needs to explain a rank's end."""
    return {"rank": rank, "returncode": rc, "torn_down": torn_down, "tail": tail, "pid": pid,
            "time": time.time(), "how": describe_exit(rc)}


def main(argv: list[str] | None = None) -> int:
    """Per-rank supervisor under mpiexec: ``python -m dtms.supervisor LOG_DIR GRACE -- cmd...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    log_dir, grace = Path(argv[0]), float(argv[1])
    cmd = argv[3:] if argv[2] == "--" else argv[2:]
    from .env import detect_launch

    info = detect_launch()
    if not info.under_mpi:
        print("dtms.supervisor must run under mpiexec (started by blurun)", file=sys.stderr)
        return 2
    rank = info.rank
    env = dict(os.environ)
    single_node = os.environ.get("NNODES", "1") == "1"  # blurun's CPU mode: one node, local rank = rank
    env.update(RANK=str(rank), WORLD_SIZE=str(info.world_size),
               LOCAL_RANK=str(rank if single_node else info.local_rank),
               LOCAL_WORLD_SIZE=str(info.world_size if single_node else info.local_world_size))
    pdeath = _pdeathsig(signal.SIGTERM)
    if pdeath is not None:
        pdeath()  # if mpiexec dies, we get SIGTERM and take our rank down with us
    proc = RankProcess(rank, cmd, env, log_dir, out=sys.stdout.buffer, err=sys.stderr.buffer)
    torn = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        torn.set()
        proc.signal_group(signal.SIGTERM)
        threading.Timer(grace, proc.signal_group, args=(signal.SIGKILL,)).start()

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    watch_launcher(lambda: on_signal(signal.SIGTERM, None))  # blurun gone (even by SIGKILL): the rank goes too
    while (rc := proc.wait(0.2)) is None:
        pass
    proc.join_output()
    proc.signal_group(signal.SIGKILL)
    report = exit_report(rank, rc, torn.is_set(), list(proc.tail), proc.pid)
    if info.has_store and info.run_id:
        try:
            from .store import TCPStore

            st = TCPStore(info.master_addr, info.master_port, timeout=5.0)
            st.set(EXIT_KEY.format(run_id=info.run_id, rank=rank), json.dumps(report))
            st.close()
        except Exception as e:  # the launcher may already be gone; the exit code still tells
            print(f"[rank {rank}] supervisor could not report to the store: {e}", file=sys.stderr)
    return shell_code(rc)


if __name__ == "__main__":
    sys.exit(main())
