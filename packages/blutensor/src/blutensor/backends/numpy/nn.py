"""CPU op kernel classes over kernels.c: gelu, layer_norm, rms_norm, cross_entropy, embedding, sdpa (float32).

Each class subclasses the built-in op's kernel (same dispatch flags), serves backend 'cpu' at PRIORITY 10 and
runs the NumPy reference (the built-in op's kernel, ``blutensor.ops.nn_ops``; looked up at each call, so a tracer
that substitutes it, blucompiler's, is followed) for calls the compiled kernel does not cover and when the library
is unavailable; ``ctx.ref`` records which of the two ran so backward matches forward.
"""

from __future__ import annotations

import math

import numpy as np

from blutensor.backends.numpy._build import lib as _lib
from blutensor.ops._util import into_grad, sum_pending
from blutensor.ops.table import OPS

_F32 = np.dtype(np.float32)
_DTYPES = ("float32", "bfloat16")  # bfloat16 arrives widened to float32 by the dispatcher


def _c(a):
    return np.ascontiguousarray(a)


def _ref(ctx) -> bool:
    return getattr(ctx, "ref", False)


def _host(*arrays) -> bool:
    """All given arrays are NumPy arrays (a tracer's array-likes, blucompiler's, take the reference path)."""
    return all(a is None or type(a) is np.ndarray for a in arrays)


class GeluCpu(OPS["gelu"]):
    """tanh-GELU: y and dx in one pass each, gelu' recomputed from x (the erf form runs the reference)."""

    PLUGIN_NAME = "blutensor.cpu.gelu"
    BACKEND = "cpu"
    DTYPES = _DTYPES
    PRIORITY = 10

    @staticmethod
    def forward(ctx, x, approximate="none"):
        lib = _lib()
        if lib is None or approximate != "tanh" or not _host(x) or x.dtype != _F32:
            ctx.ref = True
            return OPS["gelu"].forward(ctx, x, approximate=approximate)
        x = _c(x)
        y = np.empty_like(x)
        lib.blu_gelu_tanh_forward(x.ctypes.data, y.ctypes.data, x.size)
        ctx.saved = (x,)
        return y

    @staticmethod
    def backward(ctx, g):
        if _ref(ctx):
            return OPS["gelu"].backward(ctx, g)
        (x,) = ctx.saved
        g = _c(g.astype(_F32, copy=False))
        dx = np.empty_like(x)
        _lib().blu_gelu_tanh_backward(g.ctypes.data, x.ctypes.data, dx.ctypes.data, x.size)
        return (dx,)


def _vec(p, C: int) -> bool:
    return p is None or (p.dtype == _F32 and p.shape == (C,))


