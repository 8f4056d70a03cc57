"""Grouped-query flash attention on CUDA: k/v with fewer heads than q, read in place (no repeated K/V).

The strided flash kernels (kernels/sdpa.cu, sdpa_mma.cu: ``*_strided_*`` entries, struct Lay) address head ``bh``
of a tensor at ``(bh / H) * sb + (bh % H) * sh``. With H = G = Hq / Hkv (query heads per key/value head), query
head ``bh = b * Hq + h`` splits as ``(b * Hkv + h / G) * G + h % G``, so a dense q (B, Hq, L, E) is the layout
``(G*L*E, L*E, E)`` and a dense k/v (B, Hkv, S, E) the layout ``(S*E, 0, E)``: each query head reads its group's
key/value head, and the forward and the dQ kernel run over all B*Hq heads unchanged.

dK/dV sum over the G query heads of a group. The dK/dV kernel writes (not adds) one key/value head per block, so it
runs once per group member g over the B*Hkv heads (q, dO at element offset g*L*E with the layout ``(G*L*E, 0, E)``;
that member's log-sum-exp and D rows gathered, B*Hkv*L floats) into its own dense slice, and the G slices are summed
in fp32: G times the size of dK/dV in scratch, never G copies of K/V.

The Hopper kernels (sdpa_wgmma.cu, variant 'bf16_wgmma') read q, k, v through 4-D tensor maps of any strides, so
a group member g is a plain dense problem over the B*Hkv key/value heads: its queries are the strided view
``q[:, g::G]`` (query heads j*G + g, as (B, L, Hkv, E)), k and v are read in place, o, dQ and dO go through the
same member views, and each member's log-sum-exp is its own (B*Hkv, L) slice of a (G, B*Hkv, L) buffer. dK/dV
are the sum of the G members' slices, as above.
"""

from __future__ import annotations

import math

import numpy as np

from blutensor.backends.cupy import sdpa_wgmma as _wgmma
from blutensor.backends.cupy._loader import aligned16, cupy, launch, suffix


def plan(B: int, Hq: int, Hkv: int, L: int, S: int, E: int) -> dict:
    """The launch geometry: element layouts (sb, sh, st) per kernel and the group size (see the module notes)."""
    G = Hq // Hkv
    return {"G": G, "q": (G * L * E, L * E, E), "k": (S * E, 0, E), "q_member": (G * L * E, 0, E),
            "member_offset": L * E, "heads": B * Hq, "kv_heads": B * Hkv}


def _lay(H: int, lq, lk, lo) -> tuple:
    out = [np.int32(H)]
    for sb, sh, st in (lq, lk, lo):
        out += [np.int64(sb), np.int64(sh), np.int32(st)]
    return tuple(out)


def _members(a, G: int) -> list:
    """The G group-member views of a dense (B, Hq, n, E) array as the Hopper kernels' (B, n, Hkv, E) views:
    member g holds query heads j*G + g, the ones key/value head j serves."""
    return [a[:, g::G].transpose(0, 2, 1, 3) for g in range(G)]


def _heads_last(a):
    """A dense (B, H, n, E) array as the Hopper kernels' (B, n, H, E) view (no copy)."""
    return a.transpose(0, 2, 1, 3)


def _sum_members(parts, cp):
    """The sum over axis 0 of the members' dK or dV slices, accumulated in fp32 (bf16 storage stays bf16)."""
    if parts.dtype == np.uint16:
        from blutensor.backends import bf16_sum0

        return bf16_sum0(parts, cp)
    return parts.sum(0)


def _axis_order(a) -> list:
    """a's axes from the outermost in memory to the innermost (by stride; ties keep their order)."""
    return sorted(range(a.ndim), key=lambda i: -abs(a.strides[i]))


def _empty_in_layout(shape, order, dtype, cp, lead: tuple = ()):
    """(base, view): a dense array whose memory runs over ``shape``'s axes in ``order`` (outermost first) behind
    ``lead`` leading axes, and its view with the axes as ``shape`` has them (lead axes first)."""
    base = cp.empty(lead + tuple(shape[i] for i in order), dtype=dtype)
    inv = np.argsort(order)
    return base, base.transpose(tuple(range(len(lead))) + tuple(len(lead) + int(j) for j in inv))


