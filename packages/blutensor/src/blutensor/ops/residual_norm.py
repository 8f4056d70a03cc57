"""``add_rms_norm`` / ``add_layer_norm``: the residual add and the norm of a pre-norm block as one op with two
outputs (RMSNorm for the Llama family, LayerNorm for GPT-2: LayerNorm is RMSNorm of the centred row plus a bias).

``h, y = add_rms_norm(x, residual, ...)`` is ``h = x + residual`` (the new residual stream) and
``y = rms_norm(h) * weight`` (the next sublayer's input), computed in one pass over the rows; its backward is one
pass too: the gradient of the sum is ``rms_norm``'s backward of ``y``'s gradient plus the gradient that reached ``h``
directly, written once for both addends.

The autograd engine records one node per result, so the op is two nodes: ``y``'s node (``add_rms_norm``, inputs x,
residual, weight; ``add_layer_norm``: x, residual, weight, bias) does the whole backward, and ``h``'s node
(``add_rms_norm_sum`` / ``add_layer_norm_sum``, input y) only hands the gradient of ``h`` to it. ``h``'s node
depends on ``y``, so the engine runs it first; ``y``'s node runs even when no gradient reached ``y``
(``RUN_WITHOUT_GRAD``), so ``h``'s gradient is never lost.

Array paths: the fused CUDA kernels (kernels/add_rms_norm.cu, the residual-norm kernels of both norms; fp32/bf16
storage per tensor, so autocast's bf16 sublayer output, fp32 residual stream and bf16 normalised output need no
casts) and, on CPU, the compiled kernels for float32 (``backends/numpy/residual_norm.py``, kernels.c) or the NumPy
reference (``decoder_ops.add_rms_norm_rows`` / ``add_layer_norm_rows``; float64, or without a C compiler). Any
other combination runs as ``x + residual`` then ``rms_norm`` / ``layer_norm`` through the ordinary ops (the same
values).

LayerNorm's arithmetic is that of the ``layer_norm`` kernels of each device (kernels/layer_norm.cu's
register-resident rows, kernels.c's ``blu_layer_norm_*``, ``nn_ops.layer_norm_*``), so the fused op gives bitwise
the results of ``x + residual``, ``layer_norm`` (and autocast's cast of its output) in float32 and under autocast
(with bf16 storage throughout, the addends' gradient is rounded to bf16 once, where the op-by-op path rounds
twice); its weight and bias gradients are added into the float32 ``.grad`` buffers the engine offers
(``GRAD_INTO``), as ``layer_norm``'s are. ``add_rms_norm``'s weight gradient likewise (as ``rms_norm``'s); on the
CPU its float32 kernels share ``rms_norm``'s row arithmetic (kernels.c), so there too the fused op gives bitwise
the add then ``rms_norm``.
"""

from __future__ import annotations

import numpy as np
from blutensor.ops import decoder_ops as ref


class _NormKernel:
    """Backward of ``y``'s node (``add_rms_norm``): the whole fused backward (gradients of x, residual, weight); the
    weight gradient goes into the float32 ``.grad`` buffer the engine offers (``GRAD_INTO``)."""

    RUN_WITHOUT_GRAD = True  # the gradient of h may have arrived alone (engine: apply even when grad is None)
    GRAD_INTO = True

    @staticmethod
    def backward(ctx, gy):
        from blutensor.ops._util import into_grad

        gh, ctx.gh = ctx.gh, None
        h2, w, rstd, path, x_dtype, shape = ctx.saved
        needs = ctx.needs
        if gy is not None:
            gy = gy.reshape(h2.shape)
        if gh is not None:
            gh = gh.reshape(h2.shape)
        if gy is None and gh is None:
            return None, None, None
        if path == "cuda":
            from blutensor.backends.cupy import decoder

            cp = decoder.cupy()
            gy = None if gy is None else cp.ascontiguousarray(gy)
            gh = None if gh is None else cp.ascontiguousarray(gh)
            into = tuple(getattr(ctx, "grad_into", None) or ()) + (None,) * 3
            dwi = into[2].reshape(-1) if needs[2] and w is not None and into[2] is not None else None
            dres, dx, dw = decoder.add_rms_norm_backward(gy, gh, h2, w, rstd, x_dtype, bool(needs[2]), dwi)
            dx = dres if dx is None else dx
            if dwi is not None:
                from blutensor.autograd.node import ACCUMULATED

                dw = ACCUMULATED
        elif path == "c":
            from blutensor.backends.numpy import residual_norm as ck

            dres, dw = ck.backward(gy, gh, h2, w, rstd, bool(needs[2]))
            dx = dres
            dw = into_grad(ctx, 2, dw)
        else:
            dres, dw = ref.add_rms_norm_rows_backward(gy, gh, h2, w, rstd, bool(needs[2]))
            dx = dres.astype(x_dtype, copy=False)
            dw = into_grad(ctx, 2, dw)
        return (dx.reshape(shape) if needs[0] else None, dres.reshape(shape) if needs[1] else None,
                dw if needs[2] else None)