class LayerNormCpu(OPS["layer_norm"]):
    """LayerNorm over the last dim: mean/rstd saved (not xhat), dweight/dbias from fixed row blocks."""

    PLUGIN_NAME = "blutensor.cpu.layer_norm"
    BACKEND = "cpu"
    DTYPES = _DTYPES
    PRIORITY = 10

    @staticmethod
    def forward(ctx, x, w=None, b=None, normalized_shape=(), eps=1e-5):
        lib = _lib()
        ns = tuple(normalized_shape)
        C = x.shape[-1] if x.ndim else 0
        if (lib is None or not _host(x, w, b) or len(ns) != 1 or ns[0] != C or x.dtype != _F32 or x.size == 0
                or not _vec(w, C)
                or not _vec(b, C)):
            ctx.ref = True
            return OPS["layer_norm"].forward(ctx, x, w, b, normalized_shape=normalized_shape, eps=eps)
        x = _c(x)
        w = None if w is None else _c(w)
        b = None if b is None else _c(b)
        N = x.size // C
        y = np.empty_like(x)
        mean = np.empty(N, _F32)
        rstd = np.empty(N, _F32)
        lib.blu_layer_norm_forward(x.ctypes.data, None if w is None else w.ctypes.data,
                                   None if b is None else b.ctypes.data, y.ctypes.data, mean.ctypes.data,
                                   rstd.ctypes.data, N, C, float(eps))
        ctx.saved = (x, w, b is not None, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        if _ref(ctx):
            return OPS["layer_norm"].backward(ctx, g)
        x, w, has_b, mean, rstd = ctx.saved
        needs = ctx.needs
        C = x.shape[-1]
        N = x.size // C
        g = _c(g.astype(_F32, copy=False))
        gx = np.empty_like(x) if needs[0] else None
        dw = np.empty(C, _F32) if w is not None and len(needs) > 1 and needs[1] else None
        db = np.empty(C, _F32) if has_b and len(needs) > 2 and needs[2] else None
        part = np.empty(-(-N // 32) * 2 * C if dw is not None or db is not None else 1, _F32)
        _lib().blu_layer_norm_backward(
            g.ctypes.data, x.ctypes.data, None if w is None else w.ctypes.data, mean.ctypes.data, rstd.ctypes.data,
            None if gx is None else gx.ctypes.data, part.ctypes.data, None if dw is None else dw.ctypes.data,
            None if db is None else db.ctypes.data, N, C)
        return sum_pending(ctx, 0, gx), into_grad(ctx, 1, dw), into_grad(ctx, 2, db)


class RmsNormCpu(OPS["rms_norm"]):
    """RMSNorm over the last dim: x and rstd saved, dweight from fixed row blocks (added into the float32 ``.grad``
    buffer the engine offers); the arithmetic of ``F.add_rms_norm``'s compiled kernels, so that the fused op's
    values are bitwise add + rms_norm's."""

    PLUGIN_NAME = "blutensor.cpu.rms_norm"
    BACKEND = "cpu"
    DTYPES = _DTYPES
    PRIORITY = 10
    SAVES = (0, 1)

    @staticmethod
    def forward(ctx, x, w=None, normalized_shape=(), eps=1e-6):
        lib = _lib()
        ns = tuple(normalized_shape)
        C = x.shape[-1] if x.ndim else 0
        if (lib is None or not _host(x, w) or len(ns) != 1 or ns[0] != C or x.dtype != _F32 or x.size == 0
                or not _vec(w, C)):
            ctx.ref = True
            return OPS["rms_norm"].forward(ctx, x, w, normalized_shape=normalized_shape, eps=eps)
        x = _c(x)
        w = None if w is None else _c(w)
        N = x.size // C
        y = np.empty_like(x)
        rstd = np.empty(N, _F32)
        lib.blu_rms_norm_forward(x.ctypes.data, None if w is None else w.ctypes.data, y.ctypes.data,
                                 rstd.ctypes.data, N, C, float(eps))
        ctx.saved = (x, w, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        if _ref(ctx):
            return OPS["rms_norm"].backward(ctx, g)
        x, w, rstd = ctx.saved
        needs = ctx.needs
        C = x.shape[-1]
        N = x.size // C
        g = _c(g.astype(_F32, copy=False))
        gx = np.empty_like(x) if needs[0] else None
        dw = np.empty(C, _F32) if w is not None and len(needs) > 1 and needs[1] else None
        part = np.empty(-(-N // 32) * C if dw is not None else 1, _F32)
        _lib().blu_rms_norm_backward(
            g.ctypes.data, x.ctypes.data, None if w is None else w.ctypes.data, rstd.ctypes.data,
            None if gx is None else gx.ctypes.data, part.ctypes.data, None if dw is None else dw.ctypes.data, N, C)
        return gx, into_grad(ctx, 1, dw)


class CrossEntropyCpu(OPS["cross_entropy"]):
    """Softmax cross-entropy over the last dim: loss and log-sum-exp per row in one read of the logits;
    backward writes (softmax - onehot) * scale in one pass, in float32."""

    PLUGIN_NAME = "blutensor.cpu.cross_entropy"
    BACKEND = "cpu"
    DTYPES = _DTYPES
    PRIORITY = 10

    @staticmethod
    def forward(ctx, logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0):
        lib = _lib()
        ok = (lib is not None and _host(logits, target) and logits.dtype == _F32 and logits.ndim >= 1
              and logits.size > 0
              and getattr(target, "shape", None) == logits.shape[:-1] and reduction in ("mean", "sum", "none")
              and getattr(target, "dtype", _F32).kind in "iu" and isinstance(ignore_index, int))
        if ok:
            C = logits.shape[-1]
            t = _c(target.reshape(-1).astype(np.int64, copy=False))
            valid = t != ignore_index
            ok = not bool((((t < 0) | (t >= C)) & valid).any())
        if not ok:  # the reference serves the rest and names bad shapes, reductions and targets
            ctx.ref = True
            return OPS["cross_entropy"].forward(ctx, logits, target, ignore_index=ignore_index, reduction=reduction,
                                                label_smoothing=label_smoothing)
        z = _c(logits.reshape(-1, C))
        N = z.shape[0]
        loss = np.empty(N, _F32)
        lse = np.empty(N, _F32)
        ls = float(label_smoothing)
        lib.blu_cross_entropy_forward(z.ctypes.data, t.ctypes.data, loss.ctypes.data, lse.ctypes.data, N, C,
                                      ignore_index, ls)
        count = int(valid.sum())
        ctx.saved = (z, t, lse, count, reduction, logits.shape, ignore_index, ls)
        if reduction == "none":
            return loss.reshape(target.shape)
        total = loss.sum()
        if reduction == "sum":
            return np.asarray(total, _F32)
        return np.asarray(total / count if count else np.nan, _F32)

    @staticmethod
    def backward(ctx, g):
        if _ref(ctx):
            return OPS["cross_entropy"].backward(ctx, g)
        z, t, lse, count, reduction, shape, ignore_index, ls = ctx.saved
        N, C = z.shape
        if reduction == "none":
            scale, stride = _c(np.asarray(g, _F32).reshape(-1)), 1
        else:
            s = float(g) if reduction == "sum" else float(g) / max(count, 1)
            scale, stride = np.array([s], _F32), 0
        dz = np.empty_like(z)
        _lib().blu_cross_entropy_backward(z.ctypes.data, t.ctypes.data, lse.ctypes.data, scale.ctypes.data, stride,
                                          dz.ctypes.data, N, C, ignore_index, ls)
        return dz.reshape(shape), None


class EmbeddingCpu(OPS["embedding"]):
    """Embedding: the reference gather forward; backward accumulates rows in token order, threads owning
    column slices (deterministic, no atomics)."""

    PLUGIN_NAME = "blutensor.cpu.embedding"
    BACKEND = "cpu"
    DTYPES = _DTYPES
    PRIORITY = 10

    @staticmethod
    def forward(ctx, idx, weight):
        out = OPS["embedding"].forward(ctx, idx, weight)  # range check and gather
        ctx.ref = (_lib() is None or not _host(idx, weight) or weight.dtype != _F32 or weight.ndim != 2
                   or idx.dtype.kind not in "iu")
        return out

    @staticmethod
    def backward(ctx, g):
        if _ref(ctx):
            return OPS["embedding"].backward(ctx, g)
        idx, wshape = ctx.saved
        V, D = wshape
        i = _c(idx.reshape(-1).astype(np.int64, copy=False))
        g = _c(g.astype(_F32, copy=False).reshape(-1, D))
        gw = np.empty(wshape, _F32)
        _lib().blu_embedding_backward(i.ctypes.data, g.ctypes.data, gw.ctypes.data, i.size, V, D)
        return None, into_grad(ctx, 1, gw)


class SdpaCpu(OPS["sdpa"]):
    """Flash-style attention without mask or dropout: (..., L, E) x (..., S, E) x (..., S, Ev), optional causal
    (key j <= query i), output and log-sum-exp saved; backward recomputes the probabilities row by row."""

    PLUGIN_NAME = "blutensor.cpu.sdpa"
    BACKEND = "cpu"
    DTYPES = _DTYPES
    PRIORITY = 10

    @staticmethod
    def forward(ctx, q, k, v, mask=None, scale=None, is_causal=False, dropout_p=0.0, seed=0, offset=0):
        lib = _lib()
        ok = (lib is not None and mask is None and not dropout_p and _host(q, k, v) and q.ndim >= 2
              and q.ndim == k.ndim == v.ndim
              and q.dtype == k.dtype == v.dtype == _F32 and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]
              and q.shape[-1] == k.shape[-1] and k.shape[-2] == v.shape[-2] and q.size and k.size and v.size)
        if not ok:
            ctx.ref = True
            return OPS["sdpa"].forward(ctx, q, k, v, mask, scale=scale, is_causal=is_causal, dropout_p=dropout_p,
                                       seed=seed, offset=offset)
        q, k, v = _c(q), _c(k), _c(v)
        L, E = q.shape[-2:]
        S, Ev = v.shape[-2:]
        BH = q.size // (L * E)
        sc = float(scale) if scale is not None else 1.0 / math.sqrt(E)
        o = np.empty(q.shape[:-1] + (Ev,), _F32)
        lse = np.empty(BH * L, _F32)
        lib.blu_sdpa_forward(q.ctypes.data, k.ctypes.data, v.ctypes.data, o.ctypes.data, lse.ctypes.data, BH, L, S,
                             E, Ev, sc, int(bool(is_causal)))
        ctx.saved = (q, k, v, o, lse, sc, bool(is_causal))
        return o

    @staticmethod
    def backward(ctx, g):
        if _ref(ctx):
            return OPS["sdpa"].backward(ctx, g)
        q, k, v, o, lse, sc, causal = ctx.saved
        L, E = q.shape[-2:]
        S, Ev = v.shape[-2:]
        BH = q.size // (L * E)
        g = _c(g.astype(_F32, copy=False))
        dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
        _lib().blu_sdpa_backward(q.ctypes.data, k.ctypes.data, v.ctypes.data, o.ctypes.data, g.ctypes.data,
                                 lse.ctypes.data, dq.ctypes.data, dk.ctypes.data, dv.ctypes.data, BH, L, S, E, Ev, sc,
                                 int(causal))
        needs = ctx.needs
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None, None)
