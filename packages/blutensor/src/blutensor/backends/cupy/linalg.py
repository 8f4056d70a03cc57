"""bfloat16 GEMM ops on CUDA: linear, matmul, bmm with bf16 operands, fp32 accumulation, bf16 results.

They run through the selected GEMM provider at precision 'bf16' (blublas' 'cublas' = cuBLASLt, or 'blublas'
mma.sync kernels); the linear bias is fused as the GEMM epilogue and its gradient is a GEMV (ones @ g,
fp32 out). A selected provider that does not declare 'bf16' (the built-in 'xp', cupy.matmul) leaves them to the
first available provider that does (blublas' cublas, then blublas), and without one these calls (and shapes they
do not cover) run the generic op on widened float32.
"""

from __future__ import annotations

import numpy as np

from blutensor.autograd.node import ACCUMULATED
from blutensor.backends.cupy import _fallback
from blutensor.backends.cupy._loader import cupy
from blutensor.ops import linalg as la
from blutensor.ops.table import Kernel

_BF16 = np.dtype(np.uint16)
_provider_cache: dict = {}
_ones: dict = {}


def bf16_provider():
    """The GEMM provider for bf16 operands (None: none available), cached per selected provider: the selected one
    when it declares 'bf16' in ``PRECISIONS``, else the first available provider that does (the registry's
    documented order first)."""
    from blutensor.gemm import get_gemm_provider

    sel = get_gemm_provider()
    hit = _provider_cache.get(sel, False)
    if hit is not False:
        return hit
    prov = sel if "bf16" in getattr(sel, "PRECISIONS", ()) else None
    if prov is None:
        from blutensor.plugin import get_host

        reg = get_host().registry("gemm")
        recs = sorted(reg, key=lambda r: reg.defaults.index(r.name) if r.name in reg.defaults else len(reg.defaults))
        for rec in recs:
            cls = rec.cls
            if "bf16" in getattr(cls, "PRECISIONS", ()) and getattr(cls, "is_available", lambda: True)():
                prov = cls
                break
    _provider_cache[sel] = prov
    return prov


def _contig_last(x):
    """x with a unit-stride last axis (copied only if needed)."""
    if x.shape[-1] <= 1 or x.strides[-1] == x.itemsize:
        return x
    return cupy().ascontiguousarray(x)


def mm(prov, a, b, *, trans_a=False, trans_b=False, bias=None, out=None, beta=0.0):
    """op(a) @ op(b) (+ beta * out) at bf16 precision (2-D, or 3-D batch) through ``prov``."""
    return prov.matmul(_contig_last(a), _contig_last(b), trans_a=trans_a, trans_b=trans_b, bias=bias, out=out,
                       beta=beta, precision="bf16")


def _ones_bf16(n: int):
    cp = cupy()
    key = (n, cp.cuda.runtime.getDevice())
    o = _ones.get(key)
    if o is None:
        o = _ones[key] = cp.full((1, n), 0x3F80, dtype=cp.uint16)  # 1.0 in bf16
    return o


def bias_grad(prov, g2):
    """Column sums of bf16 g2 (M, N) as bf16 (N,): ones(1, M) @ g2 with fp32 accumulation and output."""
    from blutensor.backends.cupy.cast import to_bf16

    cp = cupy()
    out = cp.empty((1, g2.shape[1]), dtype=cp.float32)
    mm(prov, _ones_bf16(g2.shape[0]), g2, out=out)
    return to_bf16(out.reshape(-1))


def _all_bf16(*arrays) -> bool:
    return all(a is None or a.dtype == _BF16 for a in arrays)


class _Bf16Gemm(Kernel):
    """Shared plugin metadata of the bf16 GEMM kernels (CUDA, bf16 storage, both operands saved)."""

    BACKEND = "cuda"
    DTYPES = ("bfloat16",)
    PRIORITY = 10
    BF16_NATIVE = True
    SAVES = (0, 1)
    SAME_DTYPE = (0, 1)


class LinearCuda(_Bf16Gemm):
    """linear on bf16 CUDA tensors: one bf16 GEMM with the bias in its epilogue; backward 2 GEMMs + a GEMV. The
    weight and bias gradients go straight into the float32 masters' ``.grad`` where the engine offers them
    (``ctx.grad_into``, through autocast's weight casts): beta = 1, float32 output, no bf16 gradient array."""

    PLUGIN_NAME = "blutensor.cuda.linear"
    OP = "linear"
    SAME_DTYPE = (0, 1, 2)
    GRAD_INTO = True

    @staticmethod
    def forward(ctx, x, w, b=None):
        prov = bf16_provider()
        if prov is None or not _all_bf16(x, w, b) or x.ndim < 1 or w.ndim != 2 or x.shape[-1] != w.shape[1]:
            return _fallback.forward(ctx, la.linear_forward, (x, w, b), {})
        x2 = _contig_last(x.reshape(-1, x.shape[-1]))
        y = mm(prov, x2, w, trans_b=True, bias=None if b is None else cupy().ascontiguousarray(b))
        ctx.saved = (prov, x2, w, x.shape)
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, g):
        if _fallback.used(ctx):
            return _fallback.backward(ctx, la.linear_backward, g)
        prov, x2, w, xshape = ctx.saved
        return linear_backward(prov, x2, w, xshape, g, ctx.needs, getattr(ctx, "grad_into", None))


