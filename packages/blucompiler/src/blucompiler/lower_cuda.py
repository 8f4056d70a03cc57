"""Lowering for CUDA: fused kernels -> CUDA C++ -> NVRTC for the device's architecture.

Kernels are compiled in chunks (parallel NVRTC calls) and cached on disk by the hash of the source (loaded again
only when they match their SHA-256 record, from a private directory: blutensor.kernel_cache):
with ``cuda.bindings.nvrtc`` available the cubin itself is cached under the cache directory and
loaded with ``cupy.RawModule(path=...)``; otherwise ``cupy.RawModule(code=...)`` compiles (CuPy keeps
its own content-hash cache). Kernels launch on the live CuPy arrays' memory: no copies.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from blucompiler.codegen import KernelSpec, cols_plan, ctype, emit, translation_unit
from blucompiler.lower_c import cache_dir

CHUNK = 24
BLOCK = 256
_modules: dict = {}


def arch() -> str:
    import cupy

    return cupy.cuda.Device().compute_capability


def _nvrtc_cubin(src: str, name: str, cc: str) -> bytes | None:
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        try:
            from cuda import nvrtc  # older cuda-python layout
        except ImportError:
            return None
    err, prog = nvrtc.nvrtcCreateProgram(src.encode(), name.encode(), 0, [], [])
    if int(err) != 0:
        return None
    opts = [b"-std=c++17", f"-arch=sm_{cc}".encode()]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if int(err) != 0:
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * n
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"blucompiler: NVRTC failed for {name}:\n{log.decode(errors='replace')[-4000:]}")
    err, n = nvrtc.nvrtcGetCUBINSize(prog)
    if int(err) != 0:
        return None
    buf = b" " * n
    nvrtc.nvrtcGetCUBIN(prog, buf)
    nvrtc.nvrtcDestroyProgram(prog)
    return buf


def _module(src: str, cc: str):
    import cupy

    h = hashlib.sha256((src + cc).encode()).hexdigest()[:24]
    mod = _modules.get(h)
    if mod is not None:
        return mod
    from blutensor.ext import kernel_cache

    d = cache_dir()
    cubin = d / f"blu_{h}.sm{cc}.cubin"
    if not kernel_cache.verified(cubin):  # absent, or damaged (removed with a warning naming it): build it
        (d / f"blu_{h}.cu").write_text(src)
        try:
            data = _nvrtc_cubin(src, f"blu_{h}.cu", cc)
        except Exception:  # noqa: BLE001 - cuda-python missing/mismatched: CuPy compiles (and reports errors)
            data = None
        if data is not None:
            kernel_cache.store(cubin, data)
            kernel_cache.check_stored(cubin)
    mod = None
    if cubin.exists():
        try:
            mod = cupy.RawModule(path=str(cubin))
            mod.get_function(_first_kernel(src))  # loads the cubin now, not at the first launch
        except Exception:  # noqa: BLE001 - an unloadable cubin: let CuPy compile the source
            mod = None
    if mod is None:
        mod = cupy.RawModule(code=src, options=("-std=c++17", f"-arch=sm_{cc}"))
        mod.get_function(_first_kernel(src))  # compile here (in the worker thread), not at the first launch
    _modules[h] = mod
    return mod


def _first_kernel(src: str) -> str:
    i = src.index("__global__ void ") + len("__global__ void ")
    return src[i:src.index("(", i)]


def compile_cuda(specs: list[KernelSpec]) -> dict:
    """Compile ``specs`` (chunked, in parallel); return {name: callable(ins, outs)}."""
    cc = arch()
    chunks = [specs[i:i + CHUNK] for i in range(0, len(specs), CHUNK)]
    srcs = [translation_unit([emit(s, "cuda") for s in ch], "cuda") for ch in chunks]
    with ThreadPoolExecutor(max_workers=16) as ex:
        mods = list(ex.map(lambda s: _module(s, cc), srcs))
    out = {}
    for ch, mod in zip(chunks, mods):
        for s in ch:
            plan = cols_plan(s)
            if plan is not None:
                fin = mod.get_function(s.name + "_fin") if plan[0] > 1 else None
                out[s.name] = _cols_launcher(mod.get_function(s.name), fin, s, plan)
            else:
                out[s.name] = _launcher(mod.get_function(s.name), s)
    return out


_ACC_NP = {"double": np.float64, "float": np.float32, "blu_i64": np.int64, "blu_i32": np.int32}


def _cols_launcher(fn, fin, spec: KernelSpec, plan):
    """Two-phase column reduction: partials per row chunk, then a fixed-order combine."""
    import cupy

    splits, _ = plan
    red = spec.ops[-1]
    nred = int(np.prod([spec.domain[d] for d in red.attrs["axes"]], dtype=np.int64))
    nout = int(np.prod(spec.domain, dtype=np.int64)) // max(nred, 1)
    src = cupy_src_dtype(spec)
    acc = _ACC_NP[_acc_ctype(red, src)]
    grid, block = ((nout + 31) // 32, splits), (32, 8)
    fgrid = (max(1, min((nout + 255) // 256, 1 << 16)),)
    modes = [i for i in spec.inputs if i.mode != "lit"]
    conv = [np.dtype(i.dtype).type if i.mode == "val" else None for i in modes]

    def call(ins, outs):
        args = tuple(c(a) if c is not None else a for c, a in zip(conv, ins))
        if fin is None:
            fn(grid, block, args + tuple(outs))
            return
        part = cupy.empty(splits * nout, dtype=acc)
        fn(grid, block, args + tuple(outs) + (part,))  # phase 1 signature: inputs, out0 (unused), part
        fin(fgrid, (256,), (part, outs[0]))

    return call


def cupy_src_dtype(spec: KernelSpec):
    red = spec.ops[-1]
    a = red.args[0]
    return spec.inputs[a[1]].dtype if a[0] == "in" else spec.ops[a[1]].dtype


def _acc_ctype(red, src_dt) -> str:
    """The accumulator C type codegen picks for reduction ``red`` (kept in step with codegen.emit)."""
    k = red.attrs["kind"]
    if k in ("sum", "mean"):
        return "double" if np.dtype(red.dtype).kind == "f" else "blu_i64"
    if np.dtype(src_dt).kind == "b":
        return "blu_i32"
    return ctype(src_dt)


def _launcher(fn, spec: KernelSpec):
    modes = [i for i in spec.inputs if i.mode != "lit"]
    if spec.kind == "elementwise":
        n = int(np.prod(spec.domain, dtype=np.int64))
        grid, block = (max(1, min((n + BLOCK - 1) // BLOCK, 1 << 20)),), (BLOCK,)
    else:
        red = spec.ops[-1]
        nred = int(np.prod([spec.domain[d] for d in red.attrs["axes"]], dtype=np.int64))
        nout = int(np.prod(spec.domain, dtype=np.int64)) // max(nred, 1)
        threads = 256 if nred >= 256 else (128 if nred >= 128 else 64 if nred >= 64 else 32)
        grid, block = (max(1, min(nout, 1 << 20)),), (threads,)
    conv = [np.dtype(i.dtype).type if i.mode == "val" else None for i in modes]

    def call(ins, outs):
        args = [c(a) if c is not None else a for c, a in zip(conv, ins)]
        fn(grid, block, tuple(args) + tuple(outs))

    return call
