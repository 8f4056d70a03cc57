"""Dispatch: pick the kernel for (op, backend, dtype), run it, record the graph node.

Selection: :func:`use_kernel`, else ``BLUTRAIN_KERNELS="op=plugin,..."`` (read once, at the first op:
``blutensor.policy.env_kernels``; ``bt.policy.reset_defaults()`` reads it again), else the highest PRIORITY
among matching kernels (ties go to blutensor's built-in). The choice is cached per
(op, backend, dtype); the cache is cleared whenever the plugin host, an override or those defaults change.

This is the hot path of every op: keep it free of per-call allocations beyond the Ctx, the
result Tensor and (when recording) the Node.
"""

from __future__ import annotations

import numpy as np
from blutensor import policy as _policy
from blutensor.autograd.grad_mode import STATE
from blutensor.autograd.node import Ctx, Node
from blutensor.backends import bf16_bits_to_f32, f32_to_bf16_bits
from blutensor.errors import BluTensorError, DeviceError, DTypeError, ShapeError, describe

_cache: dict = {}
_overrides: dict[str, str] = {}
#: profiler/tracer callbacks: ``observer(op, inputs, attrs, run) -> result`` wraps every op call;
#: empty list = no cost beyond one truthiness test per op
observers: list = []
#: autocast's input policy ``hook(op, inputs, attrs) -> (inputs, attrs)`` (blutensor.amp), None outside
#: autocast regions: one global test per op
autocast_hook = None
#: flags a kernel class may carry; plugin kernels that lack one inherit the built-in op's value
FLAGS = ("SAVES", "SAVES_OUTPUT", "SAME_DTYPE", "DTYPE_ARG", "VIEW", "DIFFERENTIABLE", "BF16_NATIVE")

_ndarray = np.ndarray
_Tensor = None  # blutensor._tensor.Tensor, bound on first use (import cycle)
_from_numpy_dtype = None


def add_observer(fn) -> None:
    """Wrap every subsequent op call with ``fn(op, inputs, attrs, run)`` (profilers, tracers)."""
    observers.append(fn)


def remove_observer(fn) -> None:
    if fn in observers:
        observers.remove(fn)


def clear_cache() -> None:
    """Forget the cached kernel choices (after plugins or overrides change)."""
    _cache.clear()


def use_kernel(op: str, plugin_name: str | None) -> None:
    """Force op ``op`` to use the kernel plugin ``plugin_name`` (None: back to automatic)."""
    if plugin_name is None:
        _overrides.pop(op, None)
    else:
        _overrides[op] = plugin_name
    clear_cache()


def kernel_for(op: str, backend: str, dtype: str):
    """:func:`resolve`, cached with the dispatcher's own choices (and cleared with them): for code that calls a
    kernel class directly on a hot path (GPT-2's fused GELU + c_proj backward)."""
    key = (op, backend, dtype, "kernel_for")
    k = _cache.get(key)
    if k is None:
        k = _cache[key] = resolve(op, backend, dtype)
    return k


def _with_flags(cls, op: str):
    """``cls`` itself when it carries every dispatch flag, else a subclass that fills the missing
    ones from the built-in kernel of ``op`` (so a minimal plugin class works)."""
    missing = [f for f in FLAGS if not hasattr(cls, f)]
    if not missing:
        return cls
    from blutensor.ops.table import OPS, Kernel

    base = OPS.get(op, Kernel)
    flags = {f: getattr(base, f) for f in missing}
    if "DIFFERENTIABLE" in missing:
        flags["DIFFERENTIABLE"] = callable(getattr(cls, "backward", None))
    return type(cls.__name__, (cls,), {**flags, "__module__": cls.__module__})


def resolve(op: str, backend: str, dtype: str):
    """The kernel class for (op, backend, dtype name)."""
    from blutensor.plugin import get_host

    reg = get_host().registry("kernel")
    cands = reg.for_op(op, backend, dtype) + reg.for_op(op, "*", dtype)
    if not cands:
        served = sorted({d for r in reg if getattr(r.cls, "OP", None) == op for d in getattr(r.cls, "DTYPES", ("*",))})
        if served and "*" not in served:  # the op exists, not for this dtype: the tensor's dtype is at fault
            raise DTypeError(f"{op}: no kernel for dtype {dtype} (kernels serve {', '.join(served)}); convert "
                             f"the input with .to(dtype) / .float()")
        raise BluTensorError(f"no kernel implements op '{op}' for backend {backend} and dtype {dtype}")
    want = _overrides.get(op) or _policy.env_kernels().get(op)
    if want:
        chosen = [r for r in cands if r.name == want]
        if not chosen:
            raise BluTensorError(f"kernel {want!r} configured for op '{op}' does not exist or does not serve "
                                 f"backend {backend}/dtype {dtype}; candidates: {[r.name for r in cands]}")
        k = chosen[0].cls
    else:
        cands.sort(key=lambda r: (getattr(r.cls, "PRIORITY", 0), r.name == f"blutensor.{op}"), reverse=True)
        k = cands[0].cls
    return _with_flags(k, op)


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


