"""Kernel loading: one cached ``cupy.RawModule`` per .cu file and device, compiled for that device's arch.

Local ``#include "x.cuh"`` lines are expanded here before compiling, so CuPy's on-disk cache key covers
the headers too (CuPy hashes only the source string it is given).
"""

from __future__ import annotations

import re
import threading
from functools import cache
from pathlib import Path
from typing import Any

KERNEL_DIR = Path(__file__).parent / "kernels"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
_lock = threading.Lock()
_modules: dict[tuple[str, int], Any] = {}
_functions: dict[tuple[str, int, str], Any] = {}
_smem_set: dict[tuple[str, int, str], int] = {}
_workspaces: dict[tuple[int, int], Any] = {}


def expand_source(path: Path, _seen: frozenset[Path] = frozenset()) -> str:
    """Source of ``path`` with local quoted includes inlined (each header once, recursively)."""
    text = path.read_text()

    def repl(m: re.Match) -> str:
        inc = (path.parent / m.group(1)).resolve()
        if inc in _seen:
            return ""
        if not inc.is_file():
            raise FileNotFoundError(f"{path.name}: included file {m.group(1)!r} not found in {path.parent}")
        body = re.sub(r"^\s*#\s*pragma\s+once\s*$", "", expand_source(inc, _seen | {inc}), flags=re.M)
        return f"// ---- begin {m.group(1)}\n{body}\n// ---- end {m.group(1)}\n"

    return _INCLUDE.sub(repl, text)


@cache
def _source(filename: str) -> str:
    path = KERNEL_DIR / filename
    if not path.is_file():
        raise FileNotFoundError(f"blublas kernel file {path} is missing (broken install?)")
    return expand_source(path)


_cc: dict[int, int] = {}
_sms: dict[int, int] = {}


def compute_capability(device_id: int | None = None) -> int:
    """Compute capability of a CUDA device as an int (e.g. 90); cached per device."""
    import cupy

    dev = cupy.cuda.Device(device_id) if device_id is not None else cupy.cuda.Device()
    cc = _cc.get(int(dev.id))
    if cc is None:
        cc = _cc[int(dev.id)] = int(dev.compute_capability)
    return cc


def sm_count(device_id: int | None = None) -> int:
    """Number of streaming multiprocessors of a device; cached per device (``Device.attributes`` queries every
    attribute: tens of microseconds, once per GEMM call before)."""
    import cupy

    dev = cupy.cuda.Device(device_id) if device_id is not None else cupy.cuda.Device()
    n = _sms.get(int(dev.id))
    if n is None:
        n = _sms[int(dev.id)] = int(dev.attributes["MultiProcessorCount"])
    return n


_ARCH_MARK = re.compile(r"blu-nvrtc-archs:\s*([0-9a-z ,]+)")


def arch_suffix(filename: str, cc: int) -> str:
    """'a' when ``filename`` declares an arch-specific target (e.g. 90a) for this cc, else ''."""
    m = _ARCH_MARK.search(_source(filename))
    if m and f"{cc}a" in m.group(1).replace(",", " ").split():
        return "a"
    return ""


def _nvrtc_cubin_cupy(src: str, filename: str, arch: str) -> tuple[bytes, str]:
    """Compile with the NVRTC binding CuPy itself uses (no extra dependency); (cubin, nvrtc version)."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(src, filename, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, ["-std=c++17", f"-arch=sm_{arch}"])
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(
                f"NVRTC failed to compile {filename} for sm_{arch}:\n{nvrtc.getProgramLog(prog)}"
            ) from exc
        major, minor = nvrtc.getVersion()
        return nvrtc.getCUBIN(prog), f"{major}.{minor}"
    finally:
        nvrtc.destroyProgram(prog)


def _nvrtc_cubin_bindings(src: str, filename: str, arch: str) -> tuple[bytes, str]:
    """Compile with cuda-bindings' NVRTC; (cubin, nvrtc version)."""
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    err, prog = nvrtc.nvrtcCreateProgram(src.encode(), filename.encode(), 0, [], [])
    opts = [b"-std=c++17", f"-arch=sm_{arch}".encode()]
    try:
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if res != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, n = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * n
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC failed to compile {filename} for sm_{arch}:\n{log.decode(errors='replace')}")
        _, n = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = b" " * n
        nvrtc.nvrtcGetCUBIN(prog, cubin)
        return cubin, f"{major}.{minor}"
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


_kernel_cache: Any = None  # blutensor.kernel_cache, given by the plugin host (hooks.blutrain_kernel_cache)
_private_dir: Path | None = None


def use_kernel_cache(cache: Any) -> None:
    """Verify cached cubins with ``cache`` (blutensor.kernel_cache: private directory, SHA-256 record per file).
    Without it (blublas used alone, outside the plugin host) cubins are built into a private temporary
    directory of the process and nothing is loaded from BLUBLAS_CACHE_DIR."""
    global _kernel_cache
    _kernel_cache = cache


def cubin_dir() -> Path:
    """Where arch-specific cubins are cached: BLUBLAS_CACHE_DIR/kernels (default ~/.cache/blublas/kernels) when
    blutensor's kernel-cache checks are installed and pass, else a private directory of this process."""
    import tempfile

    global _private_dir
    from . import settings

    base = settings.get().cache_dir / "kernels"
    if _kernel_cache is not None:
        return _kernel_cache.safe_directory(base, "blublas cubins")
    if _private_dir is None:
        _private_dir = Path(tempfile.mkdtemp(prefix="blublas-kernels-"))
    return _private_dir


