"""Kernel loading: ONE cached ``cupy.RawModule`` per ``kernels/<file>.cu`` and device, built for the
device's own architecture (``-arch=sm_XY``); CuPy is imported lazily, on the first launch."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import numpy as np

from blutensor.errors import BluTensorError

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
NULL = np.uint64(0)  # null pointer argument

_modules: dict[tuple[str, int], object] = {}
_functions: dict[tuple[str, int, str], object] = {}
_sms: dict[int, int] = {}


def cupy():
    """CuPy, imported on first use (never at blutensor import time)."""
    import cupy as cp

    return cp


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.M)
_HEADER_NOTE = re.compile(r"\A(?://[^\n]*\n)*")  # a header's leading comment lines


def source(file: str) -> str:
    """The text NVRTC compiles for ``kernels/<file>``: quoted local includes inlined (each header once, its
    leading comment dropped), so CuPy's on-disk cache key (a hash of this text) covers the headers too."""
    path = KERNEL_DIR / file
    if not path.is_file():
        raise BluTensorError(f"CUDA kernel source {path} is missing from the blutensor package")
    seen: set[str] = set()

    def inline(m: re.Match) -> str:
        name = m.group(1)
        hdr = KERNEL_DIR / name
        if name in seen:
            return ""
        if not hdr.is_file():
            raise BluTensorError(f"kernels/{file} includes {name!r}, which is not in {KERNEL_DIR}")
        seen.add(name)
        return _INCLUDE.sub(inline, _HEADER_NOTE.sub("", hdr.read_text(), count=1)).rstrip("\n")

    return _INCLUDE.sub(inline, path.read_text())


def compile_options(cc: str) -> tuple[str, ...]:
    """NVRTC options for compute capability ``cc`` (e.g. '90')."""
    return ("-std=c++17", f"-arch=sm_{cc}")


