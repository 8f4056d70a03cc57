"""Per-shape autotuner: measures candidate (tile config, split-K) pairs and caches the winner on disk.

Cache: one JSON file, ``$BLUBLAS_CACHE_DIR/autotune.json`` (default ``~/.cache/blublas``), keyed by device
arch, variant, layout, shape, batch and output dtype; written atomically, read once per process.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

CACHE_VERSION = 1
_lock = threading.Lock()


def cache_dir() -> Path:
    """Where the autotune cache lives (``BLUBLAS_CACHE_DIR`` overrides ``~/.cache/blublas``)."""
    from . import settings

    return settings.get().cache_dir


def problem_key(cc: int, variant: str, layout: str, m: int, n: int, k: int, batch: int, out_dtype: str) -> str:
    """Cache key of one GEMM problem class."""
    return f"sm{cc}|{variant}|{layout}|{m}x{n}x{k}|b{batch}|{out_dtype}"


class AutotuneCache:
    """The on-disk {problem key: {"config": name, "splits": s, "ms": t}} map."""

    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path is not None else cache_dir() / "autotune.json"
        self._entries: dict[str, dict[str, Any]] | None = None

    def _load(self) -> dict[str, dict[str, Any]]:
        if self._entries is None:
            entries: dict[str, dict[str, Any]] = {}
            if self.path.is_file():
                try:
                    data = json.loads(self.path.read_text())
                except (OSError, json.JSONDecodeError) as exc:
                    raise ValueError(
                        f"blublas autotune cache {self.path} is unreadable ({exc}); delete it to retune"
                    ) from exc
                if isinstance(data, dict) and data.get("version") == CACHE_VERSION:
                    entries = dict(data.get("entries", {}))
            self._entries = entries
        return self._entries

    def get(self, key: str) -> dict[str, Any] | None:
        return self._load().get(key)

    def put(self, key: str, value: dict[str, Any]) -> None:
        """Record one result and rewrite the file atomically (merging entries other processes added)."""
        with _lock:
            entries = self._load()
            entries[key] = value
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.is_file():
                try:
                    disk = json.loads(self.path.read_text())
                    if isinstance(disk, dict) and disk.get("version") == CACHE_VERSION:
                        for k2, v2 in disk.get("entries", {}).items():
                            entries.setdefault(k2, v2)
                except (OSError, json.JSONDecodeError):
                    pass
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".autotune.", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)

    def __len__(self) -> int:
        return len(self._load())


_shipped: dict[str, dict[str, Any]] | None = None


def shipped(key: str) -> dict[str, Any] | None:
    """The measured best (config, splits) for ``key`` from the table shipped with the package
    (``tuned_sm90.json``: GPT-2 shapes on an H200, made by dev/make_tuned_table.py), or None."""
    global _shipped
    if _shipped is None:
        path = Path(__file__).parent / "tuned_sm90.json"
        try:
            _shipped = dict(json.loads(path.read_text()).get("entries", {}))
        except (OSError, ValueError):
            _shipped = {}
    return _shipped.get(key)


_default_cache: AutotuneCache | None = None


def default_cache() -> AutotuneCache:
    """The process-wide cache at ``cache_dir()`` (made once; blublas.settings.reset forgets it, so a changed
    BLUBLAS_CACHE_DIR is honoured after a reset: it is looked up on every GEMM call)."""
    global _default_cache
    c = _default_cache
    if c is None:
        c = _default_cache = AutotuneCache(cache_dir() / "autotune.json")
    return c


def forget_default_cache() -> None:
    """Drop the process-wide cache handle (blublas.settings.reset: the next use opens ``cache_dir()`` again)."""
    global _default_cache
    _default_cache = None


def tune(
    key: str,
    candidates: Iterable[Any],
    timer: Callable[[Any], float],
    cache: AutotuneCache | None = None,
    describe: Callable[[Any], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Time every candidate with ``timer`` (milliseconds), cache and return the fastest one's record.

    A cached record for ``key`` is returned without timing anything. Candidates that raise are skipped.
    """
    cache = cache or default_cache()
    hit = cache.get(key)
    if hit is not None:
        return hit
    best: tuple[float, Any] | None = None
    errors = []
    for cand in candidates:
        try:
            ms = float(timer(cand))
        except Exception as exc:  # noqa: BLE001 - a failing candidate is just not chosen
            errors.append(f"{cand}: {exc}")
            continue
        if best is None or ms < best[0]:
            best = (ms, cand)
    if best is None:
        raise RuntimeError(f"autotune of {key}: every candidate failed: {errors}")
    rec = dict(describe(best[1]) if describe else {"candidate": best[1]})
    rec["ms"] = round(best[0], 6)
    cache.put(key, rec)
    return rec


def cuda_event_timer(run: Callable[[Any], None], warmup: int = 2, reps: int = 5) -> Callable[[Any], float]:
    """A timer for ``tune``: median milliseconds of ``run(candidate)`` measured with CUDA events."""

    def timer(cand: Any) -> float:
        import cupy

        for _ in range(warmup):
            run(cand)
        times = []
        for _ in range(reps):
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            run(cand)
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop))
        times.sort()
        return times[len(times) // 2]

    return timer
