"""float32 <-> bfloat16 casts on CUDA (kernels/cast.cu): one vectorised pass instead of CuPy's chain of
integer ops (widen: 2 kernels, round-to-nearest-even narrow: ~10). Autocast inserts these casts."""

from __future__ import annotations

import numpy as np

from blutensor.backends.cupy._loader import aligned16, cupy, launch, num_sms
from blutensor.ops import elementwise as ew
from blutensor.ops.table import OPS, Kernel

FILE = "cast.cu"
_F32, _BF16 = np.dtype(np.float32), np.dtype(np.uint16)


def _grid(n: int) -> int:
    return max(1, min(-(-n // (256 * 8)), num_sms() * 8))


def to_bf16(x):
    """float32 CuPy array -> bf16 bits (uint16), round to nearest even; same shape, C-contiguous."""
    cp = cupy()
    x = cp.ascontiguousarray(x)
    y = cp.empty(x.shape, dtype=cp.uint16)
    if x.size:
        launch(FILE, "blu_cast_f32_to_bf16", _grid(x.size), 256, (x, y, np.int64(x.size), np.int32(aligned16(x, y))))
    return y


def to_f32(x):
    """bf16 bits (uint16) CuPy array -> float32 (exact); same shape, C-contiguous."""
    cp = cupy()
    x = cp.ascontiguousarray(x)
    y = cp.empty(x.shape, dtype=cp.float32)
    if x.size:
        launch(FILE, "blu_cast_bf16_to_f32", _grid(x.size), 256, (x, y, np.int64(x.size), np.int32(aligned16(x, y))))
    return y


def add_bf16(a, b):
    """bf16 bits ``a`` + ``b`` (one shape) -> a new bf16 array: added in float32, rounded to nearest even, one pass."""
    cp = cupy()
    a, b = cp.ascontiguousarray(a), cp.ascontiguousarray(b)
    out = cp.empty(a.shape, dtype=cp.uint16)
    if a.size:
        launch(FILE, "blu_add_bf16_forward", _grid(a.size), 256, (a, b, out, np.int64(a.size),
                                                                   np.int32(aligned16(a, b, out))))
    return out


def sum_slices_bf16(parts):
    """bf16 bits (G, ...) -> their sum over axis 0 (...), the G slices added in order in float32, one pass."""
    cp = cupy()
    parts = cp.ascontiguousarray(parts)
    if parts.shape[0] == 0:
        return cp.zeros(parts.shape[1:], dtype=cp.uint16)
    out = cp.empty(parts.shape[1:], dtype=cp.uint16)
    n = out.size
    if n:
        launch(FILE, "blu_sum_slices_bf16_forward", _grid(n), 256,
               (parts, out, np.int32(parts.shape[0]), np.int64(n), np.int32(aligned16(parts, out) and n % 8 == 0)))
    return out


#: each packed bf16 copy starts on a multiple of this many elements (128 bytes: GEMM-friendly alignment)
PACK_ALIGN = 64
#: elements per block of the multi-tensor cast
MULTI_CHUNK = 16384


def pack_layout(numels, align: int = PACK_ALIGN) -> tuple[np.ndarray, int]:
    """(offsets int64, total elements) of tensors packed back to back, each offset a multiple of ``align``."""
    numels = np.asarray(list(numels), dtype=np.int64)
    padded = -(-numels // align) * align
    offs = np.concatenate(([0], np.cumsum(padded)[:-1])).astype(np.int64) if len(numels) else np.zeros(0, np.int64)
    return offs, int(padded.sum())


class _MultiTable:
    """Device table of one list of float32 sources for :func:`multi_to_bf16` (built once per address list)."""

    def __init__(self, arrays):
        from blutensor.backends.cupy.multi_tensor import build_chunk_table

        cp = cupy()
        numels = [a.size for a in arrays]
        self.offsets, self.total = pack_layout(numels)
        ct, cs = build_chunk_table(numels, MULTI_CHUNK)
        self.n_chunks = len(ct)
        self.src = cp.asarray(np.array([a.data.ptr for a in arrays], dtype=np.uint64))
        self.dst_off = cp.asarray(self.offsets)
        self.numel = cp.asarray(np.asarray(numels, dtype=np.int64))
        self.chunk_tensor = cp.asarray(ct)
        self.chunk_start = cp.asarray(cs)


_multi: dict = {}  # (device, ((ptr, size), ...)) -> _MultiTable; a model's parameter list: few entries, kept


def multi_table(arrays) -> _MultiTable:
    """The cached table for these float32 arrays (building it copies to the device: do it outside a capture)."""
    cp = cupy()
    for i, a in enumerate(arrays):
        if a.dtype != _F32 or not a.flags.c_contiguous:
            raise ValueError(f"multi_to_bf16: array {i} must be C-contiguous float32, got {a.dtype} shape {a.shape}")
    key = (cp.cuda.runtime.getDevice(), tuple((a.data.ptr, a.size) for a in arrays))
    t = _multi.get(key)
    if t is None:
        if len(_multi) >= 8:
            _multi.clear()
        t = _multi[key] = _MultiTable(arrays)
    return t


def multi_to_bf16(arrays, out=None) -> list:
    """bf16 bits (uint16) copies of many float32 CuPy arrays in ONE launch, packed into one buffer (each copy a
    C-contiguous view of its own shape, 128-byte aligned); round to nearest even like :func:`to_bf16`. ``out``: the
    packed uint16 buffer to write (at least :func:`pack_layout`'s total elements), else a new one."""
    cp = cupy()
    if not arrays:
        return []
    t = multi_table(arrays)
    if out is not None and (out.dtype != _BF16 or out.ndim != 1 or out.size < t.total):
        raise ValueError(f"multi_to_bf16: out must be a 1-D uint16 array of >= {t.total} elements, got {out.dtype} "
                         f"shape {out.shape}")
    buf = out if out is not None else cp.empty(max(t.total, 1), dtype=cp.uint16)
    if t.n_chunks:
        launch(FILE, "blu_cast_multi_f32_to_bf16", t.n_chunks, 256,
               (t.src, t.dst_off, t.numel, t.chunk_tensor, t.chunk_start, np.int64(MULTI_CHUNK), buf))
    return [buf[int(o):int(o) + a.size].reshape(a.shape) for a, o in zip(arrays, t.offsets)]


def _convert(a, src, dst):
    if src.name == "float32" and dst.name == "bfloat16" and a.dtype == _F32:
        return to_bf16(a)
    if src.name == "bfloat16" and dst.name == "float32" and a.dtype == _BF16:
        return to_f32(a)
    return ew._convert(a, src, dst, cupy())


class CastCuda(Kernel):
    """cast on CUDA: float32 <-> bfloat16 by the one-pass kernels, every other pair by the generic op."""

    PLUGIN_NAME = "blutensor.cuda.cast"
    OP = "cast"
    BACKEND = "cuda"
    DTYPES = ("float32", "bfloat16")
    PRIORITY = 10
    BF16_NATIVE = True

    @staticmethod
    def forward(ctx, a, src=None, dst=None):
        ctx.saved = (src, dst)
        ctx.out_dtype = dst
        return _convert(a, src, dst)

    @staticmethod
    def backward(ctx, g):
        src, dst = ctx.saved
        return (_convert(g, dst, src),)

    @staticmethod
    def forwards_grad_into(ctx) -> bool:
        """A float32 -> bfloat16 cast lets its consumers add the gradient into the float32 master's buffer
        (autograd.engine): the widened gradient is what this backward would hand on, without its bf16 rounding."""
        src, dst = ctx.saved
        return getattr(src, "name", None) == "float32" and getattr(dst, "name", None) == "bfloat16"


def accumulate_bf16(acc, g) -> None:
    """acc (float32, C-contiguous) += widen(g) (bf16 bits) in one pass, in place."""
    cp = cupy()
    g = cp.ascontiguousarray(g)
    if g.size:
        launch(FILE, "blu_cast_accumulate_bf16_into_f32", _grid(g.size), 256,
               (g, acc, np.int64(g.size), np.int32(aligned16(g, acc))))


class CastAccumulateCuda(CastCuda):
    """The weight casts of ``bt.amp.precast(..., accumulate=True)`` (the captured training step): backward adds
    the bf16 gradient straight into the float32 master's existing ``.grad`` (one kernel, bit-identical to
    widen + accumulate) and hands the engine nothing for it; without a plain float32 ``.grad`` (or with
    gradient hooks on the master) it widens like :class:`CastCuda`. Not registered: only precast uses it,
    and only where nothing else needs the gradient to pass through the engine (no ``bt.grad`` capture)."""

    PLUGIN_NAME = "blutensor.cuda.cast_accumulate"

    @staticmethod
    def backward(ctx, g):
        p = ctx.param
        acc = p.grad
        if (acc is not None and p._hooks is None and p._post_hooks is None and g.dtype.itemsize == 2
                and acc._data.dtype == _F32 and acc._data.flags.c_contiguous and acc._data.shape == g.shape):
            accumulate_bf16(acc._data, g)
            return (None,)
        return CastCuda.backward(ctx, g)


def add_widen(x, y):
    """float32 ``x`` + widen(``y``) (bf16 bits, the same shape) -> a new float32 array, in one pass."""
    cp = cupy()
    x, y = cp.ascontiguousarray(x), cp.ascontiguousarray(y)
    out = cp.empty(x.shape, dtype=cp.float32)
    if x.size:
        launch(FILE, "blu_add_bf16_widen_forward", _grid(x.size), 256,
               (x, y, out, np.int64(x.size), np.int32(aligned16(x, y, out))))
    return out


class AddWidenCuda(OPS["add"]):
    """add on CUDA: a float32 tensor plus a bfloat16 one of the same shape (autocast's residual stream plus a bf16
    GEMM output) runs as one widening kernel instead of a cast kernel and an add; the gradient of the bf16 operand
    is the float32 gradient rounded to bf16, as the cast's backward would give. Every other add is the built-in
    one (``MIXED_BF16``: dispatch and autocast leave such operand pairs unpromoted for this kernel)."""

    PLUGIN_NAME = "blutensor.cuda.add_widen"
    BACKEND = "cuda"
    DTYPES = ("float32",)
    PRIORITY = 10

    @staticmethod
    def MIXED_BF16(inputs, attrs) -> bool:  # noqa: N802 - a kernel class attribute, like the others
        """Whether this call's operands are the pair the widening kernel takes: (float32, bfloat16), one shape."""
        a, b = inputs[0], inputs[1] if len(inputs) > 1 else None
        return (len(inputs) == 2 and getattr(b, "dtype", None) is not None and b.dtype.name == "bfloat16"
                and a.dtype.name == "float32" and tuple(a.shape) == tuple(b.shape) and attrs.get("alpha", 1) == 1
                and all(type(t._data).__module__.split(".")[0] == "cupy" for t in (a, b)))  # not a tracer's

    @staticmethod
    def forward(ctx, a, b, alpha=1):
        if getattr(b, "dtype", None) == _BF16 and getattr(a, "dtype", None) == _F32:
            ctx.saved = "widen"
            return add_widen(a, b)
        return OPS["add"].forward(ctx, a, b, alpha)

    @staticmethod
    def backward(ctx, g):
        if ctx.saved == "widen":
            return (g if ctx.needs[0] else None, to_bf16(g) if ctx.needs[1] else None)
        return OPS["add"].backward(ctx, g)
