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


def tf32_round(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest TF32 value (10 mantissa bits, ties away from zero: cvt.rna), low 13 bits zero,
    like kernels/split_tf32.cu: inf/NaN unchanged, a finite value that would round to inf is truncated."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nonfinite = (u & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
    r = (u + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    r = np.where((r & np.uint32(0x7F800000)) == np.uint32(0x7F800000), u & np.uint32(0xFFFFE000), r)
    return np.where(nonfinite, u, r).astype(np.uint32).view(np.float32).reshape(np.shape(x))


def split_tf32(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo) TF32 parts of float32 ``x``: hi = tf32(x), lo = tf32(x - hi) (x - hi is exact); lo = 0 where
    x is not finite."""
    x = np.asarray(x, dtype=np.float32)
    hi = tf32_round(x)
    with np.errstate(invalid="ignore"):
        lo = tf32_round(np.where(np.isfinite(x), x - hi, np.float32(0)).astype(np.float32))
    return hi, lo


def concat_3xtf32(opa: np.ndarray, opb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The K-concatenated operands of one 3xTF32 GEMM: ([a_hi | a_lo | a_hi], [b_hi ; b_hi ; b_lo]) for
    op(a) (..., M, K) and op(b) (..., K, N); their product (exact TF32 products, fp32 accumulation) is
    a_hi b_hi + a_hi b_lo + a_lo b_hi."""
    ah, al = split_tf32(opa)
    bh, bl = split_tf32(opb)
    return np.concatenate([ah, al, ah], axis=-1), np.concatenate([bh, bh, bl], axis=-2)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU with the tanh approximation (the one GPT-2 and the kernels use)."""
    return 0.5 * x * (1.0 + np.tanh(GELU_K0 * (x + GELU_K1 * x * x * x)))


def gelu_tanh_grad(x: np.ndarray) -> np.ndarray:
    """d gelu_tanh(x) / dx (the factor the 'dgelu' epilogue multiplies the product by)."""
    t = np.tanh(GELU_K0 * (x + GELU_K1 * x * x * x))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_K0 * (1.0 + 3.0 * GELU_K1 * x * x)


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
    aux: np.ndarray | None = None,
    dtype: type = np.float64,
) -> tuple[np.ndarray, np.ndarray]:
    """Return (out, preact) of epi(alpha * op(a) @ op(b) + beta * c_old + bias) computed in ``dtype``.

    Inputs are real-valued float arrays (2-D or batched 3-D); bf16 bits must be converted by the caller.
    ``preact`` is the value before the epilogue's function (equal to ``out`` when epilogue is 'none'). epi is
    the identity, 'gelu' (tanh GELU) or 'dgelu': the value times gelu_tanh'(aux), ``aux`` the GELU input the
    forward saved (backward through a GELU: aux = u, the product = dL/dgelu(u), out = dL/du).
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
    elif epilogue == "dgelu":
        if aux is None:
            raise ValueError("epilogue 'dgelu' needs aux, the GELU input of the forward")
        v = v * gelu_tanh_grad(np.asarray(aux, dtype=dtype))
    return v, pre
