"""Global gradient L2 norm and clipping on CUDA without a host sync (kernels/grad_norm.cu)."""

from __future__ import annotations

import numpy as np

from blutensor.backends.cupy._loader import cupy, launch
from blutensor.backends.cupy.multi_tensor import table_for
from blutensor.errors import DTypeError

FILE = "grad_norm.cu"
BLOCK = 512


def _table(grads):
    flags = []
    for i, g in enumerate(grads):
        if g.dtype not in (np.float32, np.uint16):
            raise DTypeError(
                f"global_grad_norm: grad {i} has dtype {g.dtype}; expected float32 or bfloat16 bits (uint16)"
            )
        flags.append(int(g.dtype == np.uint16))
    return table_for((grads,), flags)


def global_grad_norm(grads):
    """sqrt(sum of squares of all ``grads``) as a 0-d float32 CuPy array (deterministic, no host sync)."""
    cp = cupy()
    t = _table(list(grads)) if grads else None
    if t is None or t.n_chunks == 0:
        return cp.zeros((), dtype=cp.float32)
    out = cp.empty((), dtype=cp.float32)  # blu_grad_norm_finalize writes it (no memset launch)
    partial = cp.empty(t.n_chunks, dtype=cp.float32)
    launch(
        FILE,
        "blu_grad_norm_partial",
        t.n_chunks,
        BLOCK,
        (*t.args(), partial),
    )
    launch(FILE, "blu_grad_norm_finalize", 1, 1024, (partial, np.int32(t.n_chunks), out))
    return out


def clip_grads_(grads, max_norm: float, norm=None):
    """Scale ``grads`` in place by max_norm / (norm + 1e-6) when that is < 1; returns the norm (device)."""
    grads = list(grads)
    if norm is None:
        norm = global_grad_norm(grads)
    if grads:
        t = _table(grads)
        if t.n_chunks:
            launch(
                FILE,
                "blu_grad_norm_scale",
                t.n_chunks,
                BLOCK,
                (*t.args(), norm, np.float32(max_norm)),
            )
    return norm
