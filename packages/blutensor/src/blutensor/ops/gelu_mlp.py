"""A transformer MLP, ``c_proj(gelu_tanh(c_fc(x)))``, as one array-level forward/backward pair whose GELU runs inside
the GEMMs where the CUDA GEMM provider fuses it (for a model's autograd Function: blumodels' GPT-2).

Forward: c_fc is ONE GEMM with the provider's 'gelu' epilogue (bias, then tanh GELU), which also writes the
pre-activation u that backward needs; c_proj is the linear kernel. Backward: c_proj's weight and bias gradients (the
linear kernel's formulas), then ONE GEMM with the 'dgelu' epilogue, du = (g @ W_proj) * gelu'(u) from the saved u,
which also writes c_fc's bias gradient (du's column sums); then c_fc's input and weight gradients (the linear
backward formulas on du). Where a piece is not fused -- host or tracer arrays, a provider that does not declare the
epilogue or has no fused form for the problem, fp32 GEMMs run as 3xtf32 -- the same quantity comes from the kernels
the unfused ops run (linear, gelu and its backward, the bias GEMV): results agree within float rounding either way.

Gradients go into the ``.grad`` buffers the engine offers (``ctx.grad_into``, one per input: x, w1, b1, w2, b2) as
the linear backward adds them: weight gradients by beta = 1 GEMMs, c_fc's bias by the bias GEMV with beta = 1 or, when
the 'dgelu' GEMM wrote its sums, by one add of those N values (the GEMM overwrites its bias-gradient output, so the
sums go to a scratch vector first). float32 keeps only u for backward (``save_hidden=False``): the GELU output, the
block's largest activation, is recomputed there for c_proj's weight gradient. bf16 (uint16 bits, CUDA) keeps it, as
c_proj's saved input, like the unfused ops.
"""

from __future__ import annotations

import numpy as np
from blutensor.autograd.node import ACCUMULATED, Ctx
from blutensor.backends import array_module, f32_to_bf16_bits, is_cuda_array
from blutensor.ops import linalg as la

_BF16 = np.dtype(np.uint16)
_F32 = np.dtype(np.float32)


def fusing_provider(x):
    """The GEMM provider that fuses the GELU into the MLP's GEMMs on raw array ``x``: for a CuPy float32 array the
    selected provider, for bf16 bits the bf16 one, when it declares 'gelu' in ``EPILOGUES``; else None (host and
    tracer arrays, the 'xp' provider, providers without the epilogue)."""
    if not is_cuda_array(x):
        return None
    from blutensor import gemm

    if x.dtype == _BF16:
        from blutensor.backends.cupy.linalg import bf16_provider

        prov = bf16_provider()
    elif x.dtype == _F32:
        prov = gemm._fp32_provider(x)
    else:
        return None
    return prov if prov is not None and "gelu" in gemm.fused_epilogues(prov) else None


class _GenericLinear:
    """The built-in linear rule (ops.linalg): on CUDA float32 one provider GEMM with the bias in its epilogue."""

    forward = staticmethod(la.linear_forward)
    backward = staticmethod(la.linear_backward)


def _linear_kernel(bf16: bool):
    if bf16:
        from blutensor.backends.cupy.linalg import LinearCuda

        return LinearCuda
    return _GenericLinear


def _gelu_kernel(x):
    """The dispatcher's gelu kernel for raw array ``x`` (a tracer's arrays take the array-generic host kernel)."""
    from blutensor.ops.dispatch import kernel_for

    return kernel_for("gelu", "cuda" if is_cuda_array(x) else "cpu", "bfloat16" if x.dtype == _BF16 else x.dtype.name)


def _gelu_grad(gctx, dh, u):
    """dh * gelu_tanh'(u): the gelu kernel's backward where its forward context exists, else the CUDA gelu kernel
    (CuPy) or the generic formula (host floats)."""
    if gctx is not None:
        return _gelu_kernel(u).backward(gctx, dh)[0]
    if is_cuda_array(u):
        from blutensor.backends.cupy._loader import cupy
        from blutensor.backends.cupy.gelu import gelu_backward

        return gelu_backward(cupy().ascontiguousarray(dh), u, "tanh")
    from blutensor.ops import nn_ops

    c = Ctx()
    c.saved = (u, "tanh")
    return nn_ops.gelu_backward(c, dh)[0]


def gelu_mlp_forward(ctx, x, w1, b1, w2, b2, save_hidden: bool = False):
    """``gelu_tanh(x @ w1.T + b1) @ w2.T + b2`` of raw arrays (x (..., d_in), w1 (d_ff, d_in), w2 (d_out, d_ff), b1 /
    b2 1-D or None; all float32, or all bf16 bits on CUDA); ``ctx`` keeps what :func:`gelu_mlp_backward` needs. float32
    recomputes the GELU output in backward unless ``save_hidden``; bf16 always keeps it."""
    bf16 = x.dtype == _BF16
    save_hidden = bf16 or bool(save_hidden)
    xshape = tuple(x.shape)
    x2 = x.reshape(-1, xshape[-1])
    lin = _linear_kernel(bf16)
    prov = fusing_provider(x2)
    fused = None
    if prov is not None:
        from blutensor.gemm import provider_linear_gelu

        fused = provider_linear_gelu(prov, x2, w1, b1, array_module(x2))
    fc = gctx = None  # the c_fc linear's and the gelu's kernel contexts when they ran as separate kernels
    if fused is None:
        prov = None
        fc = Ctx()
        fc.needs = (True, True, b1 is not None)
        u = lin.forward(fc, x2, w1, b1)
        gctx = Ctx()
        h = _gelu_kernel(u).forward(gctx, u, approximate="tanh")
    else:
        h, u = fused
    pc = Ctx()
    pc.needs = (True, True, b2 is not None)
    y = lin.forward(pc, h, w2, b2)
    ctx.saved = (x2, xshape, w1, b1 is not None, u, w2, b2 is not None, prov, fc, gctx, pc if save_hidden else None,
                 bf16)
    return y.reshape(*xshape[:-1], w2.shape[0])


