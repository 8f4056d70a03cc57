"""Automatic mixed precision: ``bt.autocast(device_type, dtype=bt.bfloat16)``, PyTorch's autocast for blutensor.

Inside the context, ops on tensors of that device type follow a per-op policy applied by one hook in
``dispatch.apply`` (a module-level slot: no cost at all when no autocast region is active):

- lower: ``linear``, ``matmul``, ``bmm``, ``sdpa`` cast their float32 inputs to bfloat16. Parameters (leaf
  tensors that require grad) are cast once per region and cached (PyTorch's weight cast cache); the cast is
  the differentiable ``cast`` op, so gradients flow back into the float32 masters' ``.grad`` as float32,
  and backward reuses the saved bf16 copies (nothing is re-cast).
- follow: ``layer_norm``, ``gelu``, ``softmax``, ``log_softmax``, ``dropout``, ``rms_norm``, ``silu``, ``swiglu``
  run in the dtype of their input:
  a bfloat16 activation casts float32 weights down (cached); a float32 one runs in float32.
- promote: elementwise binary ops with one bfloat16 and one float32 tensor compute in float32 (PyTorch's type
  promotion). With GPT-2 this keeps the residual stream float32 exactly like torch.autocast: bf16 linear
  outputs are widened as they are added to it.
- ``cross_entropy``: float32 loss. On CUDA the fused kernel reads the bf16 logits directly (computing in
  float32, no widened copy of the logits); elsewhere the logits are widened first, like PyTorch.
"""

from __future__ import annotations

import functools

from blutensor.autograd.grad_mode import STATE
from blutensor.dtypes import bfloat16, dtype, float32
from blutensor.errors import DTypeError
from blutensor.ops import dispatch

LOWER = frozenset(("linear", "matmul", "bmm", "sdpa"))
FOLLOW = frozenset(("layer_norm", "gelu", "softmax", "log_softmax", "dropout", "rms_norm", "silu",
                    "swiglu"))
PROMOTE = frozenset(("add", "sub", "mul", "div", "maximum", "minimum", "pow", "where"))
DEVICE_TYPES = ("cuda", "cpu")


class _State:
    """Autocast dtype per device type (None: off), region nesting depth and the weight cast cache."""

    __slots__ = ("dtypes", "cache_enabled", "depth", "cache", "hits", "misses", "fused_ce")

    def __init__(self):
        self.dtypes: dict[str, dtype | None] = {"cuda": None, "cpu": None}
        self.cache_enabled = True
        self.depth = 0
        self.cache: dict = {}  # id(param) -> (param, version, grad mode, cast tensor)
        self.hits = self.misses = 0
        self.fused_ce: dict = {}  # device type -> whether cross_entropy there takes float_loss


_S = _State()


def is_autocast_enabled(device_type: str = "cuda") -> bool:
    """True inside an enabled ``autocast(device_type)`` region."""
    return _S.dtypes.get(device_type) is not None


def get_autocast_dtype(device_type: str = "cuda") -> dtype:
    """The lower-precision dtype autocast uses on ``device_type`` (bfloat16)."""
    return _S.dtypes.get(device_type) or bfloat16


def cache_info() -> dict:
    """Weight cast cache statistics of the current (or last) region: entries, hits, misses."""
    return {"entries": len(_S.cache), "hits": _S.hits, "misses": _S.misses}


class autocast:  # noqa: N801 - PyTorch's name
    """Context manager (and decorator) running listed ops in ``dtype`` on ``device_type``; see the module doc.

    ``enabled=False`` turns autocast off inside an enclosing region; ``cache_enabled`` keeps parameter casts
    for the whole (outermost) region. Only ``dtype=bt.bfloat16`` is supported.
    """

    def __init__(self, device_type: str = "cuda", dtype: dtype | None = None, enabled: bool = True,
                 cache_enabled: bool | None = None):
        if device_type not in DEVICE_TYPES:
            raise ValueError(f"autocast: device_type must be 'cuda' or 'cpu', got {device_type!r}")
        dt = bfloat16 if dtype is None else dtype
        if isinstance(dt, str) and dt in ("bfloat16", "bf16"):
            dt = bfloat16
        if dt is not bfloat16:
            raise DTypeError(f"autocast: dtype must be blutensor.bfloat16 (the only lower-precision compute dtype "
                             f"blutensor autocasts to), got {dt!r}")
        self.device_type, self.dtype, self.enabled = device_type, dt, bool(enabled)
        self.cache_enabled = cache_enabled
        self._prev = None

    def __enter__(self) -> autocast:
        self._prev = (_S.dtypes[self.device_type], _S.cache_enabled)
        _S.dtypes[self.device_type] = self.dtype if self.enabled else None
        if self.cache_enabled is not None:
            _S.cache_enabled = bool(self.cache_enabled)
        if _S.depth == 0:
            _S.hits = _S.misses = 0
            _S.fused_ce.clear()
        _S.depth += 1
        _install()
        return self

    def __exit__(self, *exc) -> None:
        _S.dtypes[self.device_type], _S.cache_enabled = self._prev
        _S.depth -= 1
        if _S.depth == 0:
            _S.cache.clear()  # like torch: casts live for the outermost region only
        _install()

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with autocast(self.device_type, self.dtype, self.enabled, self.cache_enabled):
                return fn(*args, **kwargs)

        return wrapped


