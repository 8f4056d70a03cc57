"""The vendor provider: cuBLASLt reached through ctypes, with a handle, workspace and stream binding we own.

Why ctypes: CuPy refuses cuBLAS calls during CUDA stream capture (both cupy.matmul and its cublas bindings),
so this module loads libcublasLt itself and passes the capture stream to every cublasLtMatmul call, which
makes the provider usable inside CUDA graphs. Epilogues (bias, GELU with the pre-activation saved, beta*C)
are fused through cuBLASLt epilogues when the library accepts them, else applied by our epilogue kernel. The
backward through a GELU ('dgelu': DGELU, or DGELU_BGRAD with the bias gradient) runs fused or not at all: with no
cuBLASLt algorithm for it, EpilogueUnavailable is raised before anything is written.
Row-major C = op(A) @ op(B) is computed as column-major C^T = op(B)^T @ op(A)^T.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

from . import settings
from .errors import EpilogueUnavailable, ProviderUnavailable

# enum values from cublasLt.h / library_types.h (stable across CUDA 11-13)
CUDA_R_32F, CUDA_R_16BF = 0, 14
COMPUTE_32F, COMPUTE_32F_FAST_TF32 = 68, 77
OP_N, OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 3, 4, 7, 8
DESC_AUX_POINTER, DESC_AUX_LD, DESC_AUX_BATCH_STRIDE, DESC_BIAS_DATA_TYPE = 11, 12, 13, 26
LAYOUT_BATCH_COUNT, LAYOUT_STRIDED_BATCH_OFFSET = 5, 6
PREF_MAX_WORKSPACE_BYTES = 1
EPI_DEFAULT, EPI_BIAS, EPI_GELU, EPI_GELU_AUX, EPI_GELU_BIAS, EPI_GELU_AUX_BIAS = 1, 4, 32, 160, 36, 164
EPI_DGELU, EPI_DGELU_BGRAD = 192, 208  # DGELU = 64 | 128 (reads the aux GELU input); BGRAD = 16
#: epilogues whose aux buffer is the GELU input (written by the GELU_AUX forms, read by the DGELU forms)
EPI_WITH_AUX = (EPI_GELU_AUX, EPI_GELU_AUX_BIAS, EPI_DGELU, EPI_DGELU_BGRAD)
#: cuBLASLt's rule for a GELU aux buffer: its leading dimension and batch stride in elements are multiples of 8
AUX_LD_MULTIPLE = 8
WORKSPACE_BYTES = 32 << 20
MAX_ALGOS = 8  # heuristic candidates requested; timed once per problem (see _tune)
TUNE_MIN_FLOPS = 2e9  # smaller problems take the heuristic's first choice untimed
#: one record per tuned problem: {"key", "algos", "first_ms", "best_ms", "best_index"} (bench_gemm_configs.py
#: records how far the heuristic's first algorithm is from the best timed one)
TUNING_LOG: list[dict] = []

_STATUS = {
    0: "SUCCESS",
    1: "NOT_INITIALIZED",
    3: "ALLOC_FAILED",
    7: "INVALID_VALUE",
    8: "ARCH_MISMATCH",
    11: "MAPPING_ERROR",
    13: "EXECUTION_FAILED",
    14: "INTERNAL_ERROR",
    15: "NOT_SUPPORTED",
    16: "LICENSE_ERROR",
}


class _HeuristicResult(ctypes.Structure):
    _fields_ = [
        ("algo", ctypes.c_uint64 * 8),
        ("workspaceSize", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("wavesCount", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def _candidate_paths(major: int | None) -> list[str]:
    """Places libcublasLt may live, most specific first (env, already loaded, wheels, toolkit, system)."""
    names = [f"libcublasLt.so.{major}"] if major else []
    names += ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]
    paths: list[str] = []
    env = settings.get().cublaslt
    if env:
        paths.append(env)
    try:  # whatever CuPy (or anything else) already loaded into this process
        with open("/proc/self/maps") as f:
            for line in f:
                if "libcublasLt.so" in line:
                    paths.append(line.split()[-1])
    except OSError:
        pass
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib  # cuda-bindings' finder, if installed

        paths.append(load_nvidia_dynamic_lib("cublasLt").abs_path)
    except Exception:  # noqa: BLE001 - optional helper
        pass
    roots = [Path(p) for p in sys.path if p and "site-packages" in p]
    for root in roots:
        for sub in (
            "nvidia/cublas/lib",
            "nvidia/cu13/lib",
            "nvidia/cu12/lib",
            "cupy/.data/lib",
            "cupy_backends",
        ):
            for nm in names:
                paths += sorted(glob.glob(str(root / sub / nm)))
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    dirs = ([cuda_home] if cuda_home else []) + sorted(glob.glob("/usr/local/cuda*"), reverse=True)
    for d in dirs:
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
            for nm in names:
                paths += glob.glob(os.path.join(d, sub, nm))
    paths += names  # the dynamic loader's own search
    seen, out = set(), []
    for p in paths:
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


_lib: ctypes.CDLL | None = None
_lib_error: str | None = None
_lib_lock = threading.Lock()


def _cuda_major() -> int | None:
    try:
        import cupy

        return int(cupy.cuda.runtime.runtimeGetVersion()) // 1000
    except Exception:  # noqa: BLE001
        return None


def load_library() -> ctypes.CDLL:
    """Load libcublasLt once (the version matching CuPy's CUDA runtime when possible)."""
    global _lib, _lib_error
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        try:  # make CuPy load its own cuBLAS first so /proc/self/maps shows the matching one
            import cupy_backends.cuda.libs.cublas  # noqa: F401
        except Exception:  # noqa: BLE001
            pass
        tried = []
        for path in _candidate_paths(_cuda_major()):
            try:
                lib = ctypes.CDLL(path)
                lib.cublasLtMatmul  # noqa: B018 - symbol check
            except (OSError, AttributeError) as exc:
                tried.append(f"{path}: {exc}")
                continue
            _declare(lib)
            _lib = lib
            return lib
        _lib_error = "; ".join(tried[-6:])
        raise ProviderUnavailable(
            "libcublasLt not found (set BLUBLAS_CUBLASLT=/path/libcublasLt.so.N); tried: " + _lib_error
        )


def _declare(lib: ctypes.CDLL) -> None:
    vp, i32, sz, u64, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int64
    pvp = ctypes.POINTER(ctypes.c_void_p)
    sigs = {
        "cublasLtCreate": [pvp],
        "cublasLtDestroy": [vp],
        "cublasLtMatmulDescCreate": [pvp, i32, i32],
        "cublasLtMatmulDescDestroy": [vp],
        "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatrixLayoutCreate": [pvp, i32, u64, u64, i64],
        "cublasLtMatrixLayoutDestroy": [vp],
        "cublasLtMatrixLayoutSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatmulPreferenceCreate": [pvp],
        "cublasLtMatmulPreferenceDestroy": [vp],
        "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatmulAlgoGetHeuristic": [
            vp,
            vp,
            vp,
            vp,
            vp,
            vp,
            vp,
            i32,
            ctypes.POINTER(_HeuristicResult),
            ctypes.POINTER(i32),
        ],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = i32


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed: CUBLAS_STATUS_{_STATUS.get(status, status)}")


def is_available() -> bool:
    """True when CuPy sees a GPU and libcublasLt loads."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return False
        load_library()
        return True
    except Exception:  # noqa: BLE001
        return False


class _DeviceState:
    """Per-device handle and workspace (created outside capture, reused by every call)."""

    def __init__(self, device_id: int):
        import cupy

        lib = load_library()
        self.lib = lib
        self.handle = ctypes.c_void_p()
        with cupy.cuda.Device(device_id):
            _check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.algos: dict[tuple, tuple[bytes, int] | None] = {}


_states: dict[int, _DeviceState] = {}


def _state(device_id: int) -> _DeviceState:
    st = _states.get(device_id)
    if st is None:
        st = _states[device_id] = _DeviceState(device_id)
    return st


class _Descs:
    """Owns the cuBLASLt descriptors of one call; destroyed on exit."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self.layouts: list[ctypes.c_void_p] = []
        self.desc = ctypes.c_void_p()
        self.pref = ctypes.c_void_p()

    def layout(self, dtype: int, rows: int, cols: int, ld: int, batch: int, stride: int) -> ctypes.c_void_p:
        lay = ctypes.c_void_p()
        _check(
            self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, rows, cols, ld),
            "MatrixLayoutCreate",
        )
        self.layouts.append(lay)
        if batch > 1:
            cnt, off = ctypes.c_int32(batch), ctypes.c_int64(stride)
            _check(
                self.lib.cublasLtMatrixLayoutSetAttribute(lay, LAYOUT_BATCH_COUNT, ctypes.byref(cnt), 4),
                "layout batch count",
            )
            _check(
                self.lib.cublasLtMatrixLayoutSetAttribute(lay, LAYOUT_STRIDED_BATCH_OFFSET, ctypes.byref(off), 8),
                "layout batch stride",
            )
        return lay

    def set_desc(self, attr: int, value: Any) -> None:
        _check(
            self.lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
            f"MatmulDescSetAttribute({attr})",
        )

    def __enter__(self) -> _Descs:
        return self

    def __exit__(self, *exc: Any) -> None:
        for lay in self.layouts:
            self.lib.cublasLtMatrixLayoutDestroy(lay)
        if self.desc:
            self.lib.cublasLtMatmulDescDestroy(self.desc)
        if self.pref:
            self.lib.cublasLtMatmulPreferenceDestroy(self.pref)


def _matmul(p: Any, st: _DeviceState, stream: Any, fuse: bool) -> bool:
    """One cublasLtMatmul for p; with ``fuse`` the epilogue is fused. False when no algorithm fits."""
    lib = st.lib
    stream_ptr = int(stream.ptr)
    in_t = CUDA_R_16BF if p.precision == "bf16" else CUDA_R_32F
    out_t = CUDA_R_16BF if p.out_tag == "bf16" else CUDA_R_32F
    compute = COMPUTE_32F_FAST_TF32 if p.precision == "tf32" else COMPUTE_32F
    epi = EPI_DEFAULT
    if fuse and p.dgelu:
        epi = EPI_DGELU_BGRAD if p.bias_grad is not None else EPI_DGELU
    elif fuse:
        has_b, aux = p.bias is not None, p.preact is not None
        if p.gelu:
            epi = (EPI_GELU_AUX_BIAS if has_b else EPI_GELU_AUX) if aux else (EPI_GELU_BIAS if has_b else EPI_GELU)
        elif has_b:
            epi = EPI_BIAS
    batch = p.batch
    aux_info, aux_arr = (p.X, p.aux) if p.dgelu else (p.P, p.preact)
    if epi in EPI_WITH_AUX and (aux_info.ld % AUX_LD_MULTIPLE or (batch > 1 and aux_info.bstride % AUX_LD_MULTIPLE)):
        return False  # cuBLASLt documents no GELU aux buffer of this leading dimension
    with _Descs(lib) as d:
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(d.desc), compute, CUDA_R_32F), "MatmulDescCreate")
        d.set_desc(DESC_TRANSA, ctypes.c_int32(OP_T if p.trans_b else OP_N))
        d.set_desc(DESC_TRANSB, ctypes.c_int32(OP_T if p.trans_a else OP_N))
        d.set_desc(DESC_EPILOGUE, ctypes.c_int32(epi))
        if epi in (EPI_BIAS, EPI_GELU_BIAS, EPI_GELU_AUX_BIAS):
            d.set_desc(DESC_BIAS_POINTER, ctypes.c_void_p(int(p.bias.data.ptr)))
            d.set_desc(DESC_BIAS_DATA_TYPE, ctypes.c_int32(CUDA_R_16BF if p.bias_tag == "bf16" else CUDA_R_32F))
        if epi == EPI_DGELU_BGRAD:  # the bias gradient goes where a bias would come from, always float32
            d.set_desc(DESC_BIAS_POINTER, ctypes.c_void_p(int(p.bias_grad.data.ptr)))
            d.set_desc(DESC_BIAS_DATA_TYPE, ctypes.c_int32(CUDA_R_32F))
        if epi in EPI_WITH_AUX:
            d.set_desc(DESC_AUX_POINTER, ctypes.c_void_p(int(aux_arr.data.ptr)))
            d.set_desc(DESC_AUX_LD, ctypes.c_int64(aux_info.ld))
            if batch > 1:
                d.set_desc(DESC_AUX_BATCH_STRIDE, ctypes.c_int64(aux_info.bstride))
        # column-major view: X = B buffer (m=N), Y = A buffer (n=M)
        xa = d.layout(
            in_t,
            p.K if p.trans_b else p.N,
            p.N if p.trans_b else p.K,
            p.B.ld,
            batch,
            p.B.bstride if p.B.batch else 0,
        )
        ya = d.layout(
            in_t,
            p.M if p.trans_a else p.K,
            p.K if p.trans_a else p.M,
            p.A.ld,
            batch,
            p.A.bstride if p.A.batch else 0,
        )
        cd = d.layout(out_t, p.N, p.M, p.C.ld, batch, p.C.bstride)
        key = (
            p.precision,
            p.out_tag,
            p.layout,
            p.M,
            p.N,
            p.K,
            batch,
            epi,
            p.bias_tag,
            p.A.ld,
            p.B.ld,
            p.C.ld,
            p.A.bstride,
            p.B.bstride,
            p.C.bstride,
            aux_info.ld if aux_info else 0,
            tuple(x % 16 for x in (p.A.ptr, p.B.ptr, p.C.ptr)),
            p.beta != 0.0,
        )
        if epi in EPI_WITH_AUX or epi == EPI_DGELU_BGRAD:  # the heuristic reads these pointers' alignment too
            key += tuple(int(x.data.ptr) % 16 for x in (aux_arr, p.bias_grad) if x is not None)
        ws_buf = None

        def call(algo_bytes: bytes) -> None:
            nonlocal ws_buf
            from .loader import workspace

            if ws_buf is None:  # per (device, stream): concurrent streams never share it
                ws_buf = workspace(WORKSPACE_BYTES, stream)
            algo = (ctypes.c_uint64 * 8).from_buffer_copy(algo_bytes)
            alpha, beta = ctypes.c_float(p.alpha), ctypes.c_float(p.beta)
            cptr = ctypes.c_void_p(int(p.out.data.ptr))
            _check(
                lib.cublasLtMatmul(
                    st.handle,
                    d.desc,
                    ctypes.byref(alpha),
                    ctypes.c_void_p(p.B.ptr),
                    xa,
                    ctypes.c_void_p(p.A.ptr),
                    ya,
                    ctypes.byref(beta),
                    cptr,
                    cd,
                    cptr,
                    cd,
                    ctypes.byref(algo),
                    ctypes.c_void_p(int(ws_buf.data.ptr)),
                    WORKSPACE_BYTES,
                    ctypes.c_void_p(stream_ptr),
                ),
                "cublasLtMatmul",
            )

        found = st.algos.get(key, False)
        if found is False:
            _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(d.pref)), "PreferenceCreate")
            ws = ctypes.c_size_t(WORKSPACE_BYTES)
            _check(
                lib.cublasLtMatmulPreferenceSetAttribute(d.pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
                "PreferenceSetAttribute",
            )
            res = (_HeuristicResult * MAX_ALGOS)()
            n = ctypes.c_int(0)
            status = lib.cublasLtMatmulAlgoGetHeuristic(
                st.handle, d.desc, xa, ya, cd, cd, d.pref, MAX_ALGOS, res, ctypes.byref(n)
            )
            algos = [bytes(res[i].algo) for i in range(n.value) if res[i].state == 0] if status == 0 else []
            if not algos:
                st.algos[key] = None
                return False
            capturing = _is_capturing(stream)
            flops = 2.0 * p.M * p.N * p.K * batch
            if len(algos) > 1 and not capturing and tune_enabled() and flops >= TUNE_MIN_FLOPS:
                found = _tune(p, algos, call, stream, key)
            else:
                found = algos[0]
            if not capturing:  # during capture: the heuristic's first choice, tuned on the next eager call
                st.algos[key] = found
        if found is None:
            return False
        call(found)
    return True


def tune_enabled() -> bool:
    """BLUBLAS_CUBLASLT_TUNE (default on): time cuBLASLt's top heuristic algorithms once per problem."""
    return settings.get().cublaslt_tune


def _is_capturing(stream: Any) -> bool:
    try:
        return bool(stream.is_capturing())
    except Exception:  # noqa: BLE001 - older CuPy: assume not capturing
        return False


def _tune(p: Any, algos: list[bytes], call: Any, stream: Any, key: tuple) -> bytes:
    """Time each algorithm (1 warm-up, median of 3, CUDA events) and return the fastest. The output (and
    pre-activation) are rewritten by the real call that follows; with beta != 0 the output is restored."""
    import cupy

    snapshot = p.out.copy() if p.beta != 0.0 else None
    times = []
    with stream:
        for alg in algos:
            try:
                call(alg)
                ts = []
                for _ in range(3):
                    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
                    e0.record(stream)
                    call(alg)
                    e1.record(stream)
                    e1.synchronize()
                    ts.append(cupy.cuda.get_elapsed_time(e0, e1))
                times.append(sorted(ts)[1])
            except RuntimeError:
                times.append(float("inf"))
        if snapshot is not None:
            p.out[...] = snapshot
    best = min(range(len(algos)), key=lambda i: times[i])
    if times[best] == float("inf"):
        return algos[0]
    TUNING_LOG.append(
        {"key": list(key[:7]), "algos": len(algos), "first_ms": times[0], "best_ms": times[best], "best_index": best}
    )
    return algos[best]


def run_cublas(p: Any, stream: Any = None) -> None:
    """Compute a validated Problem with cuBLASLt on ``stream`` (default: current); capture-safe."""
    import cupy

    with cupy.cuda.Device(p.device_id):
        st = _state(p.device_id)
        s = stream if stream is not None else cupy.cuda.get_current_stream()
        if p.dgelu:
            _run_dgelu(p, st, s)
            return
        has_epi = p.bias is not None or p.gelu
        try:
            if _matmul(p, st, s, fuse=True):
                return
        except RuntimeError:
            if not has_epi:
                raise
        if not has_epi or not _matmul(p, st, s, fuse=False):
            raise RuntimeError(
                f"cuBLASLt has no algorithm for {p.layout} {p.M}x{p.N}x{p.K} batch {p.batch} precision "
                f"{p.precision} (out {p.out_tag}); use provider='blublas'"
            )
        from . import launch, loader

        flags = launch.epilogue_flags(p) & ~launch.F_BETA
        fn = loader.get_function(launch.EPILOGUE_FILE, "blu_gemm_epilogue_apply")
        total = p.batch * p.M * p.N
        blocks = int(max(1, min(-(-total // 256), loader.sm_count() * 16)))
        with s:
            fn(
                (blocks,),
                (256,),
                (
                    np.uint64(int(p.out.data.ptr)),
                    np.uint64(int(p.bias.data.ptr) if p.bias is not None else 0),
                    np.uint64(int(p.preact.data.ptr) if p.preact is not None else 0),
                    np.int32(p.M),
                    np.int32(p.N),
                    np.int32(p.batch),
                    np.int64(p.C.ld),
                    np.int64(p.P.ld if p.P else p.N),
                    np.int64(p.C.bstride),
                    np.int64(p.P.bstride if p.P else 0),
                    np.int32(flags),
                ),
            )


def _run_dgelu(p: Any, st: _DeviceState, stream: Any) -> None:
    """The 'dgelu' epilogue fused (DGELU, or DGELU_BGRAD writing the bias gradient), or EpilogueUnavailable before
    anything is written: there is no unfused form here (its caller computes the product and the GELU derivative
    separately, as it would without this epilogue)."""
    name = "DGELU_BGRAD" if p.bias_grad is not None else "DGELU"
    try:
        ok = _matmul(p, st, stream, fuse=True)
    except RuntimeError as exc:  # an attribute or a launch refused by cuBLASLt: nothing ran
        raise EpilogueUnavailable(f"cuBLASLt refused the {name} epilogue for {p.layout} {p.M}x{p.N}x{p.K} "
                                  f"precision {p.precision} (out {p.out_tag}): {exc}") from exc
    if not ok:
        raise EpilogueUnavailable(
            f"cuBLASLt has no {name} algorithm for {p.layout} {p.M}x{p.N}x{p.K} precision {p.precision} (out "
            f"{p.out_tag}, aux leading dimension {p.X.ld}); nothing was written"
        )