class _LayerNormKernel:
    """Backward of ``y``'s node (``add_layer_norm``): gradients of x, residual, weight and bias in one pass; the
    weight and bias gradients go into the float32 ``.grad`` buffers the engine offers (``GRAD_INTO``)."""

    PLUGIN_NAME = "blutensor.add_layer_norm"  # the kernel name profilers report (one class serves every device)
    RUN_WITHOUT_GRAD = True
    GRAD_INTO = True

    @staticmethod
    def backward(ctx, gy):
        from blutensor.ops._util import into_grad

        gh, ctx.gh = ctx.gh, None
        h2, w, b_shape, stats, path, x_dtype, shape, n, nshape = ctx.saved
        needs = tuple(ctx.needs)
        if gy is not None:
            gy = gy.reshape(h2.shape)
        if gh is not None:
            gh = gh.reshape(h2.shape)
        if gy is None and gh is None:
            return None, None, None, None
        need_dw, need_db = bool(needs[2]) and w is not None, bool(needs[3]) and b_shape is not None
        into = tuple(getattr(ctx, "grad_into", None) or ()) + (None,) * 4
        if path == "cuda":
            from blutensor.backends.cupy import layer_norm as k

            cp = k.cupy()
            gy = None if gy is None else cp.ascontiguousarray(_as_storage(gy, ctx.y_storage))
            gh = None if gh is None else cp.ascontiguousarray(_as_storage(gh, h2.dtype))
            dwi = into[2] if need_dw and into[2] is not None else None
            dbi = into[3] if need_db and into[3] is not None else None
            dres, dx, dw, db = k.add_layer_norm_backward(gy, gh, h2, w, stats[0], stats[1], x_dtype, need_dw,
                                                         need_db, dwi, dbi, ctx.param_storage)
            dx = dres if dx is None else dx
            from blutensor.autograd.node import ACCUMULATED

            dw = ACCUMULATED if dwi is not None and dw is not None else None if dw is None else dw.reshape(nshape)
            db = ACCUMULATED if dbi is not None and db is not None else None if db is None else db.reshape(nshape)
        else:
            if path == "c":
                from blutensor.backends.numpy import residual_norm as ck

                dres, dw, db = ck.ln_backward(gy, gh, h2, w, stats[0], stats[1], need_dw, need_db)
                dx = dres
            else:
                dres, dw, db = ref.add_layer_norm_rows_backward(gy, gh, h2, w, stats, need_dw, need_db, n)
                dx = dres.astype(x_dtype, copy=False)
            dw = None if dw is None else dw.reshape(nshape)
            db = None if db is None else db.reshape(nshape)
            dw, db = into_grad(ctx, 2, dw), into_grad(ctx, 3, db)
        return (dx.reshape(shape) if needs[0] else None, dres.reshape(shape) if needs[1] else None,
                dw if need_dw else None, db if need_db else None)


def _as_storage(g, storage):
    """A CUDA gradient array in the given storage (float32 or uint16 bf16 bits): the kernels' entries are per mix."""
    if g.dtype == storage:
        return g
    from blutensor.backends.cupy.cast import to_bf16, to_f32

    return to_bf16(g) if storage == np.uint16 else to_f32(g)


class _SumKernel:
    """Backward of ``h``'s node: keeps the gradient of h for y's node (which runs next) and passes nothing on."""

    @staticmethod
    def backward(ctx, gh):
        ctx.saved[0].gh = gh
        return (None,)


def _storage(t):
    """'f32', 'bf16' or None (no fused kernel for this dtype)."""
    return {"float32": "f32", "bfloat16": "bf16"}.get(t.dtype.name)


def _fused_path(x, residual, params, y_dtype) -> str | None:
    """'cuda', 'cpu' (the compiled float32 kernels or the NumPy reference) or None (the op-by-op path)."""
    dev = residual.device.type
    if dev == "cuda":
        ok = all(t is None or _storage(t) for t in (x, residual, *params)) and y_dtype.name in ("float32", "bfloat16")
        # a tracer's arrays (blucompiler) take the op-by-op path, which it records (the kernels read device pointers)
        ok = ok and all(t is None or type(t._data).__module__.split(".")[0] == "cupy" for t in (x, residual, *params))
        return "cuda" if ok and (x.dtype == residual.dtype or residual.dtype.name == "float32") else None
    if dev == "cpu":
        dt = residual.dtype
        same = x.dtype == dt and all(p is None or p.dtype == dt for p in params) and y_dtype == dt
        return "cpu" if same and dt.name in ("float32", "float64") else None
    return None