def state() -> tuple:
    """The autocast settings now (per device type dtype, cache flag): for code that replays a forward later."""
    return tuple(_S.dtypes.items()), _S.cache_enabled


class restore:  # noqa: N801 - a context manager, like autocast
    """Run a block under the autocast settings :func:`state` returned (activation checkpointing's recompute
    replays the forward in the precision it first ran in)."""

    def __init__(self, settings: tuple):
        self.settings = settings
        self._prev = None

    def __enter__(self) -> restore:
        self._prev = state()
        dts, cache = self.settings
        _S.dtypes.update(dts)
        _S.cache_enabled = cache
        _S.depth += 1
        _install()
        return self

    def __exit__(self, *exc) -> None:
        dts, cache = self._prev
        _S.dtypes.update(dts)
        _S.cache_enabled = cache
        _S.depth -= 1
        if _S.depth == 0:
            _S.cache.clear()
        _install()


def _install() -> None:
    """Point dispatch's hook slot at :func:`_hook` while any device type autocasts, else clear it."""
    on = any(d is not None for d in _S.dtypes.values())
    dispatch.autocast_hook = _hook if on else None


def _cast(t, dt):
    """``t`` cast to ``dt``; parameters (leaves requiring grad) through the per-region cache."""
    from blutensor.functional import cast

    if not (_S.cache_enabled and t.requires_grad and t.grad_fn is None):
        return cast(t, dt)
    key = id(t)
    hit = _S.cache.get(key)
    grad_on = STATE.enabled
    if hit is not None and hit[0] is t and hit[1] == t._version.v and hit[2] == grad_on and hit[3].dtype is dt:
        _S.hits += 1
        return hit[3]
    _S.misses += 1
    out = cast(t, dt)
    _S.cache[key] = (t, t._version.v, grad_on, out)
    return out


