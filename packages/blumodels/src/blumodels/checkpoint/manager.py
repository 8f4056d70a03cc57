"""CheckpointManager: per-rank step files, cross-rank commits, sync or async saves, pruning, newest-committed-first
loading.

Files are ``step_{step:08d}.rank{rank}.safetensors`` (see :mod:`.format`); temporary files start with a
dot and never match, so a save killed half-way is never taken as a checkpoint. A step is *committed* once every
rank's file is written, fsynced and verified (re-read, every chunk's SHA-256 checked): each rank then writes its
receipt ``step_N.rankR.ok`` (the file's size and the SHA-256 of its header, which holds the payload's digests:
checked again before a load uses the file), and the rank that completes the set writes the commit record
``step_N.commit`` last, atomically (as PyTorch DCP writes its metadata last). Pruning removes only steps older
than the newest ``keep`` committed ones, so a save killed at any point on any rank leaves the previous committed
step on every rank; resume takes the newest committed step. The ranks share the checkpoint directory. A directory
written before commit records existed (no receipt, no record) is read as before: every file that verifies.

Async saves snapshot the tensors into reused host buffers at once (pinned, through bluallocator, for CUDA arrays: a
device staging copy is made on the current stream, so later in-place updates cannot leak in, and the device-to-host
copies run from it on a side stream while training goes on; without room for the staging copy the device-to-host
copies are queued on the current stream), then one background thread writes the file; at most one save is in
flight, a second waits for the first. The writer thread and its I/O worker threads (:mod:`.chunkio`) run at the
lowest CPU priority (nice 19, ``WRITER_NICE``), so their hashing and copying use the cores the training step leaves
idle rather than slowing the step (``benchmarks/checkpoint_bench.py`` measures the stall).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from blumodels.fsio import atomic_write

from . import chunkio
from .format import (
    CheckpointError,
    CheckpointSaveError,
    header_sha256,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)

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


COMMIT_FORMAT = "blutrain-checkpoint-commit"

#: device memory left free beside an async snapshot's device staging copy (else the copies go straight to host)
STAGING_MARGIN = 1 << 30
#: nice value of the async writer thread: it hashes, writes and re-reads the whole checkpoint, CPU work that would
#: otherwise compete with the training step for the cores; at 19 it runs on what the step leaves idle
WRITER_NICE = 19


def _background_priority() -> tuple[int, int] | None:
    """Lower the calling thread's CPU priority to WRITER_NICE (Linux: nice is per thread; elsewhere a no-op);
    (thread id, its previous nice) when lowered."""
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return None
    try:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, max(before, WRITER_NICE))
        return tid, before
    except OSError as e:
        log.debug("could not lower the checkpoint writer's priority: %s", e)
        return None


def _restore_priority(lowered: list[tuple[int, int]]) -> None:
    """Give lowered writer threads their priority back (the training thread now waits for them). Raising a nice
    value back needs CAP_SYS_NICE or RLIMIT_NICE; without them the writer finishes at its low priority."""
    for tid, before in list(lowered):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, before)
        except OSError:
            pass


class CheckpointManager:
    """Saves and finds the checkpoints of one rank in ``directory`` (shared by the ``world_size`` ranks of a run),
    keeping the newest ``keep`` committed ones. ``world_size=None`` treats this rank alone (a tool reading one
    rank's checkpoints; a step then counts once this rank's part is committed). ``on_saved(path, step)`` runs once
    this rank's file of a save is durable and verified (on the writer thread for async saves)."""

    NAME_RE = re.compile(r"^step_(\d{8,})\.rank(\d+)\.safetensors$")
    RECEIPT_RE = re.compile(r"^step_(\d{8,})\.rank(\d+)\.ok$")
    COMMIT_RE = re.compile(r"^step_(\d{8,})\.commit$")

    def __init__(self, directory: str | os.PathLike, rank: int = 0, keep: int | None = 3,
                 async_save: bool = False, world_size: int | None = None, on_saved: Any = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rank, self.keep, self.async_save = int(rank), keep, bool(async_save)
        self.world_size = None if world_size is None else int(world_size)
        if self.world_size is not None and not 0 <= self.rank < self.world_size:
            raise ValueError(f"CheckpointManager: rank {self.rank} is not in 0..world_size-1={self.world_size - 1}")
        #: ranks whose receipts commit a step (world_size None: this rank alone, e.g. a reader of one rank's files)
        self.ranks = list(range(self.world_size)) if self.world_size is not None else [self.rank]
        self.on_saved = on_saved
        self._thread: threading.Thread | None = None
        #: (thread id, its nice before) of the async writer and its I/O workers while they run lowered
        self._lowered: list[tuple[int, int]] = []
        self._lowered_lock = threading.Lock()
        self._waiting = False
        self._error: BaseException | None = None
        self._buffers: dict[str, np.ndarray] = {}
        self._pinned: Any = None
        self._copy_stream: Any = None  # the device-to-host copies of staged snapshots
        self._staging: Any = None  # (device staging arrays, their copies' event) of the last snapshot
        self._good: set[tuple[str, int, int]] = set()
        self._remove_stale_temps()

    # ---------------------------------------------------------------- names
    def path_for(self, step: int) -> Path:
        return self.directory / f"step_{int(step):08d}.rank{self.rank}.safetensors"

    def receipt_for(self, step: int, rank: int | None = None) -> Path:
        return self.directory / f"step_{int(step):08d}.rank{self.rank if rank is None else rank}.ok"

    def commit_for(self, step: int) -> Path:
        return self.directory / f"step_{int(step):08d}.commit"

    def _scan(self, regex: re.Pattern) -> dict[int, list[Path]]:
        found: dict[int, list[Path]] = {}
        for p in self.directory.iterdir():
            m = regex.match(p.name)
            if m:
                found.setdefault(int(m.group(1)), []).append(p)
        return found

    def _read_json(self, path: Path) -> dict | None:
        try:
            with open(path, "rb") as f:
                raw = f.read(1 << 20)
            d = json.loads(raw)
        except (OSError, ValueError, RecursionError):
            return None
        return d if isinstance(d, dict) else None

    def commit_record(self, step: int) -> dict | None:
        """The commit record of ``step`` when it is valid for this run (its world size, one entry per rank)."""
        if self.world_size is None:  # this rank alone: its own verified receipt commits the step
            r = self._read_json(self.receipt_for(step))
            if r is None or r.get("step") != int(step) or r.get("rank") != self.rank:
                return None
            return {"format": COMMIT_FORMAT, "step": int(step), "world_size": None, "files": {str(self.rank): r}}
        d = self._read_json(self.commit_for(step))
        if d is None or d.get("format") != COMMIT_FORMAT or d.get("step") != int(step):
            return None
        files = d.get("files")
        if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
            return None
        if self.world_size is None:
            return d if str(self.rank) in files else None
        if d.get("world_size") != self.world_size or set(files) != {str(r) for r in self.ranks}:
            return None
        return d

    def committed_steps(self) -> list[int]:
        """Steps with a valid commit record, oldest first (every rank's file was written and verified)."""
        found = self._scan(self.COMMIT_RE if self.world_size is not None else self.RECEIPT_RE)
        return sorted(s for s in found if self.commit_record(s) is not None)

    def legacy(self) -> bool:
        """True for a directory written before commit records existed: no receipt and no record in it."""
        return not self._scan(self.RECEIPT_RE) and not self._scan(self.COMMIT_RE)

    def _write_json(self, path: Path, obj: dict) -> None:
        with atomic_write(path) as f:
            f.write((json.dumps(obj, sort_keys=True) + "\n").encode())

    def _commit(self, step: int, path: Path) -> None:
        """This rank's receipt for ``step``; the commit record when every rank's receipt is there."""
        self._write_json(self.receipt_for(step), {"step": int(step), "rank": self.rank, "file": path.name,
                                                  "bytes": path.stat().st_size,
                                                  "header_sha256": header_sha256(path)})
        if self.world_size is None:
            return  # this rank alone: the receipt is the commit (no shared record another rank could overwrite)
        receipts = {}
        for r in self.ranks:
            d = self._read_json(self.receipt_for(step, r))
            if d is None or d.get("step") != int(step):
                return  # another rank has not finished this step yet: it writes the record
            receipts[str(r)] = d
        self._write_json(self.commit_for(step), {"format": COMMIT_FORMAT, "step": int(step),
                                                 "world_size": len(self.ranks), "files": receipts})

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
            if buf is None:  # pages mapped up front (chunkio.alloc): the first snapshot copies without faulting
                n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                buf = np.frombuffer(chunkio.alloc(n), np.uint8, n).view(dtype).reshape(shape)
            self._buffers[name] = buf
        return buf

    def reserve(self, tensors: dict[str, Any]) -> float:
        """Allocate the async snapshot buffers for ``tensors`` now (pinned for device arrays), so that the first
        async save returns after its queued copies instead of after allocating page-locked memory; seconds
        taken. A sync manager holds no buffers: nothing to do. Names and shapes that change later are
        reallocated at that save."""
        if not self.async_save:
            return 0.0
        t0 = time.perf_counter()
        for name, x in tensors.items():
            a, _ = _raw(x)
            dtype = np.dtype(a.dtype)
            self._host_buffer(name, tuple(a.shape), dtype, pinned=_is_device_array(a))
        return time.perf_counter() - t0

    def _snapshot(self, tensors: dict[str, Any]) -> tuple[dict[str, np.ndarray], Any]:
        """Copy every tensor into this manager's reused host buffers; (snapshot, CUDA event or None)."""
        self._release_staging()
        snap: dict[str, np.ndarray] = {}
        on_device: list[tuple[Any, np.ndarray]] = []
        for name, x in tensors.items():
            a, bf16 = _raw(x)
            if _is_device_array(a):
                buf = self._host_buffer(name, tuple(a.shape), np.dtype(a.dtype), pinned=True)
                on_device.append((a, buf))
            else:
                a = np.asarray(a)
                buf = self._host_buffer(name, a.shape, a.dtype, pinned=False)
                np.copyto(buf, a)
            snap[name] = buf.view(ml_dtypes.bfloat16) if bf16 else buf
        for stale in set(self._buffers) - set(tensors):
            del self._buffers[stale]
        return snap, (self._device_to_host(on_device) if on_device else None)

    def _device_to_host(self, pairs: list[tuple[Any, np.ndarray]]) -> Any:
        """Queue the device-to-host copies of ``pairs`` (device array, pinned buffer); the event they complete.

        When the device has room for a second copy of the arrays (free memory outside the pool >= their bytes +
        ``STAGING_MARGIN``, so the next step's own allocations still fit), they are first copied on the device
        (stream-ordered on the current stream, so they hold the values at the save point; microseconds per
        tensor) and the slow device-to-host copies run from those on a separate stream, overlapping the
        following steps. Otherwise the device-to-host copies are queued on the current stream itself (the next
        step's kernels wait for them)."""
        import cupy as cp

        cur = cp.cuda.get_current_stream()
        nbytes = sum(int(a.nbytes) for a, _ in pairs)
        stages = None
        try:
            if cp.cuda.runtime.memGetInfo()[0] >= nbytes + STAGING_MARGIN:
                stages = [cp.array(a, copy=True, order="C") for a, _ in pairs]
        except Exception as e:  # out of device memory after all: the stream-ordered copies below
            log.debug("no device staging copy for the async snapshot (%s)", e)
            stages = None
        if stages is None:
            for a, buf in pairs:
                cp.ascontiguousarray(a).get(stream=cur, out=buf, blocking=False)
            done = cp.cuda.Event(disable_timing=True)
            done.record(cur)
            return done
        ready = cp.cuda.Event(disable_timing=True)
        ready.record(cur)
        if self._copy_stream is None:
            self._copy_stream = cp.cuda.Stream(non_blocking=True)
        cs = self._copy_stream
        cs.wait_event(ready)
        for st, (_, buf) in zip(stages, pairs):
            st.get(stream=cs, out=buf, blocking=False)
        done = cp.cuda.Event(disable_timing=True)
        done.record(cs)
        self._staging = (stages, done)  # freed by the training thread once done (_release_staging)
        return done

    def _release_staging(self, wait: bool = False) -> None:
        """Give the device staging copies of the last snapshot back to the pool once their copies are done
        (always on the thread that made them: the pool is not shared with the writer thread)."""
        if self._staging is not None and (wait or self._staging[1].done):
            if wait:
                self._staging[1].synchronize()
            self._staging = None

    def _write(self, path: Path, tensors: dict[str, np.ndarray], meta: dict, event: Any) -> None:
        if event is not None:
            event.synchronize()
        step = int(meta["step"])
        for stale in (self.receipt_for(step), self.commit_for(step)):  # of a lost attempt at this step
            stale.unlink(missing_ok=True)
        try:
            save_checkpoint(path, tensors, meta)
            verify_checkpoint(path)  # every byte read back and checked as a resume will, before it may count
            self._commit(step, path)
        except OSError as e:
            for p in (path, self.receipt_for(step)):
                p.unlink(missing_ok=True)
            committed = self.committed_steps()
            kept = (f"the committed checkpoint of step {committed[-1]} is kept" if committed else
                    "no earlier committed checkpoint exists")
            why = e.strerror or str(e)
            if e.errno == errno.EFBIG:
                why += " (the file size limit, ulimit -f, is below the checkpoint's size)"
            raise CheckpointSaveError(path, f"could not save step {step}: {why}; nothing of this save was "
                                            f"kept, {kept}", e.errno) from None
        st = path.stat()
        self._good.add((path.name, st.st_size, st.st_mtime_ns))
        if self.on_saved is not None:
            self.on_saved(str(path), step)
        self.prune()

    def _lower(self) -> None:
        """Lower the calling thread (the writer, or an I/O worker it started) to WRITER_NICE and record it with
        the writer's own earlier priority, so that wait() can give it back; a worker that starts once wait() has
        begun gets it back at once (it inherited the writer's lowered priority)."""
        with self._lowered_lock:
            if self._lowered:  # an I/O worker of the lowered writer
                entry = (threading.get_native_id(), self._lowered[0][1])
                if self._waiting:
                    _restore_priority([entry])
                else:
                    self._lowered.append(entry)
            elif not self._waiting:
                got = _background_priority()
                if got is not None:
                    self._lowered.append(got)

    def _write_bg(self, path: Path, tensors: dict[str, np.ndarray], meta: dict, event: Any) -> None:
        self._lower()
        chunkio.hooks.on_worker_start = self._lower  # this thread's I/O workers are lowered (and restored) too
        try:
            self._write(path, tensors, meta, event)
        except BaseException as e:  # reported by the next check()/save()/wait() (the Trainer checks every step)
            log.debug("async checkpoint %s failed: %s", path, e)
            self._error = e

    @property
    def in_flight(self) -> bool:
        """True while an async save is being written."""
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> None:
        """Re-raise the error of an async save that has failed, without waiting for one still being written."""
        self._release_staging()
        if self._error is not None and not self.in_flight:
            self.wait()

    def wait(self) -> None:
        """Block until the in-flight async save (if any) is on disk; re-raise its error."""
        self._release_staging(wait=True)
        if self._thread is not None:
            with self._lowered_lock:
                self._waiting = True
                if self._thread.is_alive():  # the caller blocks on the writer now: it should not yield the cores
                    _restore_priority(self._lowered)
            self._thread.join()
            self._thread, self._waiting, self._lowered = None, False, []
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
            self._check_step(path, verify_checkpoint(path))
        except (CheckpointError, OSError) as e:
            log.warning("checkpoint %s is not usable (%s)", path, e)
            return False
        self._good.add(key)
        return True

    def prune(self) -> list[Path]:
        """Delete this rank's checkpoints (and receipts, and commit records) of steps older than the newest
        ``keep`` committed steps whose file here verifies; uncommitted newer steps stay (another rank may still be
        writing them). Returns the deleted checkpoint paths."""
        if not self.keep or self.keep < 1:
            return []
        kept: list[int] = []
        for step in reversed(self.committed_steps()):
            if len(kept) >= self.keep:
                break
            if self._is_good(self.path_for(step)):
                kept.append(step)
        if len(kept) < self.keep:
            return []  # fewer committed steps than ``keep``: nothing may go yet
        floor, removed = min(kept), []
        for p in self.list():
            step = self.step_of(p)
            if step < floor:
                try:
                    p.unlink()
                    removed.append(p)
                except OSError:
                    pass
                self._good = {k for k in self._good if k[0] != p.name}
        for regex in (self.RECEIPT_RE, self.COMMIT_RE):
            for step, paths in self._scan(regex).items():
                for p in paths:
                    m = regex.match(p.name)
                    mine = regex is self.COMMIT_RE or int(m.group(2)) == self.rank
                    if step < floor and mine and (regex is self.RECEIPT_RE or self.rank == self.ranks[0]):
                        p.unlink(missing_ok=True)
        return removed

    def discard_after(self, step: int) -> None:
        """Delete this rank's files and receipts of steps after ``step`` (a resume at ``step`` redoes them: an
        older attempt's receipt must never complete a new commit)."""
        for p in self.list():
            if self.step_of(p) > step:
                p.unlink(missing_ok=True)
        for s, paths in self._scan(self.RECEIPT_RE).items():
            for p in paths:
                if s > step and int(self.RECEIPT_RE.match(p.name).group(2)) == self.rank:
                    p.unlink(missing_ok=True)
        if self.rank == self.ranks[0]:
            for s, paths in self._scan(self.COMMIT_RE).items():
                if s > step:
                    for p in paths:
                        p.unlink(missing_ok=True)

    def remove_all(self) -> None:
        """Delete this rank's checkpoints and receipts, and (rank 0) every commit record: a new run starts over."""
        self.discard_after(-1)

    def step_of(self, path: str | os.PathLike) -> int:
        """The step number in a checkpoint file name."""
        m = self.NAME_RE.match(Path(path).name)
        if m is None:
            raise ValueError(f"{path} is not a checkpoint file name (step_NNNNNNNN.rankR.safetensors)")
        return int(m.group(1))

    def candidates(self) -> list[int]:
        """Steps a resume may try, oldest first: the committed ones this rank has a file of (in a directory from
        before commit records: every step this rank has a file of). good_steps() says which verify."""
        if self.legacy():
            return [self.step_of(p) for p in self.list()]
        return [step for step in self.committed_steps() if self.path_for(step).is_file()]

    def _check_step(self, path: Path, meta: dict) -> None:
        step = meta.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0 or step != self.step_of(path):
            raise CheckpointError(path, f"metadata step {str(step)[:40]!r} is not the non-negative step "
                                        f"{self.step_of(path)} of its file name")

    def _load_checked(self, path: Path) -> tuple[dict[str, np.ndarray], dict]:
        tensors, meta = load_checkpoint(path)
        self._check_step(path, meta)
        return tensors, meta

    def good_steps(self) -> list[int]:
        """Steps of this rank's committed checkpoints that verify (oldest first); ranks agree on a common one."""
        self.wait()
        out = []
        legacy = self.legacy()
        for step in self.candidates():
            p = self.path_for(step)
            if (legacy or self._matches_receipt(step)) and self._is_good(p):
                out.append(step)
        return out

    def _matches_receipt(self, step: int) -> bool:
        """This rank's file of a committed ``step`` is the one its commit record names (same name and size, and the
        same header SHA-256: the payload digests a load then checks every byte against)."""
        rec = self.commit_record(step)
        mine = rec["files"].get(str(self.rank), {}) if rec is not None else {}
        path = self.path_for(step)
        try:
            size = path.stat().st_size
        except OSError:
            return False
        if mine.get("file") == path.name and mine.get("bytes") == size:
            if "header_sha256" not in mine:  # a receipt from before header digests: name and size
                return True
            try:
                if header_sha256(path) == mine["header_sha256"]:
                    return True
            except (CheckpointError, OSError):
                pass
            log.warning("checkpoint %s is not the file its commit record names (its header's SHA-256 differs)",
                        path)
            return False
        log.warning("checkpoint %s is not the file its commit record names (%s bytes, recorded %s)",
                    self.path_for(step), size, mine.get("bytes"))
        return False

    def load(self, step: int) -> tuple[Path, dict[str, np.ndarray], dict]:
        """(path, tensors, meta) of the checkpoint of ``step``; CheckpointError if missing or bad."""
        self.wait()
        path = self.path_for(step)
        tensors, meta = self._load_checked(path)
        return path, tensors, meta

    def latest_good(self, max_step: int | None = None) -> tuple[Path, dict[str, np.ndarray], dict] | None:
        """(path, tensors, meta) of the newest committed checkpoint that verifies, trying older ones on failure.

        ``max_step`` ignores newer checkpoints (e.g. the newest step every rank has). None if none is good.
        """
        self.wait()
        steps = [s for s in self.candidates() if max_step is None or s <= max_step]
        legacy = self.legacy()
        for step in reversed(steps):
            p = self.path_for(step)
            if not legacy and not self._matches_receipt(step):
                continue
            try:
                tensors, meta = self._load_checked(p)
            except (CheckpointError, OSError) as e:
                log.warning("checkpoint %s failed verification (%s); falling back to an older one", p, e)
                continue
            return p, tensors, meta
        return None
