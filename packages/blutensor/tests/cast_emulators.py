"""NumPy models of kernels/cast.cu's entry points for the fake CUDA device (``fake_cuda.install(...,
kernels=CAST_KERNELS)``): bf16 storage arithmetic on CuPy arrays runs these kernels, so host-path tests on the fake
device that reach it (grouped attention's dK/dV sum, the engine's bf16 gradient sum, casts) compute real values.
Each takes the fake kernel's (kernel, grid, block, args, shared_mem) and writes the output array in place; the
rounding is blutensor's NumPy path (round to nearest even), which tests/test_bf16_storage_ops.py checks against
ml_dtypes and the cuda-marked twins check the kernels against."""

from __future__ import annotations

import numpy as np
from blutensor.backends import bf16_bits_to_f32, f32_to_bf16_bits


def _flat(a) -> np.ndarray:
    return np.asarray(a).reshape(-1)


def _widen(bits) -> np.ndarray:
    return bf16_bits_to_f32(np.asarray(_flat(bits), dtype=np.uint16), np)


def _narrow(x) -> np.ndarray:
    return f32_to_bf16_bits(np.asarray(x, dtype=np.float32), np)


def _f32_to_bf16(k, grid, block, args, smem) -> None:
    x, y, n, _ = args
    _flat(y)[: int(n)] = _narrow(_flat(x)[: int(n)])


def _bf16_to_f32(k, grid, block, args, smem) -> None:
    x, y, n, _ = args
    _flat(y)[: int(n)] = _widen(_flat(x)[: int(n)])


def _add_bf16(k, grid, block, args, smem) -> None:
    a, b, out, n, _ = args
    n = int(n)
    _flat(out)[:n] = _narrow(_widen(_flat(a)[:n]) + _widen(_flat(b)[:n]))


def _sum_slices_bf16(k, grid, block, args, smem) -> None:
    parts, out, G, n, _ = args
    G, n = int(G), int(n)
    p = _flat(parts)[: G * n].reshape(G, n)
    acc = _widen(p[0])
    for g in range(1, G):
        acc = acc + _widen(p[g])
    _flat(out)[:n] = _narrow(acc)


CAST_KERNELS = {"blu_cast_f32_to_bf16": _f32_to_bf16, "blu_cast_bf16_to_f32": _bf16_to_f32,
                "blu_add_bf16_forward": _add_bf16, "blu_sum_slices_bf16_forward": _sum_slices_bf16}
