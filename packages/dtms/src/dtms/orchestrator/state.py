"""The orchestrator's persisted recovery state: one JSON file in the run directory, atomically rewritten
(temp file, fsync, rename) after every transition, so a restarted orchestrator continues where it was."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# status values of the state machine
INIT, STARTING, RUNNING, RECOVERING = "INIT", "STARTING", "RUNNING", "RECOVERING"
SUCCEEDED, FAILED, GAVE_UP, PREEMPTED = "SUCCEEDED", "FAILED", "GAVE_UP", "PREEMPTED"
TERMINAL = {SUCCEEDED, FAILED, GAVE_UP}
STATE_FILE = "orchestrator_state.json"
STATE_VERSION = 1


@dataclass
class RunState:
    """attempt/restarts counters, last verified step, incident summaries and the attempt history."""

    run_id: str
    status: str = INIT
    attempt: int = -1  # index of the current (or last) attempt
    restarts: int = 0  # restarts after faults (preemptions are not counted)
    no_progress_restarts: int = 0  # restarts in a row whose attempt reached no new step
    last_good_step: int | None = None  # newest checkpoint step every rank committed
    best_step: int = -1  # highest step every rank completed
    incidents: list[dict[str, Any]] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)
    live: dict[str, Any] = field(default_factory=dict)  # pids of the running attempt (reaped on a restart)
    exit_code: int | None = None
    reason: str = ""
    version: int = STATE_VERSION
    updated: float = 0.0
    started: float = 0.0  # when the run's first attempt was set up (the root span of its trace starts here)

    def save(self, run_dir: str | os.PathLike) -> Path:
        """Atomically replace ``run_dir/orchestrator_state.json``."""
        self.updated = time.time()
        path = Path(run_dir) / STATE_FILE
        tmp = path.with_name(f".{STATE_FILE}.tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(asdict(self), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        try:
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass
        return path

    @classmethod
    def load(cls, run_dir: str | os.PathLike) -> RunState | None:
        """The saved state, None when there is none; ValueError naming the file when it is unreadable."""
        path = Path(run_dir) / STATE_FILE
        if not path.is_file():
            return None
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"orchestrator state {path} is unreadable: {e}") from e
        if d.get("version") != STATE_VERSION:
            raise ValueError(f"orchestrator state {path} has version {d.get('version')!r}, "
                             f"expected {STATE_VERSION}")
        return cls(**d)
