"""Stack dumps of every rank on a hang: workers register ``faulthandler`` on SIGUSR1 writing to a
per-rank file; the orchestrator signals them and collects the files."""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from pathlib import Path
from typing import IO

DUMP_SIGNAL = signal.SIGUSR1


def stack_file(run_dir: str | os.PathLike, attempt: int, rank: int) -> Path:
    """Where rank ``rank`` of ``attempt`` writes its stacks."""
    return Path(run_dir) / "stacks" / f"attempt{attempt}.rank{rank}.txt"


def register_dump(path: str | os.PathLike) -> IO[str]:
    """Make SIGUSR1 dump all threads' stacks of this process to ``path`` (kept open; returned)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    f = open(p, "w")
    faulthandler.register(DUMP_SIGNAL, file=f, all_threads=True, chain=False)
    return f


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (R, S, D, T stopped, Z zombie), None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    st = process_state(pid)
    if st is None:
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    return st not in ("Z", "X")


def collect_stacks(pids: dict[int, int], run_dir: str | os.PathLike, attempt: int,
                   timeout: float = 3.0) -> dict[int, str]:
    """Signal every rank (``rank -> pid``) to dump its stacks and return ``rank -> text``.

    A stopped rank (SIGSTOP) is continued after the signal so its handler can run; it is torn down
    right after by the caller."""
    before = {}
    for rank, pid in pids.items():
        f = stack_file(run_dir, attempt, rank)
        before[rank] = f.stat().st_size if f.exists() else 0
        try:
            os.kill(pid, DUMP_SIGNAL)
            if process_state(pid) == "T":
                os.kill(pid, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + timeout
    out: dict[int, str] = {}
    while time.monotonic() < deadline and len(out) < len(pids):
        for rank in pids:
            f = stack_file(run_dir, attempt, rank)
            if rank not in out and f.exists() and f.stat().st_size > before[rank]:
                time.sleep(0.1)  # let the handler finish writing
                out[rank] = f.read_text(errors="replace")[before[rank]:]
        time.sleep(0.05)
    return out