def kernel_cache_dir() -> Path:
    """The directory CuPy loads compiled kernels from: $CUPY_CACHE_DIR, else ~/.cupy/kernel_cache."""
    return Path(os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache")


def kernel_cache_problem(directory: str | os.PathLike | None = None) -> str | None:
    """Why compiled kernels must not be loaded from CuPy's cache ``directory`` (None when it is safe): see
    :func:`blutensor.kernel_cache.cache_problem` (CuPy itself checks each cached file against the hash it stores)."""
    from blutensor.kernel_cache import cache_problem

    return cache_problem(directory if directory is not None else kernel_cache_dir())


_cache_checked: dict[str, bool] = {}


def guard_kernel_cache() -> bool:
    """Check the kernel cache once per directory before the first compile: when it is unsafe (see
    kernel_cache_problem), warn and make CuPy compile in memory (CUPY_CACHE_IN_MEMORY=1), so nothing is loaded
    from it. Returns True when the on-disk cache is used."""
    d = str(kernel_cache_dir())
    if d not in _cache_checked:
        why = kernel_cache_problem(d)
        if why is not None:
            warnings.warn(f"blutensor: not loading compiled CUDA kernels from the shared cache: {why}; compiling "
                          "in memory instead (give this user a private CUPY_CACHE_DIR to keep the cache)",
                          RuntimeWarning, stacklevel=3)
            os.environ["CUPY_CACHE_IN_MEMORY"] = "1"
        _cache_checked[d] = why is None
    return _cache_checked[d]


_ARCH_MARK = re.compile(r"blu-nvrtc-archs:\s*([0-9a-z ,]+)")


def arch_target(file: str, cc: str) -> str:
    """``cc`` + 'a' when ``kernels/<file>`` declares that arch-specific target (``blu-nvrtc-archs: 90a``: wgmma,
    setmaxnreg), else ``cc``."""
    m = _ARCH_MARK.search(source(file))
    if m and f"{cc}a" in m.group(1).replace(",", " ").split():
        return f"{cc}a"
    return cc


def _cubin(code: str, file: str, arch: str) -> bytes:
    """NVRTC (the binding CuPy uses) compiles ``code`` to a cubin for sm_``arch`` (CuPy's RawModule appends its
    own -arch=sm_XX, which would drop an 'a' feature suffix)."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(code, file, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, ["-std=c++17", f"-arch=sm_{arch}"])
        except nvrtc.NVRTCError as exc:
            raise BluTensorError(f"kernels/{file}: NVRTC failed for sm_{arch}:\n{nvrtc.getProgramLog(prog)}") from exc
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


def _arch_module(code: str, file: str, arch: str):
    """RawModule of an arch-specific cubin, cached on disk by source hash in the kernel cache directory when
    that is safe (guard_kernel_cache), else in a private temporary directory for this process."""
    import hashlib
    import tempfile

    cp = cupy()
    digest = hashlib.sha256(f"{code}|sm_{arch}".encode()).hexdigest()[:24]
    base = kernel_cache_dir() if guard_kernel_cache() else None
    if base is None:
        base = Path(_private_dir.setdefault("d", tempfile.mkdtemp(prefix="blutensor-cubin-")))
    out = base / f"blutensor_{Path(file).stem}_sm{arch}_{digest}.cubin"
    if not out.is_file():
        base.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(_cubin(code, file, arch))
        os.replace(tmp, out)
    return cp.RawModule(path=str(out))


_private_dir: dict[str, str] = {}


def module(file: str):
    """The RawModule of ``kernels/<file>`` on the current device (compiled once, then cached)."""
    cp = cupy()
    guard_kernel_cache()  # a cubin planted in a shared cache directory is never loaded
    dev = cp.cuda.runtime.getDevice()
    key = (file, dev)
    mod = _modules.get(key)
    if mod is None:
        code = source(file)
        cc = cp.cuda.Device(dev).compute_capability
        arch = arch_target(file, cc)
        if arch != cc:
            mod = _arch_module(code, file, arch)
        else:
            mod = cp.RawModule(code=code, options=compile_options(cc))
        _modules[key] = mod
    return mod


def function(file: str, name: str):
    """Entry point ``name`` of ``kernels/<file>`` on the current device (cached)."""
    cp = cupy()
    dev = cp.cuda.runtime.getDevice()
    key = (file, dev, name)
    fn = _functions.get(key)
    if fn is None:
        try:
            fn = module(file).get_function(name)
        except Exception as e:  # CompileException names the line; add the file
            _modules.pop((file, dev), None)
            raise BluTensorError(f"kernels/{file}: cannot build/load {name}: {e}") from e
        _functions[key] = fn
    return fn


def num_sms() -> int:
    """Multiprocessor count of the current device (cached)."""
    cp = cupy()
    dev = cp.cuda.runtime.getDevice()
    n = _sms.get(dev)
    if n is None:
        n = _sms[dev] = int(cp.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"])
    return n


_optin: dict[int, int] = {}


def smem_optin() -> int:
    """Largest dynamic shared memory a block may opt in to on the current device (bytes, cached)."""
    cp = cupy()
    dev = cp.cuda.runtime.getDevice()
    n = _optin.get(dev)
    if n is None:
        props = cp.cuda.runtime.getDeviceProperties(dev)
        n = _optin[dev] = int(props.get("sharedMemPerBlockOptin", props.get("sharedMemPerBlock", 48 * 1024)))
    return n


def launch(file: str, name: str, grid, block, args, shared_mem: int = 0) -> None:
    """Launch ``name`` from ``kernels/<file>`` on the current stream."""
    fn = function(file, name)
    if shared_mem > 48 * 1024:
        _raise_smem_limit(fn, file, name, shared_mem)
    grid = grid if isinstance(grid, tuple) else (grid,)
    block = block if isinstance(block, tuple) else (block,)
    fn(grid, block, args, shared_mem=shared_mem)


_smem_set: dict[tuple[str, int, str], int] = {}
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def _raise_smem_limit(fn, file: str, name: str, nbytes: int) -> None:
    """Opt the kernel in to more than 48 KiB of dynamic shared memory (once per size and device)."""
    cp = cupy()
    dev = cp.cuda.runtime.getDevice()
    key = (file, dev, name)
    if _smem_set.get(key, 0) >= nbytes:
        return
    limit = smem_optin()
    if nbytes > limit:
        raise BluTensorError(
            f"kernels/{file}:{name} needs {nbytes} bytes of shared memory per block; this device allows {limit}"
        )
    if hasattr(fn, "max_dynamic_shared_size_bytes"):
        fn.max_dynamic_shared_size_bytes = nbytes
    else:
        cp.cuda.driver.funcSetAttribute(fn.ptr, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
    _smem_set[key] = nbytes


def suffix(arr) -> str:
    """Kernel name suffix for a storage array: 'bf16' (raw uint16 bits) or 'f32'."""
    return "bf16" if arr.dtype == np.uint16 else "f32"


def aligned16(*arrays) -> bool:
    """True when every (non-None) array starts on a 16-byte boundary (CuPy arrays; NumPy ones by their address,
    as the fake device's launches pass them)."""
    return all(a is None or _address(a) % 16 == 0 for a in arrays)


def _address(a) -> int:
    data = a.data
    return data.ptr if hasattr(data, "ptr") else a.ctypes.data


def ptr(a):
    """Kernel argument for an optional array: the array itself, or a null pointer."""
    return NULL if a is None else a


def capturing() -> bool:
    """True while the current CUDA stream is capturing a graph."""
    cp = cupy()
    try:
        return bool(cp.cuda.get_current_stream().is_capturing())
    except Exception:  # older CuPy or no stream support: assume not capturing
        return False


def first_bad_index(idx, lo: int, hi: int, allowed=None, what: str = "index"):
    """The first element of ``idx`` outside [lo, hi) (and != ``allowed``), or None.

    Lazy mode (default) never syncs: it records a bad index on device and returns None; 'sync' mode (and
    only it) waits for the GPU."""
    from blutensor.backends.cupy import index_check

    m = index_check.mode()
    if m == "off" or idx.size == 0:
        return None
    if m == "lazy" or capturing():
        index_check.check_async(idx, lo, hi, what, allowed)
        return None
    cp = cupy()
    bad = (idx < lo) | (idx >= hi)
    if allowed is not None:
        bad &= idx != allowed
    if not bool(bad.any()):  # the one host sync on the good path ('sync' mode only)
        return None
    return int(idx[int(cp.argmax(bad))])
