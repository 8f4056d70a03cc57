"""Host side of the Hopper flash attention (kernels/sdpa_wgmma.cu: sm_90a, bf16, head dims 64 and 128).

q, k, v (and o, dO for the backward) are read by TMA through 4-D tensor maps (head dim, row, head, batch) built
from each array's strides, so the dense (BH, n, HD) arrays and the strided q/k/v views of a fused
(B, T, 3, H, HD) projection take the same kernels; outputs are written through (sb, sh, st) layouts as in
kernels/sdpa_mma.cu, and the log-sum-exp convention is the same (lse (BH, L) fp32, natural log), so the ring
attention merge and either backward accept it. The backward starts with D = rowsum(dO * O) (16-byte loads,
HD / 8 threads a row), then either the fused kernel (dK, dV and dS K added into a zeroed fp32 dQ accumulator --
at head dim 64 one bulk reduction a 64-query partial, at 128 red.global.add: 5 products a key/query tile pair
instead of 7, one pass over the tiles instead of two; dQ's last bits vary run to run) followed by a small kernel
writing dq = scale * accumulator as bf16, or the deterministic pair, a dK/dV kernel and a dQ kernel, no atomics.
sdpa.py's ``fused_backward`` decides: the fused kernel under ``attention_backward='fused'`` and, by default
('auto', sdpa.FUSED_AUTO), at head dim 64; the pair otherwise and always under the policy's ``deterministic``. The main
kernels are persistent: at most one CTA a multiprocessor walks the (row block, head) work tiles, heavy ones first.

:func:`available` says whether the variant applies (sm_90, the execution policy's ``attention``, i.e.
``BLUTRAIN_SDPA_KERNEL``, not 'mma'); the callers in sdpa.py pick it through ``pick_variant`` as variant 'bf16_wgmma'.
"""

from __future__ import annotations

import math

import numpy as np

from blutensor.backends.cupy import tma
from blutensor.backends.cupy._loader import cupy, launch, num_sms
from blutensor.errors import ShapeError

FILE = "sdpa_wgmma.cu"
HDS = (64, 128)
THREADS = 384
#: ring stages (forward, backward) per head dim: FST / BST of WGMMA_ENTRIES in sdpa_wgmma.cu
STAGES = {64: (3, 3), 128: (2, 2)}
FWD_ROWS = 128  # queries per forward CTA (also keys per dK/dV CTA, queries per dQ CTA)
BOX_ROWS_STREAM = 64  # rows of the backward's streamed tiles
#: values of the policy's ``attention`` (BLUTRAIN_SDPA_KERNEL; 'auto': the Hopper kernels on sm_90 for bf16, the
#: mma.sync ones elsewhere)
SDPA_KERNEL = ("auto", "wgmma", "mma")


def kernel_setting() -> str:
    """The current execution policy's ``attention``: 'auto' (default), 'wgmma' (require the Hopper kernels for
    bf16) or 'mma'."""
    from blutensor.policy import current

    return current().attention


def fwd_suffix() -> str:
    """The forward entry's suffix for the policy's ``attention_schedule``: '' (free) or '_pp' (pingpong)."""
    from blutensor.policy import current

    return "_pp" if current().attention_schedule == "pingpong" else ""


def available(hd: int, cc: int) -> bool:
    """Whether bf16 attention of head dim ``hd`` runs the Hopper kernels on a device of compute capability
    ``cc``. Policy ``attention='wgmma'`` (BLUTRAIN_SDPA_KERNEL=wgmma) on another device is an error (those kernels
    need sm_90a)."""
    env = kernel_setting()
    if env == "mma" or hd not in HDS:
        return False
    if cc != 90:
        if env == "wgmma":
            raise ValueError(f"attention='wgmma' (BLUTRAIN_SDPA_KERNEL=wgmma) needs an sm_90 (Hopper) GPU; this one "
                             f"is sm_{cc}")
        return False
    return True


def fwd_smem(hd: int) -> int:
    """Dynamic shared memory of the forward (struct Fwd in sdpa_wgmma.cu)."""
    st = STAGES[hd][0]
    tile = FWD_ROWS * hd * 2
    return 1024 + tile * (2 + 2 * st) + 8 * (4 + 2 * st)


def bwd_smem(hd: int) -> int:
    """Dynamic shared memory of both backward kernels (struct Bwd in sdpa_wgmma.cu)."""
    st = STAGES[hd][1]
    own, tile = FWD_ROWS * hd * 2, BOX_ROWS_STREAM * hd * 2
    return 1024 + 4 * own + 2 * st * tile + 8 * (4 + 2 * st) + st * BOX_ROWS_STREAM * 8


#: head dims whose fused backward adds each dQ partial by one bulk reduction from a shared staging tile (the
#: kernel's bulk_dq); the others use red.global.add
BULK_DQ_HDS = (64,)
DQ_TILE = 64 * 64  # fp32 elements of one staged dQ partial (64 queries x head dim 64)