class WeightCopies:
    """bfloat16 copies of float32 CUDA parameters kept from one autocast region to the next, in one packed buffer.

    Autocast casts every weight to bf16 in each region (PyTorch re-casts each step too). With a ``WeightCopies``
    the casts are made once: :func:`precast` (``copies=``) uses a copy as the weight's cast while it is current
    (the parameter's version and storage unchanged since it was written) and refreshes all copies in one
    multi-tensor launch otherwise; the fused AdamW kernel (``backends.cupy.adamw.fused_step(copies=)``) writes each
    updated weight's bf16 copy as it writes the weight, so a training step needs no cast pass over the weights at
    all. A copy is the weight rounded to nearest even, bit for bit what the cast would give. (Host parameters
    keep the same bookkeeping, with NumPy-made copies; only the CUDA precast and AdamW use them.)
    """

    def __init__(self, params) -> None:
        from blutensor.backends.cupy.cast import pack_layout

        seen: dict = {}
        for i, p in enumerate(params):
            if id(p) in seen:
                continue
            if p.dtype is not float32 or not p._data.flags.c_contiguous:
                raise ValueError(f"WeightCopies: parameter {i} must be a C-contiguous float32 tensor, got "
                                 f"{p.dtype} on {p.device} (shape {tuple(p.shape)})")
            seen[id(p)] = p
        self.params = list(seen.values())
        self._by_id = seen
        devs = {p.device for p in self.params}
        if len(devs) > 1:
            raise ValueError(f"WeightCopies: parameters on several devices {sorted(map(str, devs))}")
        self.device = devs.pop() if devs else None
        offs, total = pack_layout([p._data.size for p in self.params])
        self.cuda = self.device is not None and self.device.type == "cuda"
        if not self.cuda:  # host parameters: the same bookkeeping, copies made by NumPy rounding
            import numpy as np

            self.buf = np.empty(max(total, 1), dtype=np.uint16)
        elif self.device.index:
            from blutensor.backends.cupy._loader import cupy

            with cupy().cuda.Device(self.device.index):
                self.buf = cupy().empty(max(total, 1), dtype=cupy().uint16)
        else:
            from blutensor.backends.cupy._loader import cupy

            self.buf = cupy().empty(max(total, 1), dtype=cupy().uint16)
        self._views = {id(p): self.buf[int(o):int(o) + p._data.size].reshape(p._data.shape)
                       for p, o in zip(self.params, offs)}
        self._state: dict = dict.fromkeys(self._views)  # id -> (version, data pointer) the copy holds, or None

    def __contains__(self, p) -> bool:
        return self._by_id.get(id(p)) is p

    def view(self, p):
        """The bf16 copy (uint16 bits, the parameter's shape) of parameter ``p``."""
        return self._views[id(p)]

    @staticmethod
    def _key(p) -> tuple:
        d = p._data
        ptr = d.data.ptr if hasattr(d.data, "ptr") else d.__array_interface__["data"][0]
        return p._version.v, ptr

    def current(self, p) -> bool:
        """Whether ``p``'s copy holds its present value (written at its present version, for its present storage)."""
        return self._state.get(id(p)) == self._key(p)

    def mark(self, params) -> None:
        """Record that the copies of ``params`` now hold their present values (the writer has just written them)."""
        for p in params:
            if self._by_id.get(id(p)) is p:
                self._state[id(p)] = self._key(p)

    def refresh(self) -> None:
        """Cast every parameter into its copy now: one multi-tensor launch on CUDA."""
        if not self.params:
            return
        if not self.cuda:
            import numpy as np

            from blutensor.backends import f32_to_bf16_bits

            for p in self.params:
                self._views[id(p)][...] = f32_to_bf16_bits(p._data, np)
            self.mark(self.params)
            return
        from blutensor.backends.cupy.cast import multi_to_bf16

        arrays = [p._data for p in self.params]
        if self.device.index:
            import cupy

            with cupy.cuda.Device(self.device.index):
                multi_to_bf16(arrays, out=self.buf)
        else:
            multi_to_bf16(arrays, out=self.buf)
        self.mark(self.params)

    def ensure_current(self) -> bool:
        """Refresh when any copy is stale; returns whether it did."""
        if all(self.current(p) for p in self.params):
            return False
        self.refresh()
        return True


def precast(params, accumulate: bool = False, copies: WeightCopies | None = None) -> int:
    """Put the low-precision casts of all float32 ``params`` into the weight cast cache now (inside a region).

    On CUDA the casts of one device run as ONE multi-tensor launch (backends.cupy.cast.multi_to_bf16) instead of one
    launch per weight; each cached copy keeps its own differentiable ``cast`` node, so gradients reach the
    float32 masters exactly as with casts made on first use. Elsewhere (CPU) the casts are made one by one.
    Casts of parameters no op then lowers are unused (a few small extra copies). Returns how many were cast.
    ``accumulate=True`` (CUDA; for a training step whose masters already hold float32 ``.grad`` buffers, e.g.
    the captured step, and that never calls ``bt.grad``): the casts' backward adds the bf16 gradient straight
    into ``.grad`` in one kernel (cast.CastAccumulateCuda) instead of widening it into a new array first.
    ``copies`` (CUDA, bf16): a :class:`WeightCopies` holding these parameters; its copies serve as the casts
    (no launch while they are current; one refresh launch otherwise).
    """
    if _S.depth == 0 or not _S.cache_enabled:
        return 0
    T = dispatch._Tensor or dispatch._bind()
    grad_on = STATE.enabled
    todo: dict = {}
    for p in params:
        if not (isinstance(p, T) and p.dtype is float32 and p.requires_grad and p.grad_fn is None):
            continue
        low = _S.dtypes.get(p.device.type)
        hit = _S.cache.get(id(p))
        if low is None or (hit is not None and hit[0] is p and hit[1] == p._version.v and hit[2] == grad_on
                           and hit[3].dtype is low):
            continue
        todo.setdefault((p.device, low), {})[id(p)] = p  # tied parameters once
    n = 0
    for (dev, low), ps in todo.items():
        ps = list(ps.values())
        n += len(ps)
        if dev.type != "cuda" or not _precast_cuda(ps, dev, low, grad_on, T, accumulate, copies):
            for p in ps:
                _cast(p, low)
    return n


