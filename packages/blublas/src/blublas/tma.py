"""Host-side TMA tensor maps (CUtensorMap) for the sm_90a kernels (kernels/gemm_wgmma.cuh).

Each GEMM operand is described as a 3-D tensor (contiguous columns, rows, batch) with a box of one 128-byte
swizzled tile row set: the box's inner extent is 128 bytes (64 bf16 or 32 fp32, the 128-byte swizzle span,
which the kernels' wgmma descriptors assume) and its outer extent is the tile's rows (K-major operands:
BM or BN rows; M/N-major operands: BK k rows of one 64-column atom). The driver encodes the 128-byte opaque
map (``cuTensorMapEncodeTiled`` through ctypes on libcuda); it is passed by value as a
``__grid_constant__`` kernel parameter (a one-element NumPy array of a 128-byte structured dtype: CuPy passes
size-one NumPy arrays by value), so a launch needs no device memory and stays capture-safe. Encoded maps are
cached per (pointer, shape, strides, box).
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

import numpy as np

from .errors import GemmError

# CUtensorMapDataType / Swizzle / L2promotion / FloatOOBfill / Interleave values (cuda.h)
DTYPE_BF16 = 9
DTYPE_F32 = 7
SWIZZLE_128B = 3
L2_PROMOTION_256B = 3
OOB_FILL_ZERO = 0
INTERLEAVE_NONE = 0
SWIZZLE_SPAN = 128  # bytes: the box's inner extent and the smem row of the wgmma descriptors

#: the 128-byte kernel parameter (CuPy passes one-element NumPy arrays by value, any dtype)
TMAP_DTYPE = np.dtype([("opaque", np.uint64, (16,))])


@dataclass(frozen=True)
class TmapSpec:
    """Arguments of one cuTensorMapEncodeTiled call (rank 3: inner, outer, batch)."""

    dtype: int
    itemsize: int
    ptr: int
    dims: tuple[int, int, int]  # elements: columns (contiguous), rows, batch entries
    strides: tuple[int, int]  # bytes: between rows, between batch entries
    box: tuple[int, int, int]  # elements per box along each dim


def operand_spec(
    ptr: int, rows: int, cols: int, ld: int, batch: int, bstride: int, itemsize: int, box_outer: int
) -> TmapSpec:
    """The map of one stored operand (rows x cols, leading dimension ``ld``, ``batch`` entries ``bstride``
    elements apart, 0 = shared) whose boxes are 128 bytes of columns by ``box_outer`` rows."""
    nb = max(batch, 1)
    row_bytes = ld * itemsize
    bs = bstride * itemsize if batch > 0 else row_bytes * max(rows, 1)
    dtype = DTYPE_BF16 if itemsize == 2 else DTYPE_F32
    return TmapSpec(dtype, itemsize, ptr, (cols, rows, nb), (row_bytes, bs), (SWIZZLE_SPAN // itemsize, box_outer, 1))


def check_spec(spec: TmapSpec, name: str) -> None:
    """Raise GemmError naming ``name`` when the driver would reject ``spec`` (cuTensorMapEncodeTiled rules)."""
    why = spec_problem(spec)
    if why:
        raise GemmError(f"{name}: cannot be read by TMA ({why}); the mma.sync kernels handle such operands")


def spec_problem(spec: TmapSpec) -> str:
    """'' when ``spec`` satisfies the driver's requirements for tiled maps with 128-byte swizzle, else why not."""
    if spec.ptr % 16:
        return f"base address 0x{spec.ptr:x} is not 16-byte aligned"
    if any(d < 1 or d > 2**32 for d in spec.dims):
        return f"dimensions {spec.dims} must lie in [1, 2^32]"
    for s in spec.strides:
        if s % 16 or s <= 0 or s >= 2**40:
            return f"byte strides {spec.strides} must be positive multiples of 16 below 2^40"
    if spec.strides[0] < spec.dims[0] * spec.itemsize:
        return f"row stride {spec.strides[0]} B is shorter than a row of {spec.dims[0]} elements"
    if spec.dims[2] > 1 and spec.strides[1] < spec.strides[0] * spec.dims[1]:
        return f"batch stride {spec.strides[1]} B overlaps the {spec.dims[1]} rows of a batch entry"
    if any(b < 1 or b > 256 for b in spec.box) or spec.box[0] * spec.itemsize != SWIZZLE_SPAN:
        return f"box {spec.box} must have a 128-byte inner extent and at most 256 elements per dimension"
    return ""


