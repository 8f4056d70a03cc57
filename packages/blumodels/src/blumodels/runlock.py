"""One owner per run directory: an OS lock (``flock``) on ``<out>/.blutrain.lock`` held for the run's life.

A second trainer on the same directory (a ``--resume`` beside a running job, a relaunch beside survivors) is
refused in one line naming the holder's pid and host. The kernel releases the lock when its holder dies, however
it dies, so a dead owner's lock is simply taken over (its record is replaced; nothing to clean up by hand).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from blumodels.config import ConfigError

LOCK_NAME = ".blutrain.lock"


class RunLockError(ConfigError):
    """The run directory is owned by another live process; ``holder`` is its record (pid, host, since)."""

    def __init__(self, message: str, holder: dict[str, Any]) -> None:
        super().__init__(message)
        self.holder = holder


class RunLock:
    """An exclusive, non-blocking lock on a run directory; ``release()`` (or process exit) frees it."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self._fd: int | None = None
        self.previous: dict[str, Any] | None = None  # the record of a dead owner this lock took over

    def _read(self) -> dict[str, Any]:
        try:
            with open(self.path, "rb") as f:
                d = json.loads(f.read(4096) or b"{}")
            return d if isinstance(d, dict) else {}
        except (OSError, ValueError, RecursionError):
            return {}

    def acquire(self) -> RunLock:
        """Take the lock or raise :class:`RunLockError` naming the live holder."""
        import fcntl

        if self._fd is not None:
            return self
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise ConfigError(f"cannot create the run lock {self.path}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            h = self._read()
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["since"])) \
                if isinstance(h.get("since"), int | float) else "?"
            raise RunLockError(f"run directory {self.directory} is in use by pid {h.get('pid', '?')} on host "
                               f"{h.get('host', '?')} (since {since}); wait for it to end or stop it first "
                               f"(one trainer per --out)", h) from None
        old = self._read()
        self.previous = old if old.get("pid") else None
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                  "argv": [a[:200] for a in sys.argv[:16]]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Free the lock (the record stays until the next owner replaces it)."""
        if self._fd is None:
            return
        import fcntl

        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