def _wgmma_forward(q, k, v, causal: bool, scale: float):
    """(o, lse (G, B*Hkv, L)): one dense Hopper forward per group member over the B*Hkv heads. q, k, v are (B, H,
    n, E) views of any strides the tensor maps take; o (B, Hq, L, E) is stored heads-last, (B, L, Hq, E), so the
    caller's transpose back to (B, L, Hq * E) for the output projection is a view, not a copy."""
    cp = cupy()
    B, Hq, L, E = q.shape
    G = Hq // k.shape[1]
    _, o = _empty_in_layout(q.shape, (0, 2, 1, 3), q.dtype, cp)
    lse = cp.empty((G, B * k.shape[1], L), dtype=cp.float32)
    kv = (_heads_last(k), _heads_last(v))
    for g, (qg, og) in enumerate(zip(_members(q, G), _members(o, G))):
        _wgmma.forward(qg, *kv, og, lse[g], causal, scale)
    return o, lse


def _wgmma_backward(q, k, v, o, lse, do, causal: bool, scale: float):
    """(dq, dk, dv) of :func:`_wgmma_forward`: per member the Hopper backward (dQ into its member view, dK/dV into
    its own slice), then the slices summed. Each gradient is laid out as its input is (a transposed v gets a
    transposed dv), and ``do`` is read in o's layout (copied into it only when it differs)."""
    cp = cupy()
    G = q.shape[1] // k.shape[1]
    if do.strides != o.strides:
        _, d2 = _empty_in_layout(o.shape, _axis_order(o), o.dtype, cp)
        d2[...] = do
        do = d2
    _, dq = _empty_in_layout(q.shape, _axis_order(q), q.dtype, cp)
    orders = [_axis_order(a) for a in (k, v)]
    (dk_base, dk_parts), (dv_base, dv_parts) = (_empty_in_layout(a.shape, order, a.dtype, cp, (G,))
                                                for a, order in zip((k, v), orders))
    kv = (_heads_last(k), _heads_last(v))
    for g, (qg, og, dog, dqg) in enumerate(zip(*(_members(a, G) for a in (q, o, do, dq)))):
        _wgmma.backward(qg, *kv, og, lse[g], dog, dqg, _heads_last(dk_parts[g]), _heads_last(dv_parts[g]),
                        causal, scale)
    dk, dv = (_sum_members(base, cp).transpose(tuple(int(j) for j in np.argsort(order)))
              for base, order in zip((dk_base, dv_base), orders))
    return dq, dk, dv


def _tma_ready(a, cp):
    """``a`` itself when the Hopper kernels' tensor maps can read it in place (head dim contiguous, 16-byte aligned
    start and strides), else a contiguous, aligned copy."""
    es = a.itemsize
    ok = a.ndim == 4 and a.strides[-1] == es and all(s % 16 == 0 for s in a.strides[:-1]) and aligned16(a)
    return a if ok else _aligned(a, cp)


def gqa_forward(q, k, v, causal: bool, scale: float, variant: str):
    """(o (B, Hq, L, E), lse) for contiguous, 16-byte aligned q (B, Hq, L, E) and k, v (B, Hkv, S, E) (for
    'bf16_wgmma' views of any strides its tensor maps take, o stored heads-last); lse is (B*Hq, L), or member-major
    (G, B*Hkv, L) for 'bf16_wgmma' (the layout its backward reads)."""
    from blutensor.backends.cupy.sdpa import _fwd_rows, _mma_smem, _names

    if variant == "bf16_wgmma":
        return _wgmma_forward(q, k, v, causal, scale)
    cp = cupy()
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    p = plan(B, Hq, Hkv, L, S, E)
    o = cp.empty_like(q)
    lse = cp.empty((B * Hq, L), dtype=cp.float32)
    if B * Hq == 0 or L == 0:
        return o, lse
    file, tag, threads = _names(variant, E)
    smem = 0 if variant == "f32" else _mma_smem(variant, E, "fwd")
    launch(file, f"blu_sdpa_forward_strided_{tag}", (math.ceil(L / _fwd_rows(variant, E)), p["heads"]), threads,
           (q, k, v, o, lse, np.int32(L), np.int32(S), np.float32(scale), np.int32(bool(causal)))
           + _lay(p["G"], p["q"], p["k"], p["q"]), shared_mem=smem)
    return o, lse