class _OnDevice:
    """Runs a kernel's backward with CUDA device ``index`` current (tensors on cuda:N, N >= 1)."""

    __slots__ = ("inner", "index", "kernel")

    def __init__(self, inner, index: int):
        self.inner, self.index = inner, index
        self.kernel = getattr(inner, "kernel", inner)  # the kernel class, as on _Widened (profilers read it)

    def backward(self, ctx, g):
        with _cuda_device(self.index):
            return self.inner.backward(ctx, g)

    @property
    def GRAD_INTO(self) -> bool:  # noqa: N802 - the kernel flag it forwards
        return getattr(self.inner, "GRAD_INTO", False)

    @property
    def GRAD_SUM(self) -> bool:  # noqa: N802
        return getattr(self.inner, "GRAD_SUM", False)

    def forwards_grad_into(self, ctx) -> bool:
        f = getattr(self.inner, "forwards_grad_into", None)
        return bool(f is not None and f(ctx))


def _cuda_device(index: int):
    import cupy

    return cupy.cuda.Device(index)


def _current_device() -> int:
    import cupy

    return cupy.cuda.runtime.getDevice()


def apply(op: str, *inputs, **attrs):
    """Run op ``op`` on ``inputs`` (Tensors, None or Python scalars) and return the result Tensor."""
    if autocast_hook is not None:
        inputs, attrs = autocast_hook(op, inputs, attrs)
    if observers:
        return _observed(0, op, inputs, attrs)
    return _apply(op, inputs, attrs)


def _observed(i: int, op: str, inputs, attrs):
    if i == len(observers):
        return _apply(op, inputs, attrs)
    return observers[i](op, inputs, attrs, lambda: _observed(i + 1, op, inputs, attrs))


def _bind():
    global _Tensor, _from_numpy_dtype
    from blutensor._tensor import Tensor
    from blutensor.dtypes import from_numpy_dtype

    _Tensor, _from_numpy_dtype = Tensor, from_numpy_dtype
    return Tensor


def _lookup(op, inputs, dev, first):
    """Cached kernel for this call: keyed by (op, device type, dtype of the dtype-selecting input)."""
    from blutensor.ops.table import OPS

    k = OPS.get(op)
    i = k.DTYPE_ARG if k is not None else 0
    sel = inputs[i] if i < len(inputs) and isinstance(inputs[i], _Tensor) else first
    key = (op, dev.type, sel.dtype, "sel")
    kcls = _cache.get(key)
    if kcls is None:
        kcls = _cache[key] = resolve(op, dev.type, sel.dtype.name)
        if i == 0:
            _cache[(op, dev.type, first.dtype)] = (kcls, True)
    if i != 0:
        _cache[(op, dev.type, first.dtype)] = (None, False)
    return kcls


#: ops whose operands of different dtypes are promoted (PyTorch's ``torch.result_type``) instead of refused;
#: the rest of the SAME_DTYPE ops (matmul, linear, layer_norm, ...) refuse mixed dtypes as PyTorch does
PROMOTING = {"add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge",
             "where", "remainder", "floor_divide", "fmod", "div_rounded", "isclose", "setitem"}


def _mismatch(op, kcls, inputs, dev):
    """Raise the device or dtype error for mixed inputs (dtype only where the kernel requires one); for a
    promoting op, return the inputs cast to their common dtype instead (None: nothing to change)."""
    tensors = [t for t in inputs if isinstance(t, _Tensor)]
    for t in tensors:
        if t.device != dev:
            raise DeviceError(f"{op}: expected all tensors on one device, got "
                              + ", ".join(describe(x) for x in tensors))
    same = kcls.SAME_DTYPE
    if same:
        dts = {inputs[i].dtype for i in same if i < len(inputs) and isinstance(inputs[i], _Tensor)}
        if len(dts) > 1 and op in PROMOTING:
            return _promoted(op, same, inputs)
        if len(dts) > 1:
            raise DTypeError(f"{op}: expected tensors of one dtype, got "
                             + ", ".join(describe(x) for x in tensors) + " (convert with .to(dtype))")


def takes_mixed(op: str, inputs, attrs) -> bool:
    """Whether the kernel that runs ``op`` on these CUDA inputs takes their float32/bfloat16 mix as it is
    (``Kernel.MIXED_BF16``), so that neither autocast nor type promotion inserts a cast first."""
    T = _Tensor or _bind()
    first = inputs[0] if inputs else None
    if not isinstance(first, T) or first.device.type != "cuda":
        return False
    kcls = _lookup(op, inputs, first.device, first)
    mix = getattr(kcls, "MIXED_BF16", None)
    return mix is not None and bool(mix(inputs, attrs))


