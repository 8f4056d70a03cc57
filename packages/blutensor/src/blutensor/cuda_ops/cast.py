"""float32 <-> bfloat16 casts on CUDA (kernels/cast.cu): one vectorised pass instead of CuPy's chain of
integer ops (widen: 2 kernels, round-to-nearest-even narrow: ~10). Autocast inserts these casts."""

from __future__ import annotations

import numpy as np

from blutensor.cuda_ops._loader import aligned16, cupy, launch, num_sms
from blutensor.ops import elementwise as ew
from blutensor.ops.table import Kernel

FILE = "cast.cu"
_F32, _BF16 = np.dtype(np.float32), np.dtype(np.uint16)


def _grid(n: int) -> int:
    return max(1, min(-(-n // (256 * 8)), num_sms() * 8))


def to_bf16(x):
    """float32 CuPy array -> bf16 bits (uint16), round to nearest even; same shape, C-contiguous."""
    cp = cupy()
    x = cp.ascontiguousarray(x)
    y = cp.empty(x.shape, dtype=cp.uint16)
    if x.size:
        launch(FILE, "blu_cast_f32_to_bf16", _grid(x.size), 256, (x, y, np.int64(x.size), np.int32(aligned16(x, y))))
    return y


def to_f32(x):
    """bf16 bits (uint16) CuPy array -> float32 (exact); same shape, C-contiguous."""
    cp = cupy()
    x = cp.ascontiguousarray(x)
    y = cp.empty(x.shape, dtype=cp.float32)
    if x.size:
        launch(FILE, "blu_cast_bf16_to_f32", _grid(x.size), 256, (x, y, np.int64(x.size), np.int32(aligned16(x, y))))
    return y


def _convert(a, src, dst):
    if src.name == "float32" and dst.name == "bfloat16" and a.dtype == _F32:
        return to_bf16(a)
    if src.name == "bfloat16" and dst.name == "float32" and a.dtype == _BF16:
        return to_f32(a)
    return ew._convert(a, src, dst, cupy())


class CastCuda(Kernel):
    """cast on CUDA: float32 <-> bfloat16 by the one-pass kernels, every other pair by the generic op."""

    PLUGIN_NAME = "blutensor.cuda.cast"
    OP = "cast"
    BACKEND = "cuda"
    DTYPES = ("float32", "bfloat16")
    PRIORITY = 10
    BF16_NATIVE = True

    @staticmethod
    def forward(ctx, a, src=None, dst=None):
        ctx.saved = (src, dst)
        ctx.out_dtype = dst
        return _convert(a, src, dst)

    @staticmethod
    def backward(ctx, g):
        src, dst = ctx.saved
        return (_convert(g, dst, src),)