def gqa_backward(q, k, v, o, lse, do, causal: bool, scale: float, variant: str):
    """(dq, dk, dv) of :func:`gqa_forward` (``do`` contiguous like o; for 'bf16_wgmma' any layout, each gradient laid
    out as its input)."""
    from blutensor.backends.cupy.sdpa import BR, _mma_smem, _names

    if variant == "bf16_wgmma":
        return _wgmma_backward(q, k, v, o, lse, do, causal, scale)
    cp = cupy()
    B, Hq, L, E = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    p = plan(B, Hq, Hkv, L, S, E)
    G = p["G"]
    dq = cp.empty_like(q)
    if B * Hq == 0 or L == 0 or S == 0:
        dq.fill(0)
        return dq, cp.zeros_like(k), cp.zeros_like(v)
    rows = B * Hq * L
    D = cp.empty((B * Hq, L), dtype=cp.float32)
    launch("sdpa.cu", f"blu_sdpa_backward_preprocess_{suffix(q)}", min(math.ceil(rows / 8), 65535 * 8), 256,
           (do, o, D, np.int64(rows), np.int32(E)))
    file, tag, threads = _names(variant, E, "bwd")
    smem = 0 if variant == "f32" else _mma_smem(variant, E, "bwd")
    tail = (np.int32(L), np.int32(S), np.float32(scale), np.int32(bool(causal)))
    launch(file, f"blu_sdpa_backward_dq_strided_{tag}", (math.ceil(L / BR), p["heads"]), threads,
           (q, k, v, do, lse, D, dq) + tail + _lay(G, p["q"], p["k"], p["q"]), shared_mem=smem)
    dk_parts = cp.empty((G,) + k.shape, dtype=k.dtype)
    dv_parts = cp.empty((G,) + v.shape, dtype=v.dtype)
    lse_g = lse.reshape(B * Hkv, G, L)
    D_g = D.reshape(B * Hkv, G, L)
    qf, dof = q.reshape(-1), do.reshape(-1)
    off = p["member_offset"]
    for g in range(G):
        launch(file, f"blu_sdpa_backward_dkdv_strided_{tag}", (math.ceil(S / BR), p["kv_heads"]), threads,
               (qf[g * off:], k, v, dof[g * off:], cp.ascontiguousarray(lse_g[:, g]), cp.ascontiguousarray(D_g[:, g]),
                dk_parts[g], dv_parts[g]) + tail + _lay(1, p["q_member"], p["k"], p["q_member"]), shared_mem=smem)
    return dq, _sum_members(dk_parts, cp), _sum_members(dv_parts, cp)


def _aligned(a, cp):
    a = cp.ascontiguousarray(a)
    return a if aligned16(a) else a.copy()


def applies(q, k, v, attn_mask, dropout_p) -> str | None:
    """The kernel variant when q (B, Hq, L, E), k/v (B, Hkv, S, E) with Hkv < Hq run here, else None."""
    from blutensor._tensor import Tensor
    from blutensor.backends.cupy.sdpa import SdpaCuda, _rewrites_sdpa, device_arrays, pick_variant
    from blutensor.ops import dispatch
    from blutensor.ops.dispatch import resolve

    if not all(isinstance(t, Tensor) and t.device.type == "cuda" and t.ndim == 4 for t in (q, k, v)):
        return None
    if attn_mask is not None or dropout_p or tuple(k.shape) != tuple(v.shape) or q.shape[0] != k.shape[0]:
        return None
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hkv >= Hq or Hq % Hkv or q.shape[-1] != k.shape[-1] or not (q.dtype == k.dtype == v.dtype):
        return None
    if any(_rewrites_sdpa(o) for o in dispatch.observers) or not device_arrays(q, k, v):
        return None  # context parallelism's ring attention and the compiler's tracer see plain sdpa
    dt = q.dtype.name
    if dispatch.autocast_hook is not None and dt == "float32":
        from blutensor.amp import is_autocast_enabled

        if is_autocast_enabled("cuda"):
            return None  # autocast lowers sdpa to bf16 on the op path
    if dt not in ("float32", "bfloat16") or resolve("sdpa", "cuda", dt).PLUGIN_NAME != SdpaCuda.PLUGIN_NAME:
        return None  # another sdpa kernel was chosen (BLUTRAIN_KERNELS / use_kernel): honour it
    return strided_variant(pick_variant(q._data.dtype, q.shape[-1]), q._data.dtype, q.shape[-1])