def _promoted(op, same, inputs):
    """``inputs`` with the tensors at positions ``same`` cast (differentiably) to their result type."""
    from blutensor.dtypes import result_type
    from blutensor.functional import cast

    ts = [inputs[i] for i in same if i < len(inputs) and isinstance(inputs[i], _Tensor)]
    if op == "setitem":  # in-place: the destination keeps its dtype
        want = inputs[0].dtype
    else:
        want = result_type(*ts)
    return tuple(cast(x, want) if i in same and isinstance(x, _Tensor) else x for i, x in enumerate(inputs))


def _apply(op: str, inputs, attrs):
    T = _Tensor or _bind()
    # one pass over the inputs: raw arrays, the first tensor, mixed devices/dtypes, grad needed
    arrays = []
    first = None
    mixed = rg = False
    for x in inputs:
        if isinstance(x, T):
            if first is None:
                first = x
            elif x.device is not first.device or x.dtype is not first.dtype:
                mixed = True
            if x.requires_grad:
                rg = True
            arrays.append(x._data)
        else:
            arrays.append(x)
    if first is None:
        raise BluTensorError(f"{op}: expected at least one Tensor argument, got {inputs!r}")
    dev = first.device
    if dev.index and _current_device() != dev.index:
        # cuda:N, N >= 1: allocate and launch on that GPU whatever device is current
        with _cuda_device(dev.index):
            return _apply(op, inputs, attrs)
    dtype = first.dtype
    # fast path: the first tensor's dtype decides the kernel when DTYPE_ARG selects it
    hit = _cache.get((op, dev.type, dtype))
    if hit is None or not hit[1]:
        kcls = _lookup(op, inputs, dev, first)
    else:
        kcls = hit[0]
    if mixed and not (dev.type == "cuda" and getattr(kcls, "MIXED_BF16", None) is not None
                      and kcls.MIXED_BF16(inputs, attrs)):
        promoted = _mismatch(op, kcls, inputs, dev)
        if promoted is not None:
            return _apply(op, promoted, attrs)
    if kcls.DTYPE_ARG:
        darg = inputs[kcls.DTYPE_ARG] if kcls.DTYPE_ARG < len(inputs) else None
        if isinstance(darg, T):
            dtype = darg.dtype
    kernel = kcls
    if dtype.bf16 and not kcls.BF16_NATIVE:
        bf = tuple(isinstance(t, T) and t.dtype is dtype for t in inputs)
        kernel = _Widened(kcls, bf, dev.type == "cuda")
        arrays = [kernel.widen(a) if b else a for a, b in zip(arrays, bf)]
    ctx = Ctx()
    record = rg and STATE.enabled and kcls.DIFFERENTIABLE
    if record:
        ctx.needs = tuple([isinstance(t, T) and t.requires_grad for t in inputs])
    try:
        out = kcls.forward(ctx, *arrays, **attrs)
    except BluTensorError:
        raise
    except (ValueError, TypeError, IndexError) as e:  # NumPy/CuPy's own complaint, with the op and operands named
        cls = DTypeError if isinstance(e, TypeError) else ShapeError
        raise cls(f"{op} failed on " + ", ".join(describe(x) for x in inputs if x is not None)
                  + f": {e}") from None
    if kernel is not kcls:
        out = kernel.narrow(out)
    if type(out) is not _ndarray and isinstance(out, np.generic):
        out = np.asarray(out)  # NumPy reductions return scalars; a Tensor always holds an array
    # the result's dtype: the op's dtype when the storage matches, else inferred from the array
    odt = out.dtype
    forced = ctx.out_dtype  # a kernel may name its result dtype (cast: bf16 bits on CUDA)
    if forced is not None:
        odt = forced
    elif odt is dtype.np and dev.type == "cpu":
        odt = dtype
    elif odt == (dtype.cuda_storage if dev.type == "cuda" else dtype.np):
        odt = dtype
    else:
        odt = _from_numpy_dtype(odt)
    res = _new(T)
    res._data = out
    res.dtype = odt
    res.device = dev
    if kcls.VIEW:
        res._version = first._version
        res._base = first if first._base is None else first._base
    else:
        res._version = _Version()
        res._base = None
    if record and odt.is_floating_point:
        # (counter, value now, which input (-1: the output), its shape) checked before backward
        versions = [(inputs[i]._version, inputs[i]._version.v, i, inputs[i]._data.shape)
                    for i in kcls.SAVES if i < len(inputs) and isinstance(inputs[i], T)] if kcls.SAVES else []
        if kcls.SAVES_OUTPUT:
            versions.append((res._version, res._version.v, -1, out.shape))
        res.grad_fn = Node(op, _OnDevice(kernel, dev.index) if dev.index else kernel, ctx, inputs, versions)
        res.requires_grad = True
    return res


_new = object.__new__


def arrays_dtype(dtype, dev):
    """The storage NumPy dtype of blutensor ``dtype`` on ``dev``."""
    return dtype.cuda_storage if dev.type == "cuda" else dtype.np


from blutensor.autograd.version import Version as _Version  # noqa: E402