def _observed(op: str, inputs, attrs, run):
    """``run()`` under the dispatch observers (profilers see and time the op by its name; they take one result,
    y); returns (h, y)."""
    from blutensor.ops import dispatch

    if not dispatch.observers:
        return run()
    obs = list(dispatch.observers)
    got = []

    def call(i):
        if i == len(obs):
            got.append(run())
            return got[-1][1]
        return obs[i](op, inputs, attrs, lambda: call(i + 1))

    y = call(0)
    return got[-1][0], y


def _record(op, kernel, ctx, inputs, h, y, shape):
    """The two nodes: y's (the whole backward) and h's (hands h's gradient to y's)."""
    from blutensor.autograd.node import Ctx, Node

    ctx.needs = tuple(t is not None and t.requires_grad for t in inputs)
    ctx.gh = None
    versions = [(h._version, h._version.v, -1, shape)]
    for i, p in enumerate(inputs[2:], start=2):
        if p is not None:
            versions.append((p._version, p._version.v, i, tuple(p.shape)))
    y.grad_fn = Node(op, kernel, ctx, inputs, versions)
    y.requires_grad = True
    hctx = Ctx()
    hctx.saved = (ctx,)
    h.grad_fn = Node(op + "_sum", _SumKernel, hctx, (y,), [])
    h.requires_grad = True


def add_rms_norm(x, residual, normalized_shape: tuple, weight, eps: float, y_dtype):
    """(h, y) with the arguments checked by ``blutensor.functional.add_rms_norm``; ``y_dtype`` the dtype of y."""
    from blutensor._tensor import Tensor
    from blutensor.autograd.grad_mode import STATE
    from blutensor.autograd.node import Ctx
    from blutensor.ops import dispatch

    path = _fused_path(x, residual, (weight,), y_dtype)
    if path is None or any(_traces(o) for o in dispatch.observers):
        return _composed(x, residual, normalized_shape, weight, eps, y_dtype)

    def run():
        C = int(np.prod(normalized_shape))
        shape = tuple(residual.shape)
        w = None if weight is None else weight._data.reshape(C)
        if path == "cuda":
            from blutensor.backends.cupy import decoder

            kind = "cuda"
            cp = decoder.cupy()
            x2 = cp.ascontiguousarray(x._data).reshape(-1, C)
            r2 = cp.ascontiguousarray(residual._data).reshape(-1, C)
            w = None if w is None else cp.ascontiguousarray(w)
            y_storage = np.uint16 if y_dtype.name == "bfloat16" else np.float32
            h2, y2, rstd = decoder.add_rms_norm_forward(x2, r2, w, eps, y_storage)
        else:
            from blutensor.backends.numpy import residual_norm as ck

            x2, r2 = x._data.reshape(-1, C), residual._data.reshape(-1, C)
            if ck.usable(x2, r2, w):  # the compiled kernels (float32)
                kind = "c"
                h2, y2, rstd = ck.forward(x2, r2, w, eps)
            else:
                kind = "numpy"
                h2, y2, rstd = ref.add_rms_norm_rows(x2, r2, w, eps, y_dtype.np)
        h = Tensor._from_data(h2.reshape(shape), residual.dtype, residual.device)
        y = Tensor._from_data(y2.reshape(shape), y_dtype, residual.device)
        inputs = (x, residual, weight)
        if STATE.enabled and any(t is not None and t.requires_grad for t in inputs):
            ctx = Ctx()
            ctx.saved = (h2, w, rstd, kind, x._data.dtype, tuple(x.shape))
            _record("add_rms_norm", _NormKernel, ctx, inputs, h, y, shape)
        return h, y

    return _observed("add_rms_norm", (x, residual, weight), {"normalized_shape": tuple(normalized_shape), "eps": eps},
                     run)


