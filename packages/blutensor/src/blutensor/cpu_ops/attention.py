"""Attention over a fused qkv projection on the CPU (``sdpa_qkv``'s host path), float32, no dropout.

The op-by-op path (view, permute, three ``contiguous`` copies, sdpa, a transpose + reshape copy; in backward
three full-size zero-filled gradients of the q/k/v slices summed, then a copy) moves the (B, T, 3C) projection
about seven times per layer and step. Here the compiled kernels read q, k and v in place from the
(B, T, 3, H, hd) projection, write the output as (B, T, H*hd), and in backward read the output gradient in
place and write dq, dk and dv into one (B, T, 3C) gradient (kernels.c ``blu_sdpa_qkv_forward``/``_backward``:
the per-head work of ``blu_sdpa_forward``/``_backward`` at other row strides). Results are bit-identical to the
op-by-op path: the same operations in the same order.
"""

from __future__ import annotations

import math

import numpy as np

from blutensor.cpu_ops._build import lib as _lib

_F32 = np.dtype(np.float32)


def usable(qkv, n_head: int, dropout_p: float) -> bool:
    """Whether the fused host path applies to ``qkv`` (a Tensor): float32 NumPy data, the compiled library, the
    built-in CPU sdpa kernel chosen, no dropout, no autocast, no observer that rewrites 'sdpa'."""
    d = qkv._data
    if (type(d) is not np.ndarray or d.dtype != _F32 or dropout_p or qkv.ndim != 3 or d.size == 0
            or qkv.shape[-1] % (3 * n_head) or _lib() is None):
        return False
    from blutensor.cpu_ops.nn import SdpaCpu
    from blutensor.ops import dispatch

    if dispatch.autocast_hook is not None:
        return False
    return dispatch.resolve("sdpa", "cpu", "float32").PLUGIN_NAME == SdpaCpu.PLUGIN_NAME


def qkv_attention_forward(qkv: np.ndarray, n_head: int, causal: bool, scale: float | None):
    """(y (B, T, C), saved) for the (B, T, 3C) float32 projection ``qkv``."""
    qkv = np.ascontiguousarray(qkv)
    B, T, C3 = qkv.shape
    hd = C3 // (3 * n_head)
    sc = float(scale) if scale is not None else 1.0 / math.sqrt(hd)
    y = np.empty((B, T, n_head * hd), _F32)
    lse = np.empty(B * n_head * T, _F32)
    _lib().blu_sdpa_qkv_forward(qkv.ctypes.data, y.ctypes.data, lse.ctypes.data, B, T, n_head, hd, sc,
                                int(bool(causal)))
    return y, (qkv, y, lse, n_head, sc, bool(causal))


def qkv_attention_backward(g: np.ndarray, saved) -> np.ndarray:
    """d(loss)/d(qkv) (B, T, 3C) from the output gradient ``g`` (B, T, C)."""
    qkv, y, lse, n_head, sc, causal = saved
    B, T, C3 = qkv.shape
    go = np.ascontiguousarray(g.astype(_F32, copy=False))
    d = np.empty_like(qkv)
    _lib().blu_sdpa_qkv_backward(qkv.ctypes.data, y.ctypes.data, go.ctypes.data, lse.ctypes.data, d.ctypes.data, B,
                                 T, n_head, C3 // (3 * n_head), sc, int(causal))
    return d


def sdpa_qkv_function():
    """The autograd Function running :func:`qkv_attention_forward` / :func:`qkv_attention_backward`."""
    from blutensor._tensor import Tensor
    from blutensor.autograd.function import Function

    class SdpaQkvCpu(Function):
        """Attention over a fused qkv projection on the CPU (q, k, v and the output in place)."""

        @staticmethod
        def forward(ctx, qkv, n_head, causal, scale):
            y, ctx.attn = qkv_attention_forward(qkv._data, n_head, causal, scale)
            return Tensor._from_data(y, qkv.dtype, qkv.device)

        @staticmethod
        def backward(ctx, g):
            return qkv_attention_backward(g._data, ctx.attn), None, None, None

    return SdpaQkvCpu
