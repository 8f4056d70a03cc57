"""Attention over a fused qkv projection on the CPU (``sdpa_qkv``'s host path), float32, no dropout.

The op-by-op path (view, permute, three ``contiguous`` copies, sdpa, a transpose + reshape copy; in backward
three full-size zero-filled gradients of the q/k/v slices summed, then a copy) records about ten autograd nodes
per layer and moves the (B, T, 3C) projection about seven times. Here q, k and v are the contiguous slices of ONE
transposing copy of the projection, the compiled flash kernels (kernels.c ``blu_sdpa_forward``/``_backward``,
the calls the 'sdpa' op makes) run on them, and backward writes dq, dk and dv straight into one
(3, B, H, T, hd) buffer, transposed back with one copy: one autograd node. (Kernels reading q/k/v at the
projection's row stride were measured slower on the 2-core machine than the contiguous kernels after one copy.)
The transposing copies split their rows over the CPU threads (``strided.contiguous``).
Results are bit-identical to the op-by-op path: the same kernels on the same values.
"""

from __future__ import annotations

import math

import numpy as np

from blutensor.backends.numpy._build import lib as _lib
from blutensor.backends.numpy.strided import contiguous

_F32 = np.dtype(np.float32)


def usable(qkv, n_head: int, dropout_p: float) -> bool:
    """Whether the fused host path applies to ``qkv`` (a Tensor): float32 NumPy data, the compiled library, the
    built-in CPU sdpa kernel chosen, no dropout, no autocast, no observer that rewrites 'sdpa'."""
    d = qkv._data
    if (type(d) is not np.ndarray or d.dtype != _F32 or dropout_p or qkv.ndim != 3 or d.size == 0
            or qkv.shape[-1] % (3 * n_head) or _lib() is None):
        return False
    from blutensor.backends.numpy.nn import SdpaCpu
    from blutensor.ops import dispatch

    if dispatch.autocast_hook is not None:
        return False
    return dispatch.resolve("sdpa", "cpu", "float32").PLUGIN_NAME == SdpaCpu.PLUGIN_NAME


def qkv_attention_forward(qkv: np.ndarray, n_head: int, causal: bool, scale: float | None):
    """(y (B, T, C), saved) for the (B, T, 3C) float32 projection ``qkv``."""
    B, T, C3 = qkv.shape
    hd = C3 // (3 * n_head)
    parts = contiguous(qkv.reshape(B, T, 3, n_head, hd).transpose(2, 0, 3, 1, 4))  # (3, B, H, T, hd)
    sc = float(scale) if scale is not None else 1.0 / math.sqrt(hd)
    BH = B * n_head
    o = np.empty((B, n_head, T, hd), _F32)
    lse = np.empty(BH * T, _F32)
    _lib().blu_sdpa_forward(parts[0].ctypes.data, parts[1].ctypes.data, parts[2].ctypes.data, o.ctypes.data,
                            lse.ctypes.data, BH, T, T, hd, hd, sc, int(bool(causal)))
    y = contiguous(o.transpose(0, 2, 1, 3)).reshape(B, T, n_head * hd)
    return y, (parts, o, lse, sc, bool(causal))


def qkv_attention_backward(g: np.ndarray, saved) -> np.ndarray:
    """d(loss)/d(qkv) (B, T, 3C) from the output gradient ``g`` (B, T, C)."""
    parts, o, lse, sc, causal = saved
    _, B, H, T, hd = parts.shape
    go = contiguous(g.astype(_F32, copy=False).reshape(B, T, H, hd).transpose(0, 2, 1, 3))
    d = np.empty_like(parts)
    _lib().blu_sdpa_backward(parts[0].ctypes.data, parts[1].ctypes.data, parts[2].ctypes.data, o.ctypes.data,
                             go.ctypes.data, lse.ctypes.data, d[0].ctypes.data, d[1].ctypes.data, d[2].ctypes.data,
                             B * H, T, T, hd, hd, sc, int(causal))
    return contiguous(d.transpose(1, 3, 0, 2, 4)).reshape(B, T, 3 * H * hd)


def sdpa_qkv_function():
    """The autograd Function running :func:`qkv_attention_forward` / :func:`qkv_attention_backward`."""
    from blutensor._tensor import Tensor
    from blutensor.autograd.function import Function

    class SdpaQkvCpu(Function):
        """Attention over a fused qkv projection on the CPU (one copy in and one out, each way)."""

        @staticmethod
        def forward(ctx, qkv, n_head, causal, scale):
            y, ctx.attn = qkv_attention_forward(qkv._data, n_head, causal, scale)
            return Tensor._from_data(y, qkv.dtype, qkv.device)

        @staticmethod
        def backward(ctx, g):
            return qkv_attention_backward(g._data, ctx.attn), None, None, None

    return SdpaQkvCpu