def fused_smem(hd: int) -> int:
    """Dynamic shared memory of the fused backward (struct Bwd's SMEM_FUSED: the split kernels' plus two 64 x 64
    bf16 dS^T tiles for each consumer warpgroup, and at head dim 64 two 16 KB fp32 dQ staging tiles)."""
    stage = 2 * DQ_TILE * 4 if hd in BULK_DQ_HDS else 0
    return bwd_smem(hd) + 4 * BOX_ROWS_STREAM * BOX_ROWS_STREAM * 2 + stage


def dq_accumulator_shape(BH: int, L: int, hd: int) -> tuple[int, ...]:
    """Shape of the fused backward's zeroed fp32 dQ accumulator: (BH, ceil(L / 64), 64 * 64) tiles in the kernel's
    tile-fragment order at head dim 64 (each partial one contiguous bulk reduction), (BH, L, hd) rows otherwise."""
    if hd in BULK_DQ_HDS:
        return (BH, math.ceil(L / 64), DQ_TILE)
    return (BH, L, hd)


def lse_d_shape(BH: int, L: int) -> tuple[int, int, int]:
    """Shape of the backward's (lse * log2 e, D) pairs: (BH, ceil(L / 64) * 64, 2), zero past L, so that each
    64-query tile's pairs are one aligned 512-byte bulk copy into the dK/dV kernels' stage."""
    return (BH, math.ceil(L / BOX_ROWS_STREAM) * BOX_ROWS_STREAM, 2)


def grid(rows: int, BH: int) -> int:
    """CTAs of a persistent launch over ceil(rows / 128) x BH work tiles: at most one per multiprocessor."""
    return max(1, min(math.ceil(rows / FWD_ROWS) * BH, num_sms()))