def _cubin_with_nvrtc(filename: str, arch: str) -> Path:
    """Compile ``filename`` to a cubin for an arch-specific target such as ``90a`` (CuPy's RawModule adds
    its own -arch=sm_XX, which would drop the 'a' feature suffix), cached in :func:`cubin_dir` by source hash
    and loaded again only when it matches its SHA-256 record (a damaged cubin is rebuilt, with a warning naming
    it). Uses CuPy's NVRTC binding, else cuda-bindings'."""
    import hashlib
    import os

    src = _source(filename)
    digest = hashlib.sha256(f"{src}|sm_{arch}".encode()).hexdigest()[:24]
    base = cubin_dir()
    out = base / f"{Path(filename).stem}_sm{arch}_{digest}.cubin"
    if _kernel_cache is not None and _kernel_cache.verified(out):
        return out
    errors = []
    cubin = None
    for compiler in (_nvrtc_cubin_cupy, _nvrtc_cubin_bindings):
        try:
            cubin, _version = compiler(src, filename, arch)
            break
        except RuntimeError:
            raise  # a real compile error: report it
        except Exception as exc:  # noqa: BLE001 - binding unavailable: try the next one
            errors.append(f"{compiler.__name__}: {exc}")
    if cubin is None:
        raise RuntimeError(f"no NVRTC binding could compile {filename} for sm_{arch}: {errors}")
    base.mkdir(parents=True, exist_ok=True)
    if _kernel_cache is not None:
        _kernel_cache.store(out, cubin)
        return _kernel_cache.check_stored(out)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(cubin)
    os.replace(tmp, out)
    return out


def get_module(filename: str, device_id: int | None = None) -> Any:
    """The compiled RawModule of ``filename`` for the current (or given) device, built once."""
    import cupy

    dev = cupy.cuda.Device(device_id) if device_id is not None else cupy.cuda.Device()
    key = (filename, int(dev.id))
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                cc = int(dev.compute_capability)
                if arch_suffix(filename, cc):
                    with dev:
                        mod = cupy.RawModule(path=str(_cubin_with_nvrtc(filename, f"{cc}a")))
                    _modules[key] = mod
                    return mod
                with dev:
                    mod = cupy.RawModule(code=_source(filename), options=("-std=c++17", f"-arch=sm_{cc}"))
                    try:
                        mod.get_function(_first_kernel(filename))  # compile now, so errors name the file
                    except cupy.cuda.compiler.CompileException as exc:
                        # CuPy appends its own -arch=sm_XX; should a CuPy/NVRTC pair reject the duplicate,
                        # compile once more letting CuPy choose the (same) architecture.
                        mod = cupy.RawModule(code=_source(filename), options=("-std=c++17",))
                        try:
                            mod.get_function(_first_kernel(filename))
                        except cupy.cuda.compiler.CompileException:
                            raise RuntimeError(f"NVRTC failed to compile {filename} for sm_{cc}:\n{exc}") from exc
                _modules[key] = mod
    return mod


def _first_kernel(filename: str) -> str:
    """Name of one kernel defined by ``filename`` (used to force compilation)."""
    from .configs import ALL_CONFIGS, FILE_OF_VARIANT

    for variant, fname in FILE_OF_VARIANT.items():
        if fname == filename:
            return next(iter(ALL_CONFIGS[variant].values())).kernel_name("nn")
    m = re.search(r'extern "C" __global__ void\s+(blu_\w+)\s*\(', _source(filename))
    if not m:
        raise RuntimeError(f'no extern "C" kernel found in {filename}')
    return m.group(1)


def get_function(filename: str, name: str, smem_bytes: int = 0, device_id: int | None = None) -> Any:
    """A kernel of ``filename`` with its dynamic shared memory limit raised to ``smem_bytes`` if needed."""
    import cupy

    dev_id = int(device_id if device_id is not None else cupy.cuda.Device().id)
    key = (filename, dev_id, name)
    fn = _functions.get(key)
    if fn is None:
        try:
            fn = get_module(filename, dev_id).get_function(name)
        except Exception as exc:  # noqa: BLE001 - re-raised with the kernel name
            raise RuntimeError(f"kernel {name} not found in {filename}: {exc}") from exc
        _functions[key] = fn
    if smem_bytes > 48 * 1024 and smem_bytes > _smem_set.get(key, 0):
        fn.max_dynamic_shared_size_bytes = smem_bytes
        _smem_set[key] = smem_bytes
    return fn


def workspace_token(stream: Any = None) -> tuple | None:
    """(device, stream, pointer, size) of the current workspace of (device, stream), None if there is none: a
    recorded launch that uses the workspace stays valid only while this token is unchanged."""
    import cupy

    st = stream if stream is not None else cupy.cuda.get_current_stream()
    key = (int(cupy.cuda.Device().id), int(st.ptr))
    buf = _workspaces.get(key)
    return None if buf is None else (*key, int(buf.data.ptr), int(buf.nbytes))


def workspace(nbytes: int, stream: Any = None) -> Any:
    """A device scratch buffer of at least ``nbytes`` owned per (device, stream), grown when needed.

    Reused by every call on that stream (stream order makes reuse safe), so after one eager warm-up call
    nothing is allocated during CUDA graph capture.
    """
    import cupy

    st = stream if stream is not None else cupy.cuda.get_current_stream()
    key = (int(cupy.cuda.Device().id), int(st.ptr))
    buf = _workspaces.get(key)
    if buf is None or buf.nbytes < nbytes:
        buf = cupy.empty(max(nbytes, 1 << 20), dtype=cupy.uint8)
        _workspaces[key] = buf
    return buf
