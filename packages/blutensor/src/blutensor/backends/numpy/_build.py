"""Compile ``kernels.c`` at first use with the system C compiler and load it through ctypes.

The shared library is cached on disk (``$BLUTRAIN_CPU_CACHE``, else ``$XDG_CACHE_HOME/blutensor`` or
``~/.cache/blutensor``) under a name hashed from the source, the compiler command and this CPU's instruction
set flags (``-march=native``: a library built on another CPU is never loaded), with its SHA-256 beside it
(:mod:`blutensor.kernel_cache`): a damaged library is rebuilt, and one in a directory others can write is never
loaded. Ranks that build at the same time
each write their own temporary file and rename it into place (atomic). When no compiler, no OpenMP or no
writable cache is found, or ``BLUTRAIN_CPU_KERNELS=0``, :func:`lib` returns None and blutensor says once, as a
warning, that the NumPy reference kernels run instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-std=gnu11", "-fPIC",
         "-shared"]

_P = ctypes.c_void_p
_L = ctypes.c_long
_F = ctypes.c_float
_I = ctypes.c_int
_I64 = ctypes.c_int64
#: argument types of every exported kernel (kernels.c)
SIGNATURES = {
    "blu_set_num_threads": [_I],
    "blu_get_num_threads": [],
    "blu_gelu_tanh_forward": [_P, _P, _L],
    "blu_gelu_tanh_backward": [_P, _P, _P, _L],
    "blu_layer_norm_forward": [_P, _P, _P, _P, _P, _P, _L, _L, _F],
    "blu_layer_norm_backward": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _L, _L],
    "blu_rms_norm_forward": [_P, _P, _P, _P, _L, _L, _F],
    "blu_rms_norm_backward": [_P, _P, _P, _P, _P, _P, _P, _L, _L],
    "blu_add_rms_norm_forward": [_P, _P, _P, _P, _P, _P, _L, _L, _F],
    "blu_add_rms_norm_backward": [_P, _P, _P, _P, _P, _P, _P, _P, _L, _L],
    "blu_add_layer_norm_forward": [_P, _P, _P, _P, _P, _P, _P, _P, _L, _L, _F],
    "blu_add_layer_norm_backward": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _L, _L],
    "blu_cross_entropy_forward": [_P, _P, _P, _P, _L, _L, _I64, _F],
    "blu_cross_entropy_backward": [_P, _P, _P, _P, _L, _P, _L, _L, _I64, _F],
    "blu_embedding_backward": [_P, _P, _P, _L, _L, _L],
    "blu_sdpa_forward": [_P, _P, _P, _P, _P, _L, _L, _L, _L, _L, _F, _I],
    "blu_sdpa_backward": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _L, _L, _L, _L, _L, _F, _I],
    "blu_adamw": [_P, _P, _P, _P, _L, _F, _F, _F, _F, _F, _F, _F],
    "blu_sum_squares": [_P, _P, _L, _P, _P],
    "blu_scale_": [_P, _P, _L, _F],
    "blu_set_sgemm": [_P, _I],
    "blu_gemm_rows": [_I, _I, _L, _L, _L, _P, _L, _P, _L, _P, _L, _P, _L, _I],
    "blu_copy_strided": [_P, _P, _I, _P, _P],
    "blu_col_sum": [_P, _P, _L, _L],
}

_lock = threading.Lock()
_state: dict = {}  # "lib": CDLL or None once tried; "reason": why not; "build_s": seconds the build took


def configured_cache_dir() -> Path:
    """$BLUTRAIN_CPU_CACHE, else $XDG_CACHE_HOME/blutensor or ~/.cache/blutensor."""
    env = os.environ.get("BLUTRAIN_CPU_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "blutensor"


def cache_dir() -> Path:
    """The configured cache when it is private to this user, else a private directory of this process (with a
    warning): blutensor.kernel_cache.safe_directory."""
    from blutensor import kernel_cache

    return kernel_cache.safe_directory(configured_cache_dir(), "compiled CPU kernels")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    cc = os.environ.get("CC", "cc")
    return cc if shutil.which(cc) else None


def library_path(cc: str) -> Path:
    """Where the library for this source, compiler command and CPU lives in the cache."""
    key = "\n".join([SOURCE.read_text(), cc, " ".join(FLAGS), platform.machine(), _cpu_flags()])
    return cache_dir() / f"blu_cpu_{hashlib.sha256(key.encode()).hexdigest()[:20]}.so"


def _build(cc: str, so: Path) -> None:
    import time

    so.parent.mkdir(parents=True, exist_ok=True)
    tmp = so.with_name(f"{so.stem}.{os.getpid()}.{threading.get_ident()}.so")
    t0 = time.perf_counter()
    r = subprocess.run([cc, *FLAGS, "-o", str(tmp), str(SOURCE), "-lm"], capture_output=True, text=True)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{cc} failed on {SOURCE.name}: {r.stderr.strip()[-800:]}")
    from blutensor import kernel_cache

    kernel_cache.seal(tmp)  # the record first, then the file: a reader never sees an unrecorded library
    os.replace(kernel_cache.digest_path(tmp), kernel_cache.digest_path(so))
    os.replace(tmp, so)
    _state["build_s"] = time.perf_counter() - t0


def _open(so: Path):
    """Load the library with OpenMP's idle threads sleeping (OMP_WAIT_POLICY=PASSIVE, read once when the OpenMP
    runtime loads) unless the user set a policy: spinning workers would take the cores from the BLAS threads of
    the GEMM that follows every kernel. The environment is restored after the load (child processes and other
    OpenMP runtimes keep their own defaults)."""
    keys = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    saved = {k: os.environ.get(k) for k in keys}
    if all(v is None for v in saved.values()):
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        return ctypes.CDLL(str(so))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _load():
    if os.environ.get("BLUTRAIN_CPU_KERNELS", "1").strip().lower() in ("0", "false", "off", "no", "reference"):
        return None, "BLUTRAIN_CPU_KERNELS=0"
    cc = _compiler()
    if cc is None:
        return None, f"no C compiler ({os.environ.get('CC', 'cc')!r} not on PATH; set CC)"
    from blutensor import kernel_cache

    try:
        so = library_path(cc)
        if not kernel_cache.verified(so):  # absent, or damaged (removed with a warning naming it): build it
            _build(cc, so)
            kernel_cache.check_stored(so)
        lib = _open(so)
    except (OSError, RuntimeError) as e:
        return None, str(e)
    for name, args in SIGNATURES.items():
        f = getattr(lib, name)
        f.argtypes = args
        f.restype = _I if name == "blu_get_num_threads" else None
    return lib, None


#: glibc mallopt parameters (malloc.h) and the values set by :func:`keep_freed_memory`
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
TRIM_THRESHOLD = 256 << 20
MMAP_THRESHOLD = 32 << 20
_MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed arrays for reuse (arrays up to ``MMAP_THRESHOLD`` from the heap, up to
    ``TRIM_THRESHOLD`` of free heap kept): with its defaults, the step's temporaries of a few MB are handed back to
    the kernel when freed and every new one page-faults on first touch, about 9,000 faults and 30 ms of kernel
    time per step of the tiny GPT-2 on two cores, more with more threads touching pages at once. Skipped when
    ``BLUTRAIN_CPU_MALLOC=0``, when the user tuned malloc (``MALLOC_*_`` variables or ``GLIBC_TUNABLES``), and
    off glibc. True when the setting was made."""
    if os.environ.get("BLUTRAIN_CPU_MALLOC", "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    if any(k in os.environ for k in _MALLOC_ENV) or "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


#: > 0 inside backends.numpy.reference_kernels(): lib() answers None (the NumPy references run)
_reference_depth = [0]


def lib():
    """The loaded kernel library (built on first call), or None when the NumPy references must run."""
    if _reference_depth[0]:
        return None
    if "lib" in _state:
        return _state["lib"]
    with _lock:
        if "lib" not in _state:
            from blutensor import threads

            threads.apply_default()  # GEMM threads limited before the first step, library or not
            _state["malloc_kept"] = keep_freed_memory()
            lib_, reason = _load()
            _state["reason"] = reason
            _state["lib"] = lib_
            if lib_ is None:
                warnings.warn(f"blutensor: compiled CPU kernels unavailable ({reason}); the NumPy reference "
                              f"kernels run instead (slower, same results within float32 rounding)",
                              RuntimeWarning, stacklevel=3)
            else:
                lib_.blu_set_num_threads(omp_threads(threads.get_num_threads()))
    return _state["lib"]


def omp_threads(n: int) -> int:
    """OpenMP threads for a setting of ``n``: 1 in a process forked after the library loaded (GNU OpenMP cannot
    restart its thread pool in a forked child: its first parallel region would hang)."""
    return 1 if _state.get("forked") else n


def _after_fork_in_child() -> None:
    lib_ = _state.get("lib")
    if lib_ is not None:
        _state["forked"] = True
        lib_.blu_set_num_threads(1)


os.register_at_fork(after_in_child=_after_fork_in_child)


def status() -> dict:
    """What :func:`lib` found: ``available``, ``reason`` (None when available), ``path``, ``build_s``, and
    ``malloc_kept`` (whether :func:`keep_freed_memory` tuned malloc)."""
    lib()
    cc = _compiler()
    return {"available": _state["lib"] is not None, "reason": _state["reason"],
            "path": str(library_path(cc)) if cc else None, "build_s": _state.get("build_s"),
            "malloc_kept": _state.get("malloc_kept", False)}


def reset() -> None:
    """Forget the loaded library (the next :func:`lib` call loads or builds again)."""
    with _lock:
        _state.clear()