def _view4(a, name: str, kind: str = "wgmma"):
    """(ptr, n, H, B, (st, sh, sb) element strides) of ``a``: (BH, n, HD) contiguous or a (B, n, H, HD) view.
    ``kind`` names the kernel family in errors (the tf32 Hopper kernels share this layout)."""
    es = a.itemsize
    if any(s % es for s in a.strides):
        raise ShapeError(f"flash attention ({kind}): {name} strides {a.strides} are not whole elements")
    if a.ndim == 3:
        BH, n, hd = a.shape
        sbh, st, sd = (s // es for s in a.strides)
        if sd != 1:
            raise ShapeError(f"flash attention ({kind}): {name}'s head dim must be contiguous")
        return a.data.ptr, n, 1, BH, (st, st * max(n, 1), sbh)
    if a.ndim == 4:
        B, n, H, hd = a.shape
        sb, st, sh, sd = (s // es for s in a.strides)
        if sd != 1:
            raise ShapeError(f"flash attention ({kind}): {name}'s head dim must be contiguous")
        return a.data.ptr, n, H, B, (st, sh, sb)
    raise ShapeError(f"flash attention ({kind}): {name} must be (BH, n, HD) or (B, n, H, HD), got {a.shape}")


def tmap(a, name: str, box_rows: int, kind: str = "wgmma"):
    """The tensor map of ``a`` (see _view4) with boxes of 128 bytes of head dim (64 bf16 or 32 fp32 elements, the
    swizzle span) x ``box_rows`` rows."""
    ptr, n, H, B, (st, sh, sb) = _view4(a, name, kind)
    hd = a.shape[-1]
    es = a.itemsize
    spec = tma.tensor_spec(ptr, es, (hd, n, H, B), (st * es, sh * es, sb * es), (128 // es, box_rows, 1, 1))
    return tma.encode(spec, f"flash attention ({kind}) {name}")


def _out_lay(a, kind: str = "wgmma") -> tuple:
    """(H, sb, sh, st) kernel arguments of an array read or written like ``a`` (see _view4)."""
    _, _, H, _, (st, sh, sb) = _view4(a, "output", kind)
    return (np.int32(H), np.int64(sb), np.int64(sh), np.int32(st))


def problem(q, k, scale: float | None) -> tuple[int, int, int, float]:
    """(L, S, BH, scale) of q and k as (BH, n, HD) arrays or (B, n, H, HD) views; scale defaults to 1/sqrt(HD)."""
    hd = q.shape[-1]
    BH = q.shape[0] if q.ndim == 3 else q.shape[0] * q.shape[2]
    return q.shape[1], k.shape[1], BH, float(scale) if scale is not None else 1.0 / math.sqrt(hd)


def _check(arrays, hd: int):
    if hd not in HDS:
        raise ShapeError(f"flash attention (wgmma): head dim {hd} not supported (64 or 128)")
    for name, a in arrays:
        if a.dtype != np.uint16:
            raise ShapeError(f"flash attention (wgmma): {name} must be bf16 (uint16 storage), got {a.dtype}")


def forward(q, k, v, o, lse, causal: bool, scale: float | None):
    """Write o (like q) and lse (BH, L) for q/k/v given as (BH, n, HD) arrays or (B, n, H, HD) views."""
    hd = q.shape[-1]
    _check((("q", q), ("k", k), ("v", v), ("o", o)), hd)
    L, S, BH, sc = problem(q, k, scale)
    if BH == 0 or L == 0:
        return
    if S == 0:  # no keys: PyTorch's math path gives NaN rows; the flash kernels' convention is zeros and -inf
        o.fill(0)
        lse.fill(-np.inf)
        return
    maps = (tmap(q, "q", FWD_ROWS), tmap(k, "k", FWD_ROWS), tmap(v, "v", FWD_ROWS))
    lay = _out_lay(o)
    launch(FILE, f"blu_sdpa_wgmma_bf16_hd{hd}_fwd{fwd_suffix()}", grid(L, BH), THREADS,
           maps + (o, lse, np.int32(L), np.int32(S), np.float32(sc), np.int32(bool(causal)), lay[0], np.int32(BH))
           + lay[1:], shared_mem=fwd_smem(hd))


def backward(q, k, v, o, lse, do, dq, dk, dv, causal: bool, scale: float | None):
    """Write dq, dk, dv (laid out like q, k, k) from the saved q, k, v, o, lse and the gradient do (like o).
    D = rowsum(dO * O), then the fused kernel and the dq conversion (dQ by fp32 atomics) where sdpa.py's
    ``fused_backward('bf16_wgmma', hd, max(L, S))`` says so, else the deterministic dK/dV and dQ kernels."""
    from blutensor.backends.cupy.sdpa import fused_backward  # sdpa imports this module

    cp = cupy()
    hd = q.shape[-1]
    _check((("q", q), ("k", k), ("v", v), ("o", o), ("do", do), ("dq", dq), ("dk", dk), ("dv", dv)), hd)
    L, S, BH, sc = problem(q, k, scale)
    if BH == 0 or L == 0 or S == 0:
        for a in (dq, dk, dv):
            a.fill(0)
        return
    rows = BH * L
    ld = cp.empty(lse_d_shape(BH, L), dtype=cp.float32)
    _, _, H, _, (st, sh, sb) = _view4(o, "o")
    launch(FILE, f"blu_sdpa_wgmma_bf16_hd{hd}_preprocess",
           min(math.ceil(ld.shape[0] * ld.shape[1] * (hd // 8) / 256), 16 * num_sms()), 256,
           (do, o, lse, ld, np.int32(BH), np.int32(L), np.int32(H), np.int64(sb), np.int64(sh), np.int32(st)))
    tail = (ld,)
    flags = (np.int32(L), np.int32(S), np.float32(sc), np.int32(bool(causal)))
    lk, lq = _out_lay(dk), _out_lay(dq)
    if fused_backward("bf16_wgmma", hd, max(L, S)):
        acc = cp.zeros(dq_accumulator_shape(BH, L, hd), dtype=cp.float32)  # dQ / scale, summed over key blocks
        launch(FILE, f"blu_sdpa_wgmma_bf16_hd{hd}_bwd_fused", grid(S, BH), THREADS,
               (tmap(k, "k", FWD_ROWS), tmap(v, "v", FWD_ROWS), tmap(q, "q", BOX_ROWS_STREAM),
                tmap(do, "do", BOX_ROWS_STREAM)) + tail + (dk, dv, acc) + flags + (lk[0], np.int32(BH)) + lk[1:],
               shared_mem=fused_smem(hd))
        launch(FILE, f"blu_sdpa_wgmma_bf16_hd{hd}_bwd_dq_convert",
               min(math.ceil(rows * (hd // 8) / 256), 16 * num_sms()), 256,
               (acc, dq, np.int64(rows), np.int32(L), np.float32(sc)) + lq)
        return
    smem = bwd_smem(hd)
    launch(FILE, f"blu_sdpa_wgmma_bf16_hd{hd}_bwd_dkdv", grid(S, BH), THREADS,
           (tmap(k, "k", FWD_ROWS), tmap(v, "v", FWD_ROWS), tmap(q, "q", BOX_ROWS_STREAM),
            tmap(do, "do", BOX_ROWS_STREAM)) + tail + (dk, dv) + flags + (lk[0], np.int32(BH)) + lk[1:],
           shared_mem=smem)
    launch(FILE, f"blu_sdpa_wgmma_bf16_hd{hd}_bwd_dq", grid(L, BH), THREADS,
           (tmap(q, "q", FWD_ROWS), tmap(do, "do", FWD_ROWS), tmap(k, "k", BOX_ROWS_STREAM),
            tmap(v, "v", BOX_ROWS_STREAM)) + tail + (dq,) + flags + (lq[0], np.int32(BH)) + lq[1:],
           shared_mem=smem)
