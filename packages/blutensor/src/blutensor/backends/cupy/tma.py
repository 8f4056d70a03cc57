"""Host-side TMA tensor maps (CUtensorMap): the one encoder of blutensor's sm_90a kernels (kernels/sdpa_wgmma.cu)
and of BluBLAS's TMA GEMMs. Public as ``blutensor.ext.tma``; BluBLAS, which does not import blutensor, receives
this module from the plugin host through the ``blutrain_tma_encoder`` hook (or, in a process without a host, loads
it from the ``blutrain.tma_encoder`` entry point blutensor registers) and describes its operands as rank-3 specs
(``blublas/tma.py``).

A map describes a tensor of rank 2-5 (dims innermost first, the innermost contiguous; byte strides of the
outer dims, in any order: a (B, T, 3, H, HD) fused projection read as (HD, T, H, B) is fine) and the box one
copy moves, with the 128-byte swizzle: the box's inner extent is 128 bytes (64 bf16 or 32 fp32, the span the
kernels' wgmma descriptors assume). The driver encodes the 128-byte opaque map (``cuTensorMapEncodeTiled``
through ctypes on libcuda); it is passed by value as a ``__grid_constant__`` kernel parameter (a one-element
NumPy array of a 128-byte structured dtype: CuPy passes size-one NumPy arrays by value), so a launch needs no
device memory and stays capture-safe. Encoded maps are cached per spec (pointer, dims, strides, box).
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

import numpy as np

from blutensor.errors import BluTensorError

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


class TmaError(BluTensorError, ValueError):
    """A tensor that TMA cannot read as described (alignment, strides, box)."""


@dataclass(frozen=True)
class TmapSpec:
    """Arguments of one cuTensorMapEncodeTiled call: ``dims`` innermost first (elements), ``strides`` the byte
    strides of dims 1.. (one fewer than dims), ``box`` elements per box along each dim."""

    dtype: int
    itemsize: int
    ptr: int
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]


def tensor_spec(ptr: int, itemsize: int, dims, strides, box) -> TmapSpec:
    """A spec from Python ints: ``strides`` in bytes for dims[1:]."""
    dtype = DTYPE_BF16 if itemsize == 2 else DTYPE_F32
    return TmapSpec(dtype, itemsize, int(ptr), tuple(int(d) for d in dims), tuple(int(s) for s in strides),
                    tuple(int(b) for b in box))


def spec_problem(spec: TmapSpec) -> str:
    """'' when ``spec`` satisfies the driver's rules for tiled maps with the 128-byte swizzle, else why not."""
    rank = len(spec.dims)
    if not 2 <= rank <= 5 or len(spec.strides) != rank - 1 or len(spec.box) != rank:
        return f"rank {rank} with {len(spec.strides)} strides and a {len(spec.box)}-d box"
    if spec.ptr % 16:
        return f"base address 0x{spec.ptr:x} is not 16-byte aligned"
    if any(d < 1 or d > 2**32 for d in spec.dims):
        return f"dimensions {spec.dims} must lie in [1, 2^32]"
    for s in spec.strides:
        if s % 16 or s <= 0 or s >= 2**40:
            return f"byte strides {spec.strides} must be positive multiples of 16 below 2^40"
    if any(b < 1 or b > 256 for b in spec.box) or spec.box[0] * spec.itemsize != SWIZZLE_SPAN:
        return f"box {spec.box} must have a 128-byte inner extent and at most 256 elements per dimension"
    return ""


def encode_args(spec: TmapSpec) -> tuple:
    """The exact argument values passed to cuTensorMapEncodeTiled after the map pointer (for tests)."""
    rank = len(spec.dims)
    return (
        spec.dtype,
        rank,
        spec.ptr,
        tuple(spec.dims),
        tuple(spec.strides),
        tuple(spec.box),
        (1,) * rank,
        INTERLEAVE_NONE,
        SWIZZLE_128B,
        L2_PROMOTION_256B,
        OOB_FILL_ZERO,
    )


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


def driver_encode(spec: TmapSpec) -> bytes:
    """The 128 bytes the driver encodes for ``spec`` (raises TmaError with its CUresult on failure)."""
    dtype, rank, ptr, dims, strides, box, estr, il, sw, l2, oob = encode_args(spec)
    buf = (ctypes.c_uint8 * 192)()  # 128 bytes at a 64-byte aligned offset inside
    off = (-ctypes.addressof(buf)) % 64
    res = _libcuda()(
        ctypes.addressof(buf) + off,
        dtype,
        rank,
        ctypes.c_void_p(ptr),
        (ctypes.c_uint64 * rank)(*dims),
        (ctypes.c_uint64 * (rank - 1))(*strides),
        (ctypes.c_uint32 * rank)(*box),
        (ctypes.c_uint32 * rank)(*estr),
        il,
        sw,
        l2,
        oob,
    )
    if res != 0:
        raise TmaError(f"cuTensorMapEncodeTiled failed with CUresult {res} for {spec}")
    return bytes(buf[off : off + 128])


_cache: dict[TmapSpec, np.ndarray] = {}
_CACHE_MAX = 4096


def encode(spec: TmapSpec, name: str = "tensor", encoder=None) -> np.ndarray:
    """The encoded map of ``spec`` as a kernel argument passed by value: a one-element array of the 128-byte
    TMAP_DTYPE (cached). Raises TmaError naming ``name`` when TMA cannot read the tensor as described.
    ``encoder`` (spec -> 128 bytes) replaces the driver, e.g. the fake CUDA device's in tests without a GPU."""
    hit = _cache.get(spec)
    if hit is not None:
        return hit
    why = spec_problem(spec)
    if why:
        raise TmaError(f"{name}: cannot be read by TMA ({why})")
    raw = (encoder or driver_encode)(spec)
    if len(raw) != 128:
        raise TmaError(f"tensor map encoder returned {len(raw)} bytes, expected 128")
    val = np.frombuffer(bytes(raw), dtype=TMAP_DTYPE).copy()
    if len(_cache) >= _CACHE_MAX:
        _cache.clear()
    _cache[spec] = val
    return val


def clear_cache() -> None:
    """Forget every encoded map, e.g. after switching between the driver and a stand-in encoder (maps are cached by
    pointer, dims, strides and box alone; freed memory needs no clearing: a reused address with the same geometry
    encodes the same bytes)."""
    _cache.clear()
