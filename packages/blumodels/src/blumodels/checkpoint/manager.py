"""CheckpointManager: per-rank step files, sync or async saves, pruning, newest-good-first loading.

Files are ``step_{step:08d}.rank{rank}.safetensors`` (see :mod:`.format`); temporary files start with a
dot and never match, so a save killed half-way is never taken as a checkpoint. Async saves snapshot the
tensors into reused host buffers at once (pinned, through bluallocator, for CUDA arrays: the device to
host copies are queued on the current stream, so later in-place updates cannot leak in), then one
background thread writes the file; at most one save is in flight, a second waits for the first.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .format import CheckpointError, load_checkpoint, save_checkpoint

log = logging.getLogger(__name__)


def _raw(x: Any) -> tuple[Any, bool]:
    """(raw NumPy/CuPy array, is-bfloat16-stored-as-uint16) of an array or a blutensor Tensor."""
    data = getattr(x, "_data", None)
    if data is not None and hasattr(x, "dtype") and hasattr(x.dtype, "cuda_storage"):
        return data, x.dtype.name == "bfloat16" and data.dtype == np.uint16
    return x, False


def _is_device_array(a: Any) -> bool:
    return hasattr(a, "__cuda_array_interface__") and not isinstance(a, np.ndarray)


def to_host(x: Any) -> np.ndarray:
    """A NumPy copy-or-view of an array/Tensor on any device (bfloat16 kept as ml_dtypes.bfloat16)."""
    a, bf16 = _raw(x)
    if _is_device_array(a):
        a = a.get()
    a = np.asarray(a)
    return a.view(ml_dtypes.bfloat16) if bf16 else a


class CheckpointManager:
    """Saves and finds the checkpoints of one rank in ``directory``, keeping the newest ``keep`` good ones."""

    NAME_RE = re.compile(r"^step_(\d{8,})\.rank(\d+)\.safetensors$")

    def __init__(self, directory: str | os.PathLike, rank: int = 0, keep: int | None = 3,
                 async_save: bool = False) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rank, self.keep, self.async_save = int(rank), keep, bool(async_save)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: dict[str, np.ndarray] = {}
        self._pinned: Any = None
        self._good: set[tuple[str, int, int]] = set()
        self._remove_stale_temps()

    # ---------------------------------------------------------------- names
    def path_for(self, step: int) -> Path:
        return self.directory / f"step_{int(step):08d}.rank{self.rank}.safetensors"

    def list(self) -> list[Path]:
        """This rank's checkpoint files, oldest step first (temporary files excluded)."""
        found = []
        for p in self.directory.iterdir():
            m = self.NAME_RE.match(p.name)
            if m and int(m.group(2)) == self.rank and p.is_file():
                found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found)]

    def _remove_stale_temps(self) -> None:
        """Delete temporary files of this rank left by a killed process (never a checkpoint)."""
        mine = f".rank{self.rank}.safetensors.tmp-"
        for p in self.directory.iterdir():
            if p.name.startswith(".step_") and mine in p.name and f"tmp-{os.getpid()}-" not in p.name:
                try:
                    p.unlink()
                    log.info("removed stale temporary checkpoint file %s", p)
                except OSError:
                    pass

    # ---------------------------------------------------------------- saving
    def save(self, step: int, tensors: dict[str, Any], meta: dict) -> Path:
        """Checkpoint ``tensors`` (NumPy/CuPy arrays or Tensors) + ``meta`` as ``step``; returns the path.

        Async: returns once the snapshot is taken; the write happens on the background thread (an error
        there is raised by the next save/wait).
        """
        self.wait()
        meta = {**meta, "step": int(step), "rank": self.rank}
        path = self.path_for(step)
        if not self.async_save:
            self._write(path, {k: to_host(v) for k, v in tensors.items()}, meta, None)
            return path
        snap, event = self._snapshot(tensors)
        self._thread = threading.Thread(target=self._write_bg, args=(path, snap, meta, event),
                                        name=f"blumodels-ckpt-rank{self.rank}", daemon=False)
        self._thread.start()
        return path

    def _host_buffer(self, name: str, shape: tuple[int, ...], dtype: np.dtype, pinned: bool) -> np.ndarray:
        buf = self._buffers.get(name)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = None
            if pinned:
                try:
                    if self._pinned is None:
                        from bluallocator import PinnedHostAllocator

                        self._pinned = PinnedHostAllocator(pinned=None)
                    buf = self._pinned.empty(shape, dtype)
                except Exception as e:  # bluallocator absent or no page-locked memory: plain host memory
                    log.debug("pinned snapshot buffer unavailable (%s)", e)
            self._buffers[name] = buf = np.empty(shape, dtype) if buf is None else buf
        return buf

    def _snapshot(self, tensors: dict[str, Any]) -> tuple[dict[str, np.ndarray], Any]:
        """Copy every tensor into this manager's reused host buffers; (snapshot, CUDA event or None)."""
        snap: dict[str, np.ndarray] = {}
        event = None
        for name, x in tensors.items():
            a, bf16 = _raw(x)
            if _is_device_array(a):
                import cupy as cp

                a = cp.ascontiguousarray(a)
                buf = self._host_buffer(name, a.shape, np.dtype(a.dtype), pinned=True)
                stream = cp.cuda.get_current_stream()
                a.get(stream=stream, out=buf, blocking=False)
                event = cp.cuda.Event(disable_timing=True)
                event.record(stream)
            else:
                a = np.asarray(a)
                buf = self._host_buffer(name, a.shape, a.dtype, pinned=False)
                np.copyto(buf, a)
            snap[name] = buf.view(ml_dtypes.bfloat16) if bf16 else buf
        for stale in set(self._buffers) - set(tensors):
            del self._buffers[stale]
        return snap, event

    def _write(self, path: Path, tensors: dict[str, np.ndarray], meta: dict, event: Any) -> None:
        if event is not None:
            event.synchronize()
        save_checkpoint(path, tensors, meta)
        st = path.stat()
        self._good.add((path.name, st.st_size, st.st_mtime_ns))
        self.prune()

    def _write_bg(self, path: Path, tensors: dict[str, np.ndarray], meta: dict, event: Any) -> None:
        try:
            self._write(path, tensors, meta, event)
        except BaseException as e:  # reported by the next save()/wait()
            log.error("async checkpoint %s failed: %s", path, e)
            self._error = e

    @property
    def in_flight(self) -> bool:
        """True while an async save is being written."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the in-flight async save (if any) is on disk; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def close(self) -> None:
        """Finish the in-flight save and drop the snapshot buffers."""
        try:
            self.wait()
        finally:
            self._buffers.clear()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- verifying, pruning, loading
    def _is_good(self, path: Path) -> bool:
        try:
            st = path.stat()
        except OSError:
            return False
        key = (path.name, st.st_size, st.st_mtime_ns)
        if key in self._good:
            return True
        try:
            load_checkpoint(path)
        except (CheckpointError, OSError) as e:
            log.warning("checkpoint %s is not usable (%s)", path, e)
            return False
        self._good.add(key)
        return True

    def prune(self) -> list[Path]:
        """Delete checkpoints older than the newest ``keep`` good ones; returns the deleted paths."""
        if not self.keep or self.keep < 1:
            return []
        good, removed = 0, []
        for p in reversed(self.list()):
            if good >= self.keep:
                try:
                    p.unlink()
                    removed.append(p)
                except OSError:
                    pass
                self._good = {k for k in self._good if k[0] != p.name}
            elif self._is_good(p):
                good += 1
        return removed

    def step_of(self, path: str | os.PathLike) -> int:
        """The step number in a checkpoint file name."""
        m = self.NAME_RE.match(Path(path).name)
        if m is None:
            raise ValueError(f"{path} is not a checkpoint file name (step_NNNNNNNN.rankR.safetensors)")
        return int(m.group(1))

    def good_steps(self) -> list[int]:
        """Steps of this rank's checkpoints that verify (oldest first); ranks can agree on a common one."""
        self.wait()
        return [self.step_of(p) for p in self.list() if self._is_good(p)]

    def load(self, step: int) -> tuple[Path, dict[str, np.ndarray], dict]:
        """(path, tensors, meta) of the checkpoint of ``step``; CheckpointError if missing or bad."""
        self.wait()
        path = self.path_for(step)
        tensors, meta = load_checkpoint(path)
        return path, tensors, meta

    def latest_good(self, max_step: int | None = None) -> tuple[Path, dict[str, np.ndarray], dict] | None:
        """(path, tensors, meta) of the newest checkpoint that verifies, trying older ones on failure.

        ``max_step`` ignores newer checkpoints (e.g. the newest step every rank has). None if none is good.
        """
        self.wait()
        paths = [p for p in self.list() if max_step is None or self.step_of(p) <= max_step]
        for p in reversed(paths):
            try:
                tensors, meta = load_checkpoint(p)
            except (CheckpointError, OSError) as e:
                log.warning("checkpoint %s failed verification (%s); falling back to an older one", p, e)
                continue
            return p, tensors, meta
        return None
