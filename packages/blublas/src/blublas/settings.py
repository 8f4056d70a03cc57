"""BluBLAS's own switches (the ``BLUBLAS_*`` environment variables), read once into one immutable object.

Every module of blublas reads its switches from :func:`get` (wgmma kernels, their self-test, the TMA-store
epilogue, autotuning, the 3xTF32 split, the launch memo, the cache directory, the cuBLASLt library and its
tuning), never from ``os.environ`` on a call: the variables are read ONCE, at the first GEMM (or the first
:func:`get`), and changing ``os.environ`` afterwards changes nothing until :func:`reset` (tests, or a program that
sets a variable on purpose after importing blublas). A bad value is a :class:`~blublas.GemmError` (a ValueError)
naming the variable and the values it accepts, raised at that first use, before any kernel runs::

    import blublas

    blublas.settings.get().autotune        # False unless BLUBLAS_AUTOTUNE=1 was set when first read
    os.environ["BLUBLAS_WGMMA"] = "0"
    blublas.settings.reset()               # read the variables again at the next use

The table of every variable is :data:`ENV` (and docs/environment.md, "GEMM library"). These are blublas's own
switches, not blutensor's execution policy (blublas imports no BluTrain package): how a GEMM's precision or
provider is chosen stays the policy's.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path

from .errors import GemmError

#: field -> the environment variable its value comes from
ENV: dict[str, str] = {
    "wgmma": "BLUBLAS_WGMMA",
    "wgmma_probe": "BLUBLAS_WGMMA_PROBE",
    "selftest_timeout": "BLUBLAS_SELFTEST_TIMEOUT",
    "wgmma_tma_store": "BLUBLAS_WGMMA_TMA_STORE",
    "debug_no_epilogue": "BLUBLAS_WGMMA_DEBUG_NO_EPILOGUE",
    "autotune": "BLUBLAS_AUTOTUNE",
    "split_3xtf32": "BLUBLAS_3XTF32",
    "max_3xtf32_temp_mb": "BLUBLAS_3XTF32_MAX_TEMP_MB",
    "launch_memo": "BLUBLAS_LAUNCH_MEMO",
    "cublaslt_tune": "BLUBLAS_CUBLASLT_TUNE",
    "cublaslt": "BLUBLAS_CUBLASLT",
    "cache_dir": "BLUBLAS_CACHE_DIR",
}

_TRUE, _FALSE = ("1", "on", "true", "yes"), ("0", "off", "false", "no")
WGMMA_MODES = ("auto", "on", "off")
PROBES = ("subprocess", "inproc")
SPLIT_MODES = ("two", "concat")


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "blublas"


@dataclass(frozen=True)
class Settings:
    """BluBLAS's switches (immutable). Fields, with their variables (:data:`ENV`):

    - ``wgmma`` (``BLUBLAS_WGMMA``): the sm_90a wgmma kernels: 'auto' (after a passing on-device self-test),
      'on' (always) or 'off' (never); ``wgmma_probe``: where that self-test runs ('subprocess' or 'inproc');
      ``selftest_timeout``: seconds the self-test child may take.
    - ``wgmma_tma_store``: the TMA-store epilogue of the wgmma kernels (False: the staged epilogue);
      ``debug_no_epilogue``: diagnostics only, the wgmma kernels skip their epilogue (the output stays unwritten).
    - ``autotune``: time the candidate (config, split-K) pairs once per problem when a call does not say.
    - ``split_3xtf32``: how a 3xTF32 GEMM is split: 'two' GEMMs (2K then K) or one 'concat' GEMM over 3K;
      ``max_3xtf32_temp_mb``: cap (MiB) on the split operands of one 3xTF32 GEMM (a longer K runs in chunks).
    - ``launch_memo``: replay the recorded launches of a repeated call with the same arrays.
    - ``cublaslt_tune``: time cuBLASLt's top heuristic algorithms once per problem; ``cublaslt``: the path of
      ``libcublasLt`` to load first (None: searched).
    - ``cache_dir``: cached cubins, the autotune table and the wgmma self-test verdicts.
    """

    wgmma: str = "auto"
    wgmma_probe: str = "subprocess"
    selftest_timeout: float = 300.0
    wgmma_tma_store: bool = True
    debug_no_epilogue: bool = False
    autotune: bool = False
    split_3xtf32: str = "two"
    max_3xtf32_temp_mb: int = 1024
    launch_memo: bool = True
    cublaslt_tune: bool = True
    cublaslt: str | None = None
    cache_dir: Path = field(default_factory=_default_cache_dir)

    def __post_init__(self) -> None:
        for name, allowed in (("wgmma", WGMMA_MODES), ("wgmma_probe", PROBES), ("split_3xtf32", SPLIT_MODES)):
            if getattr(self, name) not in allowed:
                raise GemmError(f"blublas setting {name} must be one of {allowed}, got {getattr(self, name)!r}")
        for f in fields(self):
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise GemmError(f"blublas setting {f.name} must be True or False, got {getattr(self, f.name)!r}")
        t = self.selftest_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or t != t or t == float("inf"):
            raise GemmError(f"blublas setting selftest_timeout must be a finite number of seconds > 0, got {t!r}")
        mb = self.max_3xtf32_temp_mb
        if isinstance(mb, bool) or not isinstance(mb, int) or mb <= 0:
            raise GemmError(f"blublas setting max_3xtf32_temp_mb must be an integer > 0, got {mb!r}")
        if not isinstance(self.cache_dir, Path):
            raise GemmError(f"blublas setting cache_dir must be a pathlib.Path, got {self.cache_dir!r}")

    @property
    def max_3xtf32_temp_bytes(self) -> int:
        """``max_3xtf32_temp_mb`` in bytes."""
        return self.max_3xtf32_temp_mb << 20

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Settings:
        """The settings the ``BLUBLAS_*`` variables of ``environ`` (default: ``os.environ``) ask for; unset or
        empty ones keep their defaults. A bad value is a GemmError naming the variable and what it accepts."""
        env = os.environ if environ is None else environ
        kw: dict = {}
        for name, var in ENV.items():
            raw = env.get(var)
            if raw is None or not raw.strip():
                continue
            v = raw.strip()
            low = v.lower()
            if name == "wgmma":
                if low not in ("auto",) + _TRUE + _FALSE:
                    raise GemmError(f"{var} must be auto, 1 (on) or 0 (off), got {raw!r}")
                kw[name] = "on" if low in _TRUE else "off" if low in _FALSE else "auto"
            elif name in ("wgmma_probe", "split_3xtf32"):
                allowed = PROBES if name == "wgmma_probe" else SPLIT_MODES
                if low not in allowed:
                    raise GemmError(f"{var} must be one of {', '.join(allowed)}, got {raw!r}")
                kw[name] = low
            elif name == "selftest_timeout":
                try:
                    t = float(v)
                except ValueError:
                    raise GemmError(f"{var} must be a number of seconds, got {raw!r}") from None
                if not 0 < t < float("inf"):
                    raise GemmError(f"{var} must be a finite number of seconds > 0, got {raw!r}")
                kw[name] = t
            elif name == "max_3xtf32_temp_mb":
                try:
                    mb = int(v)
                except ValueError:
                    raise GemmError(f"{var} must be an integer number of MiB, got {raw!r}") from None
                if mb <= 0:
                    raise GemmError(f"{var} must be > 0, got {mb}")
                kw[name] = mb
            elif name == "cublaslt":
                kw[name] = v
            elif name == "cache_dir":
                kw[name] = Path(v).expanduser()
            else:  # on/off switches
                if low not in _TRUE + _FALSE:
                    raise GemmError(f"{var} must be 1 or 0 (on/off, true/false, yes/no), got {raw!r}")
                kw[name] = low in _TRUE
        return cls(**kw)


_lock = threading.Lock()
_current: Settings | None = None


def get() -> Settings:
    """The process's settings: the environment variables as read at the first call (see :func:`reset`)."""
    s = _current
    if s is None:
        s = _read()
    return s


def _read() -> Settings:
    global _current
    with _lock:
        if _current is None:
            _current = Settings.from_env()
        return _current


def reset() -> None:
    """Forget the settings (the variables are read again at the next use) and everything planned under them:
    the launch memo and the memoized config choices, the process's autotune-cache handle and the wgmma
    self-test verdicts of this process (the on-disk verdicts stay, under ``cache_dir``)."""
    global _current
    with _lock:
        _current = None
    from . import autotune, launch, memo

    memo.clear()
    launch._probe_results.clear()
    autotune.forget_default_cache()


__all__ = ["ENV", "Settings", "get", "reset"]