def linear_backward(prov, x2, w, xshape, g, needs, into=None):
    """(gx, gw, gb) of the bf16 linear ``x2 @ w.T + b`` (x2 the flattened bf16 input of shape ``xshape``) for its
    output gradient ``g``: two GEMMs and the bias GEMV through ``prov``, each where ``needs`` asks. A float32 buffer in
    ``into`` (the masters' ``.grad``, offered by the engine) receives its gradient with beta = 1 (``ACCUMULATED``
    returned for it) when ``prov`` declares ``ACCUMULATE``. Also the backward of a linear whose forward ran fused
    into another GEMM's epilogue (GPT-2's MLP, blutensor.ops.gelu_mlp)."""
    into = into or (None, None, None)
    g2 = _contig_last(g.reshape(-1, g.shape[-1]))
    gx = mm(prov, g2, w).reshape(xshape) if needs[0] else None
    gw = gb = None
    if not getattr(prov, "ACCUMULATE", False):
        into = (None, None, None)
    if needs[1]:
        if into[1] is not None:  # the float32 master's .grad: wgrad GEMM with beta = 1, fp32 out
            mm(prov, g2, x2, trans_a=True, out=into[1], beta=1.0)
            gw = ACCUMULATED
        else:
            gw = mm(prov, g2, x2, trans_a=True)
    if len(needs) > 2 and needs[2]:
        buf = into[2] if len(into) > 2 else None
        if buf is not None:  # the GEMV adds into the float32 bias gradient
            mm(prov, _ones_bf16(g2.shape[0]), g2, out=buf.reshape(1, -1), beta=1.0)
            gb = ACCUMULATED
        else:
            gb = bias_grad(prov, g2)
    return gx, gw, gb


class MatmulCuda(_Bf16Gemm):
    """matmul on bf16 CUDA tensors (>= 2-D, equal batch dims or a 2-D right operand); others widen."""

    PLUGIN_NAME = "blutensor.cuda.matmul"
    OP = "matmul"

    @staticmethod
    def forward(ctx, a, b):
        prov = bf16_provider()
        ok = (prov is not None and _all_bf16(a, b) and a.ndim >= 2 and b.ndim >= 2 and a.shape[-1] == b.shape[-2]
              and (b.ndim == 2 or a.shape[:-2] == b.shape[:-2]))
        if not ok:
            return _fallback.forward(ctx, la.matmul_forward, (a, b), {})
        if b.ndim == 2:  # (..., M, K) @ (K, N): one 2-D GEMM over the flattened rows
            a2 = _contig_last(a.reshape(-1, a.shape[-1]))
            ctx.saved = (prov, a2, b, a.shape, True)
            return mm(prov, a2, b).reshape(*a.shape[:-1], b.shape[-1])
        a3 = a.reshape(-1, *a.shape[-2:])
        b3 = b.reshape(-1, *b.shape[-2:])
        ctx.saved = (prov, a3, b3, a.shape, False)
        y = mm(prov, a3, b3) if a3.shape[0] > 1 else mm(prov, a3[0], b3[0])
        return y.reshape(*a.shape[:-1], b.shape[-1])

    @staticmethod
    def backward(ctx, g):
        if _fallback.used(ctx):
            return _fallback.backward(ctx, la.matmul_backward, g)
        prov, a, b, ashape, flat = ctx.saved
        if flat:
            g2 = g.reshape(-1, g.shape[-1])
            ga = mm(prov, g2, b, trans_b=True).reshape(ashape) if ctx.needs[0] else None
            gb = mm(prov, a, g2, trans_a=True) if ctx.needs[1] else None
            return ga, gb
        g3 = g.reshape(-1, *g.shape[-2:])
        if a.shape[0] == 1:
            a, b, g3 = a[0], b[0], g3[0]
        ga = mm(prov, g3, b, trans_b=True).reshape(ashape) if ctx.needs[0] else None
        gb = mm(prov, a, g3, trans_a=True).reshape(*ashape[:-2], *b.shape[-2:]) if ctx.needs[1] else None
        return ga, gb


class BmmCuda(_Bf16Gemm):
    """bmm on bf16 CUDA tensors: strided-batch bf16 GEMMs."""

    PLUGIN_NAME = "blutensor.cuda.bmm"
    OP = "bmm"

    @staticmethod
    def forward(ctx, a, b):
        prov = bf16_provider()
        if (prov is None or not _all_bf16(a, b) or a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0]
                or a.shape[2] != b.shape[1]):
            return _fallback.forward(ctx, la.bmm_forward, (a, b), {})
        ctx.saved = (prov, a, b)
        return mm(prov, a, b)

    @staticmethod
    def backward(ctx, g):
        if _fallback.used(ctx):
            return _fallback.backward(ctx, la.bmm_backward, g)
        prov, a, b = ctx.saved
        return (mm(prov, g, b, trans_b=True) if ctx.needs[0] else None,
                mm(prov, a, g, trans_a=True) if ctx.needs[1] else None)