def _precast_cuda(ps, dev, low, grad_on, T, accumulate: bool = False, copies: WeightCopies | None = None) -> bool:
    """The CUDA half of :func:`precast`; False when the built-in cast kernel is not the one dispatch uses."""
    from blutensor.autograd.node import Ctx, Node
    from blutensor.backends.cupy import cast as cast_mod

    kernel = dispatch.resolve("cast", "cuda", "float32")
    if kernel is not cast_mod.CastCuda or low is not bfloat16 or any(not p._data.flags.c_contiguous for p in ps):
        return False
    if accumulate:
        kernel = cast_mod.CastAccumulateCuda
    if copies is not None and all(p in copies for p in ps):
        if not all(copies.current(p) for p in ps):
            copies.refresh()
        outs = [copies.view(p) for p in ps]
        if dev.index:
            kernel = dispatch._OnDevice(kernel, dev.index)
    elif dev.index:
        import cupy

        with cupy.cuda.Device(dev.index):
            outs = cast_mod.multi_to_bf16([p._data for p in ps])
        kernel = dispatch._OnDevice(kernel, dev.index)
    else:
        outs = cast_mod.multi_to_bf16([p._data for p in ps])
    for p, o in zip(ps, outs):
        t = T._from_data(o, low, dev)
        if grad_on:
            ctx = Ctx()
            ctx.saved, ctx.out_dtype, ctx.needs = (float32, low), low, (True,)
            if accumulate:
                ctx.param = p
            t.grad_fn = Node("cast", kernel, ctx, (p,), [])
            t.requires_grad = True
        _S.misses += 1
        _S.cache[id(p)] = (p, p._version.v, grad_on, t)
    return True


def _device_type(inputs, T):
    for x in inputs:
        if isinstance(x, T):
            return x.device.type, x
    return None, None


def _fused_ce(dev_type: str) -> bool:
    """Whether the cross_entropy kernel on ``dev_type`` reads bf16 logits with a float32 loss (``float_loss``)."""
    r = _S.fused_ce.get(dev_type)
    if r is None:
        r = False
        if dev_type == "cuda":
            try:
                from blutensor.backends.cupy.cross_entropy import CrossEntropyCuda

                r = issubclass(dispatch.resolve("cross_entropy", "cuda", "bfloat16"), CrossEntropyCuda)
            except Exception:  # noqa: BLE001 - no CUDA kernels: widen like PyTorch
                r = False
        _S.fused_ce[dev_type] = r
    return r


def _hook(op: str, inputs: tuple, attrs: dict):
    """dispatch.apply's autocast step: the (inputs, attrs) op ``op`` runs with under the active policy."""
    if op not in LOWER and op not in FOLLOW and op not in PROMOTE and op != "cross_entropy":
        return inputs, attrs
    T = dispatch._Tensor or dispatch._bind()
    dev_type, first = _device_type(inputs, T)
    low = _S.dtypes.get(dev_type) if dev_type else None
    if low is None:
        return inputs, attrs
    if op in LOWER:
        return tuple(_cast(x, low) if isinstance(x, T) and x.dtype is float32 else x for x in inputs), attrs
    if op in FOLLOW:
        if first.dtype is not low:
            return inputs, attrs
        return tuple(_cast(x, low) if isinstance(x, T) and x.dtype is float32 else x for x in inputs), attrs
    if op == "cross_entropy":
        logits = inputs[0]
        if not isinstance(logits, T):
            return inputs, attrs
        if logits.dtype is low and _fused_ce(dev_type):
            return inputs, {**attrs, "float_loss": True}
        if logits.dtype is low:
            return (_cast(logits, float32),) + tuple(inputs[1:]), attrs
        return inputs, attrs
    # PROMOTE: bf16 mixed with float32 computes in float32
    seen_low = seen_f32 = False
    for x in inputs:
        if isinstance(x, T):
            if x.dtype is low:
                seen_low = True
            elif x.dtype is float32:
                seen_f32 = True
    if seen_low and seen_f32:
        if dev_type == "cuda" and dispatch.takes_mixed(op, inputs, attrs):  # one widening kernel, no cast
            return inputs, attrs
        return tuple(_cast(x, float32) if isinstance(x, T) and x.dtype is low else x for x in inputs), attrs
    return inputs, attrs


__all__ = ["WeightCopies", "autocast", "cache_info", "get_autocast_dtype", "is_autocast_enabled", "precast",
           "restore", "state"]

from blutensor.grad_scaler import GradScaler  # noqa: E402  (torch.amp.GradScaler)

__all__ += ["GradScaler"]
