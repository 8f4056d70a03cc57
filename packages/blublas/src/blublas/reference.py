"""NumPy GEMM with the BluBLAS epilogue: the CPU implementation and the reference for every kernel."""

from __future__ import annotations

import numpy as np

GELU_K0 = 0.7978845608028654
GELU_K1 = 0.044715


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32 values (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even like the kernels; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    out = np.where(nan, (u >> 16) | np.uint32(0x40), rounded)
    return out.astype(np.uint16)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU with the tanh approximation (the one GPT-2 and the kernels use)."""
    return 0.5 * x * (1.0 + np.tanh(GELU_K0 * (x + GELU_K1 * x * x * x)))


def gemm_reference(
    a: np.ndarray,
    b: np.ndarray,
    *,
    trans_a: bool = False,
    trans_b: bool = False,
    alpha: float = 1.0,
    beta: float = 0.0,
    c_old: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    epilogue: str = "none",
    dtype: type = np.float64,
) -> tuple[np.ndarray, np.ndarray]:
    """Return (out, preact) of epi(alpha * op(a) @ op(b) + beta * c_old + bias) computed in ``dtype``.

    Inputs are real-valued float arrays (2-D or batched 3-D); bf16 bits must be converted by the caller.
    ``preact`` is the value before GELU (equal to ``out`` when epilogue is 'none').
    """
    a = np.asarray(a, dtype=dtype)
    b = np.asarray(b, dtype=dtype)
    opa = np.swapaxes(a, -1, -2) if trans_a else a
    opb = np.swapaxes(b, -1, -2) if trans_b else b
    v = np.matmul(opa, opb) * dtype(alpha)
    if beta != 0.0:
        if c_old is None:
            raise ValueError("beta != 0 needs the previous output c_old")
        v = v + dtype(beta) * np.asarray(c_old, dtype=dtype)
    if bias is not None:
        v = v + np.asarray(bias, dtype=dtype)
    pre = v
    if epilogue == "gelu":
        v = gelu_tanh(v)
    return v, pre
