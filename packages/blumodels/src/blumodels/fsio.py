"""Durable file writes shared by checkpoints and token shards: temp file, fsync, atomic rename, directory fsync."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def fsync_dir(directory: str | os.PathLike) -> None:
    """fsync a directory so a rename inside it is durable (no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: Path) -> Iterator[BinaryIO]:
    """A binary file ``.<name>.tmp-<pid>-<hex>`` beside ``path``; on a clean exit it is fsynced, renamed over
    ``path`` and the directory fsynced; on an error it is removed and ``path`` is untouched."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)