def gelu_mlp_backward(ctx, g):
    """Gradients (x, w1, b1, w2, b2) of :func:`gelu_mlp_forward` for its output gradient ``g``, each where
    ``ctx.needs`` asks; ``ACCUMULATED`` for one added into its ``ctx.grad_into`` buffer."""
    x2, xshape, w1, has_b1, u, w2, has_b2, prov, fc, gctx, pc, bf16 = ctx.saved
    n_x, n_w1, n_b1, n_w2, n_b2 = (tuple(ctx.needs) + (False,) * 5)[:5]
    n_b1, n_b2 = n_b1 and has_b1, n_b2 and has_b2
    into = (tuple(getattr(ctx, "grad_into", None) or ()) + (None,) * 5)[:5]
    lin = _linear_kernel(bf16)
    xp = array_module(u)
    g2 = g.reshape(-1, g.shape[-1])
    need_du = n_x or n_w1 or n_b1
    from blutensor import gemm

    fuse = need_du and prov is not None and "dgelu" in gemm.fused_epilogues(prov)
    h = None
    if pc is None:  # float32: the GELU output recomputed for c_proj's weight gradient
        gctx = Ctx()
        h = _gelu_kernel(u).forward(gctx, u, approximate="tanh")
        pc = Ctx()
        pc.saved = (h, w2, h.shape)  # the generic linear rule's context
    # c_proj: weight and bias gradients (and its input gradient when the GELU backward is not fused)
    pc.needs = (need_du and not fuse, n_w2, n_b2)
    pc.grad_into = (None, into[3], into[4]) if into[3] is not None or into[4] is not None else None
    dh, gw2, gb2 = lin.backward(pc, g)
    pc = h = None  # the recomputed GELU output is dead before du is allocated
    du = gb1 = None
    if fuse:
        du, gb1 = _fused_dgelu(prov, g2, w2, u, n_b1, into[2], xp)
        if du is None:  # no fused form for this problem: the product, then the gelu backward
            dh = _matmul(prov, g2, w2, bf16)
    if need_du and du is None:
        du = _gelu_grad(gctx, dh.reshape(u.shape), u)
    del dh
    # c_fc: input and weight gradients, and its bias gradient unless the dgelu GEMM wrote it
    gx = gw1 = None
    n_b1_left = n_b1 and gb1 is None
    if n_x or n_w1 or n_b1_left:
        if fc is None:  # c_fc ran fused into the gelu GEMM: its linear backward from the saved input
            fc = Ctx()
            fc.saved = (prov, x2, w1, xshape) if bf16 else (x2, w1, xshape)
        fc.needs = (n_x, n_w1, n_b1_left)
        b_into = into[2] if n_b1_left else None
        fc.grad_into = (None, into[1], b_into) if into[1] is not None or b_into is not None else None
        gx, gw1, gb = lin.backward(fc, du)
        if gx is not None:
            gx = gx.reshape(xshape)
        if n_b1_left:
            gb1 = gb
    return gx, gw1, gb1, gw2, gb2


def _fused_dgelu(prov, g2, w2, u, want_bias: bool, buf, xp):
    """(du, c_fc's bias gradient) from ONE 'dgelu' GEMM; du None when the provider has no fused form. The bias
    gradient: None (not asked, or the GEMM could not write it: the bias GEMV adds it later), ACCUMULATED (added into
    ``buf``), or an array (float32, bf16 bits for bf16 ``u``)."""
    from blutensor.gemm import provider_matmul_dgelu

    if want_bias:
        sums = xp.empty(u.shape[-1], dtype=np.float32)
        du = provider_matmul_dgelu(prov, g2, w2, u, xp, bias_grad=sums)
        if du is not None:
            if buf is not None:
                buf += sums  # the GEMM writes its sums; the .grad buffer accumulates
                return du, ACCUMULATED
            return du, f32_to_bf16_bits(sums, xp) if u.dtype == _BF16 else sums
    return provider_matmul_dgelu(prov, g2, w2, u, xp), None


def _matmul(prov, g2, w2, bf16: bool):
    """g2 @ w2 as the linear backward's input-gradient GEMM computes it (bf16 GEMM through ``prov``, else the
    GEMM provider path of float32)."""
    if bf16:
        from blutensor.backends.cupy.linalg import mm

        return mm(prov, g2, w2)
    return la.gemm(g2, w2)