_CUDA = None


def _libcuda():
    global _CUDA
    if _CUDA is None:
        lib = ctypes.CDLL("libcuda.so.1" if sys.platform != "win32" else "nvcuda.dll")
        fn = lib.cuTensorMapEncodeTiled
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.c_void_p,  # CUtensorMap*
            ctypes.c_int,  # dtype
            ctypes.c_uint32,  # rank
            ctypes.c_void_p,  # global address
            ctypes.POINTER(ctypes.c_uint64),  # globalDim
            ctypes.POINTER(ctypes.c_uint64),  # globalStrides (rank - 1)
            ctypes.POINTER(ctypes.c_uint32),  # boxDim
            ctypes.POINTER(ctypes.c_uint32),  # elementStrides
            ctypes.c_int,  # interleave
            ctypes.c_int,  # swizzle
            ctypes.c_int,  # l2 promotion
            ctypes.c_int,  # oob fill
        ]
        _CUDA = fn
    return _CUDA


def encode_args(spec: TmapSpec) -> tuple:
    """The exact argument values passed to cuTensorMapEncodeTiled after the map pointer (for tests)."""
    return (
        spec.dtype,
        3,
        spec.ptr,
        tuple(spec.dims),
        tuple(spec.strides),
        tuple(spec.box),
        (1, 1, 1),
        INTERLEAVE_NONE,
        SWIZZLE_128B,
        L2_PROMOTION_256B,
        OOB_FILL_ZERO,
    )


def _driver_encode(spec: TmapSpec) -> bytes:
    dtype, rank, ptr, dims, strides, box, estr, il, sw, l2, oob = encode_args(spec)
    buf = (ctypes.c_uint8 * 192)()  # 128 bytes at a 64-byte aligned offset inside
    off = (-ctypes.addressof(buf)) % 64
    res = _libcuda()(
        ctypes.addressof(buf) + off,
        dtype,
        rank,
        ctypes.c_void_p(ptr),
        (ctypes.c_uint64 * 3)(*dims),
        (ctypes.c_uint64 * 2)(*strides),
        (ctypes.c_uint32 * 3)(*box),
        (ctypes.c_uint32 * 3)(*estr),
        il,
        sw,
        l2,
        oob,
    )
    if res != 0:
        raise GemmError(f"cuTensorMapEncodeTiled failed with CUresult {res} for {spec}")
    return bytes(buf[off : off + 128])


_cache: dict[TmapSpec, np.ndarray] = {}
_CACHE_MAX = 4096


def encode(spec: TmapSpec, name: str = "operand") -> np.ndarray:
    """The encoded map of ``spec`` as a kernel argument passed by value: a one-element array of the
    128-byte TMAP_DTYPE (cached)."""
    hit = _cache.get(spec)
    if hit is not None:
        return hit
    check_spec(spec, name)
    # a CuPy stand-in (the tests' fake CUDA device) provides its own encoder: no driver there
    enc = getattr(sys.modules.get("cupy"), "blublas_encode_tmap", None) or _driver_encode
    raw = enc(spec)
    if len(raw) != 128:
        raise GemmError(f"tensor map encoder returned {len(raw)} bytes, expected 128")
    val = np.frombuffer(bytes(raw), dtype=TMAP_DTYPE).copy()  # own, writable-free, 1 element
    if len(_cache) >= _CACHE_MAX:
        _cache.clear()
    _cache[spec] = val
    return val
