"""Integrity of on-disk caches of compiled kernels (cubins, shared objects), for every package that keeps one.

A compiled kernel found in a cache is run as it is, so before one is loaded two things are checked:

- the **directory** (:func:`cache_problem`): it and every file in it belong to this user and nobody else can
  write them (as ssh requires of ``~/.ssh``). :func:`safe_directory` answers the directory itself when it passes,
  else warns once and answers a fresh private directory of this process (mode 0700), so a file planted in a
  shared cache is never loaded and the kernel is built again;
- the **file** (:func:`verified`): its SHA-256 must equal the record written beside it (``<name>.sha256``) when
  it was stored (:func:`store` for bytes, :func:`seal` for a file a compiler wrote). A file that is truncated
  or damaged is removed with a warning naming it (one with no record, from before records, without one), and the
  caller builds it again; a rebuilt file that still does not verify is a :class:`KernelCacheError` naming it.

blutensor's CPU kernel library and blucompiler use this module directly; blublas, which does not import
blutensor, receives it through the ``blutrain_kernel_cache`` hook when the plugin host loads it.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
import threading
import warnings
from pathlib import Path

from blutensor.errors import BluTensorError

DIGEST_SUFFIX = ".sha256"

_lock = threading.Lock()
_private: dict[str, Path] = {}  # unsafe directory -> this process's private replacement


class KernelCacheError(BluTensorError):
    """A compiled kernel in a cache cannot be stored or verified; names the file."""


def cache_problem(directory: str | os.PathLike) -> str | None:
    """Why compiled kernels must not be loaded from ``directory`` (None when it is safe): it is a link, not a
    directory, another user's, writable by others, or holds a link / another user's file / a file others can
    write. A directory that does not exist yet is safe: it is created for this user (mode 0700)."""
    d = Path(directory)
    uid = os.getuid() if hasattr(os, "getuid") else None
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{d} cannot be inspected ({e.strerror or e})"
    if stat.S_ISLNK(st.st_mode):
        return f"{d} is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return f"{d} is not a directory"
    if uid is not None and st.st_uid != uid:
        return f"{d} belongs to uid {st.st_uid}, not this user ({uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{d} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    try:
        entries = list(os.scandir(d))
    except OSError as e:
        return f"{d} cannot be listed ({e.strerror or e})"
    for e in entries:
        try:
            est = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISLNK(est.st_mode) or (uid is not None and est.st_uid != uid) or \
                est.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{e.path} is a link, another user's file or writable by others"
    return None


def safe_directory(directory: str | os.PathLike, what: str = "compiled kernels") -> Path:
    """``directory`` (created, mode 0700) when :func:`cache_problem` finds nothing wrong with it; else a warning
    naming the problem and a private temporary directory of this process, the same one for every later call."""
    d = Path(directory)
    with _lock:
        if str(d) in _private:
            return _private[str(d)]
        why = cache_problem(d)
        if why is None:
            try:
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
                return d
            except OSError as e:
                why = f"{d} cannot be created ({e.strerror or e})"
        alt = Path(tempfile.mkdtemp(prefix="blutrain-kernels-"))
        _private[str(d)] = alt
    warnings.warn(f"not loading {what} from the cache {d}: {why}; building them in the private directory {alt} "
                  "instead (give this user a private cache directory to keep them)", RuntimeWarning, stacklevel=3)
    return alt


def digest_path(path: str | os.PathLike) -> Path:
    """Where the SHA-256 record of the cached file ``path`` lives (``<name>.sha256`` beside it)."""
    p = Path(path)
    return p.with_name(p.name + DIGEST_SUFFIX)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise KernelCacheError(f"cannot store the compiled kernel {path}: {e.strerror or e}") from None


def seal(path: str | os.PathLike) -> Path:
    """Record the SHA-256 of the file ``path`` (just written by a compiler) so that :func:`verified` accepts it."""
    p = Path(path)
    try:
        digest = _sha256(p)
    except OSError as e:
        raise KernelCacheError(f"cannot read the compiled kernel {p}: {e.strerror or e}") from None
    _write_atomic(digest_path(p), (digest + "\n").encode())
    return p


def store(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temporary file, fsync, rename; mode 0600) and seal it."""
    p = Path(path)
    _write_atomic(p, bytes(data))
    return seal(p)


def verified(path: str | os.PathLike) -> bool:
    """True when the cached file ``path`` exists and matches its SHA-256 record. A file that does not (damaged,
    truncated, replaced) is removed with a warning naming it and False is returned: the caller builds it again.
    False without a warning when there is no such file or it has no record (written before records existed)."""
    p = Path(path)
    rec = digest_path(p)
    try:
        if not p.is_file():
            return False
        try:
            want = rec.read_text().strip()
        except FileNotFoundError:
            want = None
        got = _sha256(p)
    except OSError as e:
        why = f"cannot be read ({e.strerror or e})"
    else:
        if got == want:
            return True
        why = None if want is None else f"does not match its SHA-256 record ({got[:16]}... != {want[:16]}...)"
    if why is not None:  # a file with no record (written before records existed) is rebuilt without a word
        warnings.warn(f"compiled kernel {p} {why}: removed, building it again", RuntimeWarning, stacklevel=2)
    for q in (p, rec):
        try:
            q.unlink()
        except OSError:
            pass
    return False


def check_stored(path: str | os.PathLike) -> Path:
    """``path`` after a (re)build: KernelCacheError naming it when it still does not match its record."""
    p = Path(path)
    try:
        ok = p.is_file() and digest_path(p).read_text().strip() == _sha256(p)
    except OSError:
        ok = False
    if not ok:
        raise KernelCacheError(f"compiled kernel {p} does not match its SHA-256 record right after it was built "
                               "(the cache directory is being changed by something else)")
    return p


__all__ = ["DIGEST_SUFFIX", "KernelCacheError", "cache_problem", "check_stored", "digest_path", "safe_directory",
           "seal", "store", "verified"]
