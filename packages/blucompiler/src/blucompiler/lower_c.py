"""Lowering for the CPU executor: fused kernels -> one C translation unit -> shared object (ctypes).

Compiled with the system C compiler (``cc``, or ``$CC``) at ``-O2 -ffp-contract=off`` (no fused
multiply-add, no fast-math: each operation rounds like NumPy's) and cached on disk by the hash of
the source text; a cached library is loaded only from a private directory and when it matches its SHA-256 record
(blutensor.kernel_cache), else it is rebuilt.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
from pathlib import Path

import numpy as np

from blucompiler.codegen import KernelSpec, emit, translation_unit

_CT = {"float32": ctypes.c_float, "float64": ctypes.c_double, "int64": ctypes.c_longlong,
       "int32": ctypes.c_int, "bool": ctypes.c_ubyte}
_loaded: dict[str, ctypes.CDLL] = {}


def cache_dir() -> Path:
    """$BLU_COMPILER_CACHE (default ~/.cache/blucompiler) when it is private to this user, else a private directory
    of this process, with a warning (blutensor.kernel_cache.safe_directory)."""
    from blutensor.ext import kernel_cache

    d = Path(os.environ.get("BLU_COMPILER_CACHE") or Path.home() / ".cache" / "blucompiler")
    return kernel_cache.safe_directory(d, "blucompiler kernels")


def compile_c(specs: list[KernelSpec]) -> dict:
    """Compile ``specs`` into one shared object; return {name: callable(list of args)}."""
    src = translation_unit([emit(s, "c") for s in specs], "c")
    h = hashlib.sha256(src.encode()).hexdigest()[:24]
    d = cache_dir()
    so = d / f"blu_{h}.so"
    if h not in _loaded:
        from blutensor.ext import kernel_cache

        if not kernel_cache.verified(so):  # absent, or damaged (removed with a warning naming it): build it
            c = d / f"blu_{h}.c"
            c.write_text(src)
            tmp = d / f"blu_{h}.{os.getpid()}.so"
            cc = os.environ.get("CC", "cc")
            cmd = [cc, "-O2", "-std=c11", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-o", str(tmp),
                   str(c), "-lm"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"blucompiler: C compile of {c} failed:\n{r.stderr[-4000:]}")
            kernel_cache.seal(tmp)  # the record first, then the library: no reader sees it unrecorded
            os.replace(kernel_cache.digest_path(tmp), kernel_cache.digest_path(so))
            os.replace(tmp, so)
            kernel_cache.check_stored(so)
        _loaded[h] = ctypes.CDLL(str(so))
    lib = _loaded[h]
    out = {}
    for s in specs:
        f = getattr(lib, s.name)
        types = []
        for inp in s.inputs:
            if inp.mode == "ptr":
                types.append(ctypes.c_void_p)
            elif inp.mode == "val":
                types.append(_CT[np.dtype(inp.dtype).name])
        types += [ctypes.c_void_p] * len(s.out_dtypes)
        f.argtypes = types
        f.restype = None
        out[s.name] = _caller(f, s)
    return out


def _caller(f, spec: KernelSpec):
    modes = [i.mode for i in spec.inputs if i.mode != "lit"]
    conv = [(_CT[np.dtype(i.dtype).name] if i.mode == "val" else None) for i in spec.inputs if i.mode != "lit"]

    def call(ins, outs):
        args = []
        for m, c, a in zip(modes, conv, ins):
            args.append(a.ctypes.data if m == "ptr" else c(a.item() if hasattr(a, "item") else a))
        for o in outs:
            args.append(o.ctypes.data)
        f(*args)

    return call
