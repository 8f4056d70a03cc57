"""Dispatch: pick the kernel for (op, backend, dtype), run it, record the graph node.

Selection: ``BLUTRAIN_KERNELS="op=plugin,..."`` or :func:`use_kernel`, else the highest PRIORITY
among matching kernels (ties go to blutensor's built-in). The choice is cached per key.
"""

from __future__ import annotations

import os

import numpy as np

from blutensor.autograd.grad_mode import STATE
from blutensor.autograd.node import Ctx, Node
from blutensor.backend import bf16_bits_to_f32, f32_to_bf16_bits
from blutensor.errors import BluTensorError, DeviceError, DTypeError, ShapeError, describe

_cache: dict = {}
_overrides: dict[str, str] = {}
#: profiler/tracer callbacks: ``observer(op, inputs, attrs, run) -> result`` wraps every op call;
#: empty list = no cost beyond one truthiness test per op
observers: list = []


def add_observer(fn) -> None:
    """Wrap every subsequent op call with ``fn(op, inputs, attrs, run)`` (profilers, tracers)."""
    observers.append(fn)


def remove_observer(fn) -> None:
    if fn in observers:
        observers.remove(fn)


def clear_cache() -> None:
    _cache.clear()


def use_kernel(op: str, plugin_name: str | None) -> None:
    """Force op ``op`` to use the kernel plugin ``plugin_name`` (None: back to automatic)."""
    if plugin_name is None:
        _overrides.pop(op, None)
    else:
        _overrides[op] = plugin_name
    clear_cache()


def _env_overrides() -> dict[str, str]:
    spec = os.environ.get("BLUTRAIN_KERNELS", "")
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if "=" not in item:
            raise BluTensorError(f"BLUTRAIN_KERNELS entry {item!r} is not of the form op=plugin")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def resolve(op: str, backend: str, dtype: str):
    """The kernel class for (op, backend, dtype)."""
    key = (op, backend, dtype)
    k = _cache.get(key)
    if k is not None:
        return k
    from blutensor.plugin import get_host

    reg = get_host().registry("kernel")
    cands = reg.for_op(op, backend, dtype) + reg.for_op(op, "*", dtype)
    if not cands:
        raise BluTensorError(f"no kernel implements op '{op}' for backend {backend} and dtype {dtype}")
    want = {**_env_overrides(), **_overrides}.get(op)
    if want:
        chosen = [r for r in cands if r.name == want]
        if not chosen:
            raise BluTensorError(f"kernel {want!r} configured for op '{op}' does not exist or does not serve "
                                 f"backend {backend}/dtype {dtype}; candidates: {[r.name for r in cands]}")
        k = chosen[0].cls
    else:
        cands.sort(key=lambda r: (getattr(r.cls, "PRIORITY", 0), r.name == f"blutensor.{op}"), reverse=True)
        k = cands[0].cls
    _cache[key] = k
    return k


class _Widened:
    """Runs a float32 kernel for bfloat16 tensors: widen inputs, narrow outputs and gradients."""

    __slots__ = ("kernel", "bf16_inputs", "cuda")

    def __init__(self, kernel, bf16_inputs, cuda):
        self.kernel, self.bf16_inputs, self.cuda = kernel, bf16_inputs, cuda

    def widen(self, a):
        if self.cuda:
            import cupy

            return bf16_bits_to_f32(a, cupy)
        return a.astype(np.float32)

    def narrow(self, a):
        if a is None or a.dtype != np.float32:
            return a
        if self.cuda:
            import cupy

            return f32_to_bf16_bits(a, cupy)
        import ml_dtypes

        return a.astype(ml_dtypes.bfloat16)

    def backward(self, ctx, g):
        grads = self.kernel.backward(ctx, self.widen(g))
        if not isinstance(grads, tuple):
            grads = (grads,)
        return tuple(self.narrow(gr) if i < len(self.bf16_inputs) and self.bf16_inputs[i] else gr
                     for i, gr in enumerate(grads))