#: variants this module launches: the strided entries of sdpa.cu / sdpa_mma.cu, and the Hopper kernels per member
STRIDED = ("f32", "tf32", "tf32x3", "bf16", "bf16_wgmma")


def strided_variant(variant: str | None, dtype, hd: int) -> str | None:
    """``variant`` when this module runs it; another bf16 variant runs the mma.sync 'bf16' kernels here. The
    Hopper kernels run grouped attention member by member wherever ``pick_variant`` chose them (sm_90, policy
    ``attention`` not 'mma'): on the H200 the llama-1b bf16 step (32 query / 8 key-value heads, T=2048) is 5% faster
    with them than with the mma.sync kernels (benchmarks/results/e2e_llama_bf16_h200.json)."""
    from blutensor.backends.cupy.sdpa import MMA_HD

    if variant == "tf32_wgmma":  # the Hopper tf32 forward is not run per member: grouped attention keeps 'tf32'
        variant = "tf32"
    if variant is None or variant in STRIDED:
        return variant
    return "bf16" if np.dtype(dtype) == np.uint16 and hd in MMA_HD else None


_FN = []


def _function():
    from blutensor._tensor import Tensor
    from blutensor.autograd.function import Function

    class SdpaGqa(Function):
        """Flash attention with grouped key/value heads (no repeated K/V)."""

        @staticmethod
        def forward(ctx, q, k, v, causal, scale, variant):
            cp = cupy()
            # the Hopper kernels read strided views in place; the mma.sync entries take dense (B, H, n, E) arrays
            ready = _tma_ready if variant == "bf16_wgmma" else _aligned
            qa, ka, va = (ready(t._data, cp) for t in (q, k, v))
            sc = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
            o, lse = gqa_forward(qa, ka, va, causal, sc, variant)
            ctx.saved = (qa, ka, va, o, lse, causal, sc, variant)
            return Tensor._from_data(o, q.dtype, q.device)

        @staticmethod
        def backward(ctx, g):
            qa, ka, va, o, lse, causal, sc, variant = ctx.saved
            do = g._data.astype(o.dtype, copy=False)
            do = _tma_ready(do, cupy()) if variant == "bf16_wgmma" else _aligned(do, cupy())
            dq, dk, dv = gqa_backward(qa, ka, va, o, lse, do, causal, sc, variant)
            wrap = lambda a: Tensor._from_data(a, g.dtype, g.device)  # noqa: E731
            return wrap(dq), wrap(dk), wrap(dv), None, None, None

    return SdpaGqa


def sdpa_gqa(q, k, v, is_causal: bool, scale: float | None, variant: str):
    """Grouped-query attention through the strided flash kernels; dispatch observers (profilers) see op
    'sdpa_gqa'. Call only where :func:`applies` gave ``variant``."""
    from blutensor.ops import dispatch

    if not _FN:
        _FN.append(_function())

    def fn():
        return _FN[0].apply(q, k, v, bool(is_causal), scale, variant)

    obs = list(dispatch.observers)
    if not obs:
        return fn()
    attrs = {"is_causal": bool(is_causal), "scale": scale}

    def call(i):
        return fn() if i == len(obs) else obs[i]("sdpa_gqa", (q, k, v), attrs, lambda: call(i + 1))

    return call(0)
