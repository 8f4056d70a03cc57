"""matmul (batch broadcasting, 1-D operands) and bmm; CUDA GEMMs go through the GEMM provider."""

from __future__ import annotations

import numpy as np
from blutensor.autograd.node import ACCUMULATED
from blutensor.backends import array_provider, array_providers, is_cuda_array
from blutensor.errors import ShapeError
from blutensor.ops._util import unbroadcast


def gemm(a, b):
    """a @ b on NumPy, or through the selected GEMM provider on CUDA (a registered array provider's ``gemm``
    for its array type: a tracer records the contraction)."""
    if array_providers and (prov := array_provider(a, b)) is not None:
        return prov.gemm(a, b)
    if type(a) is np.ndarray:  # host: row blocks on the CPU threads (blutensor.threads)
        return _host_matmul(a, b, _threads[0]) if _threads[0] > 1 else np.matmul(a, b)
    from blutensor.gemm import cuda_matmul

    return cuda_matmul(a, b)


def _host_matmul(a, b, n, bias=None):
    from blutensor.backends.numpy.gemm import matmul

    return matmul(a, b, n, bias)


def _col_sum(g2):
    """``g2.sum(axis=0)``: NumPy's on one thread, else the same sums split over the CPU threads."""
    if _threads[0] > 1 and type(g2) is np.ndarray:
        from blutensor.backends.numpy.strided import col_sum

        return col_sum(g2)
    return g2.sum(axis=0)


#: the host GEMM thread count, kept current by blutensor.threads (read on every host GEMM)
_threads = [1]


def matmul_forward(ctx, a, b):
    if a.ndim == 0 or b.ndim == 0:
        raise ShapeError("matmul: both operands need at least 1 dim, got shapes "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    ka = a.shape[-1]
    kb = b.shape[0] if b.ndim == 1 else b.shape[-2]
    if ka != kb:
        raise ShapeError(f"matmul: inner dimensions differ: {tuple(a.shape)} @ {tuple(b.shape)} "
                         f"({ka} != {kb})")
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    try:
        out = gemm(a2, b2)
    except ValueError:
        raise ShapeError(f"matmul: batch dims do not broadcast: {tuple(a.shape)} @ {tuple(b.shape)}") from None
    ctx.saved = (a2, b2, a.ndim == 1, b.ndim == 1)
    if a.ndim == 1:
        out = out[..., 0, :]
    if b.ndim == 1:
        out = out[..., 0]
    return out


def matmul_backward(ctx, g):
    a2, b2, a1, b1 = ctx.saved
    if b1:
        g = g[..., None]
    if a1:
        g = g[..., None, :]
    ga = gb = None
    if ctx.needs[0]:
        ga = unbroadcast(gemm(g, b2.swapaxes(-1, -2)), a2.shape)
        if a1:
            ga = ga[0]
    if ctx.needs[1]:
        gb = unbroadcast(gemm(a2.swapaxes(-1, -2), g), b2.shape)
        if b1:
            gb = gb[:, 0]
    return ga, gb


def bmm_forward(ctx, a, b):
    if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ShapeError(f"bmm: expected (B,N,K) @ (B,K,M), got {tuple(a.shape)} @ {tuple(b.shape)}")
    ctx.saved = (a, b)
    return gemm(a, b)


def bmm_backward(ctx, g):
    a, b = ctx.saved
    return (gemm(g, b.swapaxes(1, 2)) if ctx.needs[0] else None,
            gemm(a.swapaxes(1, 2), g) if ctx.needs[1] else None)


def linear_forward(ctx, x, w, b=None):
    """y = x @ w^T + b with x (..., in), w (out, in): one fused op so backward needs no transposes."""
    if w.ndim != 2 or x.ndim == 0 or x.shape[-1] != w.shape[1] or b is not None and b.shape != w.shape[:1]:
        _linear_error(x, w, b)
    x2 = x.reshape(-1, x.shape[-1])
    if is_cuda_array(x2):  # CUDA: one NT GEMM with the bias fused into its epilogue (blutensor.gemm.cuda_linear)
        from blutensor.gemm import cuda_linear

        y = cuda_linear(x2, w, b)
    elif (type(x2) is np.ndarray and type(w) is np.ndarray and type(b) is np.ndarray and _threads[0] > 1
          and not array_providers):
        y = _host_matmul(x2, w.T, _threads[0], b)  # the bias added by the GEMM's threads, block by block
    else:  # NumPy, or array-likes of a tracer (blucompiler): the plain formula
        y = gemm(x2, w.T)
        if b is not None:
            y += b
    ctx.saved = (x2, w, x.shape)
    return y.reshape(*x.shape[:-1], w.shape[0])


def _linear_error(x, w, b) -> None:
    """Raise the ShapeError naming which of input, weight or bias does not fit."""
    if w.ndim != 2:
        raise ShapeError(f"linear: weight must be 2-D (out_features, in_features), got shape {tuple(w.shape)}")
    if x.ndim == 0:
        raise ShapeError("linear: input must have at least 1 dim (..., in_features), got shape ()")
    if x.shape[-1] != w.shape[1]:
        raise ShapeError(f"linear: input features {x.shape[-1]} (input shape {tuple(x.shape)}) do not match "
                         f"weight shape {tuple(w.shape)} (out_features, in_features)")
    raise ShapeError(f"linear: bias shape {tuple(b.shape)} does not match weight shape {tuple(w.shape)}: "
                     f"expected ({w.shape[0]},)")


def linear_backward(ctx, g):
    """Gradients of x, w, b; where the engine offers a leaf's float32 buffer (``ctx.grad_into``), the weight and
    bias gradients are added into it (CUDA: the wgrad GEMM with beta = 1 and the bias GEMV with beta = 1; NumPy:
    ``buf += g2.T @ x2``, exactly the engine's own accumulation)."""
    x2, w, xshape = ctx.saved
    into = getattr(ctx, "grad_into", None) or (None, None, None)
    g2 = g.reshape(-1, g.shape[-1])
    gx = gemm(g2, w).reshape(xshape) if ctx.needs[0] else None
    gw = gb = None
    if ctx.needs[1]:
        gw = _into(into[1], g2.T, x2) if into[1] is not None else gemm(g2.T, x2)
    if len(ctx.needs) > 2 and ctx.needs[2]:
        buf = into[2] if len(into) > 2 else None
        if is_cuda_array(g2):  # CUDA: a GEMV on the GEMM provider (CuPy's axis-0 sum is one thread per column)
            from blutensor.gemm import cuda_bias_grad

            if buf is not None:
                cuda_bias_grad(g2, out=buf)
                gb = ACCUMULATED
            else:
                gb = cuda_bias_grad(g2)
        elif buf is not None:
            buf += _col_sum(g2)
            gb = ACCUMULATED
        else:
            gb = _col_sum(g2)
    return gx, gw, gb


def _into(buf, a, b):
    """``buf += a @ b`` (2-D) as one GEMM with beta = 1 on CUDA (a separate add where the provider does not
    apply), the product then an in-place add on the host; returns ACCUMULATED."""
    if type(buf) is np.ndarray or not is_cuda_array(buf):
        buf += gemm(a, b)
        return ACCUMULATED
    from blutensor.gemm import cuda_matmul_into

    cuda_matmul_into(a, b, buf)
    return ACCUMULATED