def apply(op: str, *inputs, **attrs):
    """Run op ``op`` on ``inputs`` (Tensors, None or Python scalars) and return the result Tensor."""
    if observers:
        return _observed(0, op, inputs, attrs)
    return _apply(op, inputs, attrs)


def _observed(i: int, op: str, inputs, attrs):
    if i == len(observers):
        return _apply(op, inputs, attrs)
    return observers[i](op, inputs, attrs, lambda: _observed(i + 1, op, inputs, attrs))


def _apply(op: str, inputs, attrs):
    from blutensor._tensor import Tensor

    tensors = [t for t in inputs if isinstance(t, Tensor)]
    first = tensors[0]
    dev = first.device
    for t in tensors:
        if t.device != dev:
            raise DeviceError(f"{op}: expected all tensors on one device, got "
                              + ", ".join(describe(x) for x in tensors))
    kcls = _cache.get((op, dev.type, first.dtype.name))
    if kcls is None:
        kcls = resolve(op, dev.type, _dtype_key(op, inputs))
    if kcls.SAME_DTYPE:
        dts = {inputs[i].dtype for i in kcls.SAME_DTYPE if i < len(inputs) and isinstance(inputs[i], Tensor)}
        if len(dts) > 1:
            raise DTypeError(f"{op}: expected tensors of one dtype, got "
                             + ", ".join(describe(x) for x in tensors) + " (convert with .to(dtype))")
    dtype = inputs[kcls.DTYPE_ARG].dtype if isinstance(inputs[kcls.DTYPE_ARG], Tensor) else first.dtype
    arrays = [t._data if isinstance(t, Tensor) else t for t in inputs]
    kernel = kcls
    if dtype.name == "bfloat16" and not kcls.BF16_NATIVE:
        bf = tuple(isinstance(t, Tensor) and t.dtype is dtype for t in inputs)
        kernel = _Widened(kcls, bf, dev.type == "cuda")
        arrays = [kernel.widen(a) if b else a for a, b in zip(arrays, bf)]
    record = STATE.enabled and kcls.DIFFERENTIABLE and any(t.requires_grad for t in tensors)
    ctx = Ctx()
    if record:
        ctx.needs = tuple(isinstance(t, Tensor) and t.requires_grad for t in inputs)
    try:
        out = kcls.forward(ctx, *arrays, **attrs)
    except BluTensorError:
        raise
    except (ValueError, TypeError, IndexError) as e:
        raise ShapeError(f"{op} failed on " + ", ".join(describe(x) for x in tensors) + f": {e}") from None
    if kernel is not kcls:
        out = kernel.narrow(out)
    odt = dtype if out.dtype == arrays_dtype(dtype, dev) else None
    res = Tensor._from_data(out, odt, dev)
    if kcls.VIEW:
        res._version = first._version
        res._base = first if first._base is None else first._base
    if record:
        versions = [(inputs[i]._version, inputs[i]._version.v, f"input {i} of shape {tuple(inputs[i].shape)}")
                    for i in kcls.SAVES if i < len(inputs) and isinstance(inputs[i], Tensor)]
        if kcls.SAVES_OUTPUT:
            versions.append((res._version, res._version.v, f"its output of shape {tuple(res.shape)}"))
        node = Node(op, kernel, ctx, inputs, versions)
        res.grad_fn = node
        res.requires_grad = True
    return res


def arrays_dtype(dtype, dev):
    return dtype.cuda_storage if dev.type == "cuda" else dtype.np


def _dtype_key(op, inputs) -> str:
    from blutensor.ops.table import OPS
    from blutensor._tensor import Tensor

    k = OPS.get(op)
    i = k.DTYPE_ARG if k is not None else 0
    t = inputs[i] if i < len(inputs) and isinstance(inputs[i], Tensor) else \
        next(x for x in inputs if isinstance(x, Tensor))
    return t.dtype.name