def add_layer_norm(x, residual, normalized_shape: tuple, weight, bias, eps: float, y_dtype):
    """(h, y) with the arguments checked by ``blutensor.functional.add_layer_norm``; ``y_dtype`` the dtype of y."""
    from blutensor._tensor import Tensor
    from blutensor.autograd.grad_mode import STATE
    from blutensor.autograd.node import Ctx
    from blutensor.ops import dispatch

    path = _fused_path(x, residual, (weight, bias), y_dtype)
    if path is not None and any(_traces(o) for o in dispatch.observers):
        path = None
    cuda_arrays = None
    if path == "cuda":
        cuda_arrays = _cuda_rows(x, residual, weight, bias, normalized_shape, y_dtype)
        path = None if cuda_arrays is None else path
    if path is None:
        return _composed_ln(x, residual, normalized_shape, weight, bias, eps, y_dtype)
    n = len(normalized_shape)

    def run():
        C = int(np.prod(normalized_shape))
        shape = tuple(residual.shape)
        w = None if weight is None else weight._data.reshape(C)
        b = None if bias is None else bias._data.reshape(C)
        if path == "cuda":
            from blutensor.backends.cupy import layer_norm as k

            kind = "cuda"
            x2, r2, w, b = cuda_arrays
            h2, y2, mean, rstd = k.add_layer_norm_forward(x2, r2, w, b, eps, _bits(y_dtype))
            stats = (mean, rstd)
        else:
            from blutensor.backends.numpy import residual_norm as ck

            x2, r2 = x._data.reshape(-1, C), residual._data.reshape(-1, C)
            if n == 1 and x2.size and ck.usable(x2, r2, w, b):  # the compiled kernels (float32)
                kind = "c"
                h2, y2, mean, rstd = ck.ln_forward(x2, r2, w, b, eps)
                stats = (mean, rstd)
            else:  # the reference over the tensors' own shape (the axes layer_norm's reference reduces over)
                kind = "numpy"
                h2, y2, stats = ref.add_layer_norm_rows(x._data, residual._data, None if weight is None else
                                                        weight._data, None if bias is None else bias._data, eps,
                                                        y_dtype.np, n)
        h = Tensor._from_data(h2.reshape(shape), residual.dtype, residual.device)
        y = Tensor._from_data(y2.reshape(shape), y_dtype, residual.device)
        inputs = (x, residual, weight, bias)
        if STATE.enabled and any(t is not None and t.requires_grad for t in inputs):
            ctx = Ctx()
            wd = None if weight is None else (weight._data if kind == "numpy" else w)
            ctx.saved = (h2 if kind != "numpy" else h._data, wd, None if bias is None else tuple(bias.shape), stats,
                         kind, x._data.dtype, tuple(x.shape), n, tuple(normalized_shape))
            ctx.y_storage = y2.dtype
            pd = weight if weight is not None else bias
            ctx.param_storage = None if pd is None else pd._data.dtype
            _record("add_layer_norm", _LayerNormKernel, ctx, inputs, h, y, shape)
        return h, y

    return _observed("add_layer_norm", (x, residual, weight, bias),
                     {"normalized_shape": tuple(normalized_shape), "eps": eps}, run)


def _bits(dt):
    """The storage dtype of a blutensor dtype on CUDA (bfloat16: uint16 bits)."""
    return np.dtype(np.uint16) if dt.name == "bfloat16" else np.dtype(dt.np)


def _cuda_rows(x, residual, weight, bias, normalized_shape, y_dtype):
    """(x2, r2, w, b) as contiguous CuPy rows for the fused CUDA kernels, or None when no kernel serves the call
    (weight and bias of different storages, a storage mix or row width without an entry, unaligned rows): the
    op then runs as add + layer_norm (the same values)."""
    from blutensor.backends.cupy import layer_norm as k

    C = int(np.prod(normalized_shape))
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        return None
    pd = (weight if weight is not None else bias)
    wd = np.dtype(np.float32) if pd is None else _bits(pd.dtype)
    if k.add_norm_nv(C, _bits(x.dtype), _bits(residual.dtype), _bits(y_dtype), wd) is None:
        return None
    cp = k.cupy()
    x2 = cp.ascontiguousarray(x._data).reshape(-1, C)
    r2 = cp.ascontiguousarray(residual._data).reshape(-1, C)
    w = None if weight is None else cp.ascontiguousarray(weight._data).reshape(C)
    b = None if bias is None else cp.ascontiguousarray(bias._data).reshape(C)
    return (x2, r2, w, b) if k.add_norm_aligned(x2, r2, w, b) else None


#: observers (by module prefix) that trace or rewrite ops: under them the op-by-op path runs (they see its ops)
TRACERS = ("blucompiler.", "dtms.")


def _traces(obs) -> bool:
    owner = getattr(obs, "__self__", obs)
    return (type(owner).__module__ if owner is not obs or not callable(getattr(obs, "__code__", None))
            else obs.__module__ or "").startswith(TRACERS)


def _composed(x, residual, normalized_shape, weight, eps, y_dtype):
    """The op-by-op path: ``x + residual``, then ``rms_norm`` (then a cast when y's dtype differs)."""
    from blutensor.functional import rms_norm

    h = residual + x
    y = rms_norm(h, normalized_shape, weight, eps)
    return h, (y if y.dtype == y_dtype else y.to(y_dtype))


def _composed_ln(x, residual, normalized_shape, weight, bias, eps, y_dtype):
    """The op-by-op path: ``residual + x``, then ``layer_norm`` (then a cast when y's dtype differs)."""
    from blutensor.functional import layer_norm

    h = residual + x
    y = layer_norm(h, normalized_shape, weight, bias, eps)
    return h, (y if y.dtype == y_dtype else y.to(y_dtype))
