"""GELU on CUDA (kernels/gelu.cu): vectorised forward, backward recomputing from the input."""

from __future__ import annotations

import numpy as np

from blutensor.backends.cupy import _fallback
from blutensor.backends.cupy._loader import aligned16, cupy, launch, suffix
from blutensor.backends.cupy.occupancy import full_grid
from blutensor.ops import nn_ops
from blutensor.ops.table import Kernel

FILE = "gelu.cu"
_APPROX = {"none": 0, "tanh": 1}
_STORAGE = (np.dtype(np.float32), np.dtype(np.uint16))


#: 16-byte vectors a thread handles per grid-stride step (GELU_U in kernels/gelu.cu)
_U = 4
#: plain loads/stores (``blu_gelu_*_plain_*``) instead of streaming (evict-first) cache hints
PLAIN = False
#: grid of one full wave of resident blocks striding over the array (False: one step per thread, many waves)
ONE_WAVE = True


def _name(kind: str, x) -> str:
    return f"blu_gelu_{kind}_{'plain_' if PLAIN else ''}{suffix(x)}"


def _grid(name: str, n: int, per_thread: int, block: int = 256) -> int:
    """One full wave of resident blocks (grid-stride), fewer when ``n`` is small."""
    work = -(-n // (block * per_thread))
    return full_grid(FILE, name, block, work) if ONE_WAVE else max(1, min(work, 2**31 - 1))


def gelu_forward(x, approximate: str = "tanh"):
    """y = gelu(x) for a contiguous fp32 or bf16-bits array."""
    cp = cupy()
    y = cp.empty_like(x)
    n = x.size
    if n:
        name = _name("forward", x)
        vec = aligned16(x, y)
        launch(
            FILE,
            name,
            _grid(name, n, _U * 16 // x.dtype.itemsize),
            256,
            (x, y, np.int64(n), np.int32(_APPROX[approximate]), np.int32(vec)),
        )
    return y


def gelu_backward(g, x, approximate: str = "tanh"):
    """dx = g * gelu'(x), gelu' recomputed from x."""
    cp = cupy()
    dx = cp.empty_like(x)
    n = x.size
    if n:
        name = _name("backward", x)
        vec = aligned16(g, x, dx)
        launch(
            FILE,
            name,
            _grid(name, n, _U * 16 // x.dtype.itemsize),
            256,
            (g, x, dx, np.int64(n), np.int32(_APPROX[approximate]), np.int32(vec)),
        )
    return dx


class GeluCuda(Kernel):
    """gelu on CUDA, 'none' (erf) and 'tanh', fp32 and bf16 storage."""

    PLUGIN_NAME = "blutensor.cuda.gelu"
    OP = "gelu"
    BACKEND = "cuda"
    DTYPES = ("float32", "bfloat16")
    PRIORITY = 10
    BF16_NATIVE = True
    SAVES = (0,)

    @staticmethod
    def forward(ctx, x, approximate="none"):
        if approximate not in _APPROX or x.dtype not in _STORAGE:
            return _fallback.forward(ctx, nn_ops.gelu_forward, (x,), dict(approximate=approximate))
        xc = cupy().ascontiguousarray(x)
        ctx.saved = (xc, approximate)
        return gelu_forward(xc, approximate)

    @staticmethod
    def backward(ctx, g):
        if _fallback.used(ctx):
            return _fallback.backward(ctx, nn_ops.gelu_backward, g)
        x, approximate = ctx.saved
        return (gelu_backward(cupy().ascontiguousarray(g), x, approximate),)
