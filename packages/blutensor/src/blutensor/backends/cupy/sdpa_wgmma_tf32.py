"""Host side of the Hopper tf32 flash attention (kernels/sdpa_wgmma_tf32.cu: sm_90a, fp32 storage, wgmma .tf32;
forward for head dims 64 and 128, backward for 64): variant 'tf32_wgmma' of backends/cupy/sdpa.py.

The forward reads q and k by TMA through 4-D tensor maps (head dim, row, head, batch) built from each array's
strides, like the bf16 Hopper kernels (:mod:`sdpa_wgmma`), so the dense (BH, n, HD) arrays and the strided views of
a fused (B, T, 3, H, HD) projection take the same kernel. wgmma's tf32 shared-memory operands must be K-major, so
the P V product needs V with the keys innermost: a small transpose kernel first writes V^T into a scratch
(BH, HD, Sp) fp32 buffer (Sp = S rounded up to 8; the keys permuted inside every group of 8 so that the
probabilities' accumulator registers are the A operand as they are, and rounded to tf32), read by a third tensor
map. Output o is written through its (sb, sh, st) layout; lse (BH, L) fp32 natural log, the convention of every
flash kernel here, so the ring-attention merge and the backward accept it.

The backward (head dim 64, deterministic: no atomics) computes D = rowsum(dO * O), the scratch transposes Q^T, dO^T
and K^T (the B operands of dV += P^T dO, dK += dS^T Q and dQ += dS K), then the dK/dV kernel and the dQ kernel.
Head dim 128, whose tiles and transposes do not fit in shared memory together, and ``attention_backward='fused'``
(the atomic-dQ kernel exists on mma.sync only) run the mma.sync 'tf32' backward on this lse (sdpa.py's
``backward_variant`` decides).

:func:`available` says whether the variant applies: the execution policy's ``attention_tf32`` (``BLUTRAIN_SDPA_TF32``)
'auto' (the default: on sm_90) or 'wgmma' (required: an error on another device); 'mma' keeps the mma.sync kernels.
"""

from __future__ import annotations

import math

import numpy as np

from blutensor.backends.cupy import sdpa_wgmma as _wg
from blutensor.backends.cupy import tma
from blutensor.backends.cupy._loader import cupy, launch, num_sms
from blutensor.errors import ShapeError

FILE = "sdpa_wgmma_tf32.cu"
HDS = (64, 128)
THREADS = 384
BOX = 32  # fp32 elements of a TMA box row (128 bytes, the swizzle span)
FWD_ROWS = 128  # queries per forward CTA
#: (keys per tile, Q buffers, ring stages) of the forward per head dim: WGMMA_TF32_ENTRIES in sdpa_wgmma_tf32.cu
FWD_TILES = {64: (128, 2, 2), 128: (64, 1, 2)}
#: head dims with a Hopper tf32 backward; (dK/dV, dQ) ring stages: WGMMA_TF32_BWD_ENTRIES
BWD_HDS = (64,)
BWD_STAGES = {64: (2, 3)}
STREAM_ROWS = 64  # rows of the backward's streamed tiles
#: values of the policy's ``attention_tf32`` (BLUTRAIN_SDPA_TF32): the kernels of fp32 attention under matmul
#: precision 'tf32' / 'bf16' ('auto': these on sm_90, else mma.sync; 'mma': the mma.sync 'tf32' kernels; 'wgmma':
#: these, sm_90 only)
SDPA_TF32 = ("auto", "mma", "wgmma")


def kernel_setting() -> str:
    """The current execution policy's ``attention_tf32``: 'auto' (default), 'mma' or 'wgmma'."""
    from blutensor.policy import current

    return current().attention_tf32


def available(hd: int, cc: int) -> bool:
    """Whether tf32 attention of head dim ``hd`` runs these kernels on a device of compute capability ``cc``:
    policy ``attention_tf32`` 'auto' on sm_90, or 'wgmma' (on another device a ValueError: the kernels need
    sm_90a)."""
    setting = kernel_setting()
    if setting == "mma" or (setting == "auto" and cc != 90):
        return False
    if cc != 90:
        raise ValueError(f"attention_tf32='wgmma' (BLUTRAIN_SDPA_TF32=wgmma) needs an sm_90 (Hopper) GPU; this one "
                         f"is sm_{cc}")
    return hd in HDS


def fwd_smem(hd: int) -> int:
    """Dynamic shared memory of the forward (struct Fwd in sdpa_wgmma_tf32.cu)."""
    bn, qb, st = FWD_TILES[hd]
    qtile, ktile = FWD_ROWS * hd * 4, bn * hd * 4
    return 1024 + qb * qtile + 2 * st * ktile + 8 * (2 * qb + 2 * st)


def bwd_smem(hd: int, dkdv: bool) -> int:
    """Dynamic shared memory of the dK/dV (``dkdv``) or dQ kernel (struct Bwd in sdpa_wgmma_tf32.cu)."""
    st = BWD_STAGES[hd][0 if dkdv else 1]
    own, tile = FWD_ROWS * hd * 4, STREAM_ROWS * hd * 4
    return 1024 + 2 * own + st * (4 if dkdv else 3) * tile + 8 * (2 + 2 * st)


#: the dense / strided layouts, tensor maps and persistent grid are the bf16 Hopper kernels' (sdpa_wgmma.py)
KIND = "tf32 wgmma"
grid = _wg.grid


def _view4(a, name: str):
    """(ptr, n, H, B, (st, sh, sb) element strides) of ``a`` (sdpa_wgmma._view4)."""
    return _wg._view4(a, name, KIND)


def tmap(a, name: str, box_rows: int):
    """The tensor map of ``a`` (fp32) with boxes of 32 head-dim elements x ``box_rows`` rows (sdpa_wgmma.tmap)."""
    return _wg.tmap(a, name, box_rows, KIND)


def vt_tmap(vt, H: int):
    """The tensor map of a transposed scratch (B, H, HD, Sp) (:func:`transpose_v`): (position, head-dim row, head,
    batch), boxes of 32 positions x HD rows."""
    B, _, hd, sp = vt.shape
    spec = tma.tensor_spec(vt.data.ptr, 4, (sp, hd, H, B), (sp * 4, hd * sp * 4, H * hd * sp * 4), (BOX, hd, 1, 1))
    return tma.encode(spec, "flash attention (tf32 wgmma) transposed scratch")


def padded_keys(S: int) -> int:
    """Key positions of the V^T scratch: S rounded up to a multiple of 8 (the permutation groups)."""
    return -(-S // 8) * 8


def _lay(a) -> tuple:
    """(H, sb, sh, st) kernel arguments of an array read or written like ``a`` (sdpa_wgmma._out_lay)."""
    return _wg._out_lay(a, KIND)


def _check(arrays, hd: int):
    if hd not in HDS:
        raise ShapeError(f"flash attention (tf32 wgmma): head dim {hd} not supported (64 or 128)")
    for name, a in arrays:
        if a.dtype != np.float32:
            raise ShapeError(f"flash attention (tf32 wgmma): {name} must be float32, got {a.dtype}")


def transpose_v(v):
    """The transposed scratch of ``v`` ((BH, S, HD) or a (B, S, H, HD) view): (B, H, HD, Sp) fp32, rows permuted
    inside groups of 8, rounded to tf32, zero past S (kernel blu_sdpa_wgmma_tf32_hd*_transpose): V^T of the
    forward, Q^T, dO^T, K^T of the backward."""
    cp = cupy()
    hd, S = v.shape[-1], v.shape[1]
    _, _, H, B, _ = _view4(v, "v")
    sp = padded_keys(S)
    vt = cp.empty((B, H, hd, sp), dtype=cp.float32)
    lay = _lay(v)
    launch(FILE, f"blu_sdpa_wgmma_tf32_hd{hd}_transpose", (math.ceil(sp / 32), hd // 32, B * H), (32, 8),
           (v, vt, np.int32(S), np.int32(sp)) + lay)
    return vt


def forward(q, k, v, o, lse, causal: bool, scale: float | None):
    """Write o (like q) and lse (BH, L) for fp32 q/k/v given as (BH, n, HD) arrays or (B, n, H, HD) views."""
    hd = q.shape[-1]
    _check((("q", q), ("k", k), ("v", v), ("o", o)), hd)
    L, S, BH, sc = _wg.problem(q, k, scale)
    if BH == 0 or L == 0:
        return
    if S == 0:  # no keys: the flash kernels' convention is zero rows and -inf
        o.fill(0)
        lse.fill(-np.inf)
        return
    vt = transpose_v(v)
    bn = FWD_TILES[hd][0]
    maps = (tmap(q, "q", FWD_ROWS), tmap(k, "k", bn), vt_tmap(vt, vt.shape[1]))
    lay = _lay(o)
    launch(FILE, f"blu_sdpa_wgmma_tf32_hd{hd}_fwd", grid(L, BH), THREADS,
           maps + (o, lse, np.int32(L), np.int32(S), np.float32(sc), np.int32(bool(causal)), lay[0], np.int32(BH))
           + lay[1:], shared_mem=fwd_smem(hd))


def backward(q, k, v, o, lse, do, dq, dk, dv, causal: bool, scale: float | None):
    """Write dq, dk, dv (laid out like q, k, k) from the saved q, k, v, o, lse and the gradient do (like o), head dim
    64: D = rowsum(dO * O), the transposes Q^T, dO^T, K^T, then the dK/dV and dQ kernels (bitwise repeatable)."""
    cp = cupy()
    hd = q.shape[-1]
    _check((("q", q), ("k", k), ("v", v), ("o", o), ("do", do), ("dq", dq), ("dk", dk), ("dv", dv)), hd)
    if hd not in BWD_HDS:
        raise ShapeError(f"flash attention (tf32 wgmma): no Hopper backward for head dim {hd} (64); the mma.sync "
                         f"'tf32' backward runs it")
    L, S, BH, sc = _wg.problem(q, k, scale)
    if BH == 0 or L == 0 or S == 0:
        for a in (dq, dk, dv):
            a.fill(0)
        return
    D = cp.empty((BH, L), dtype=cp.float32)
    rows = BH * L
    lo = _lay(o)
    launch(FILE, f"blu_sdpa_wgmma_tf32_hd{hd}_preprocess", min(math.ceil(rows * (hd // 4) / 256), 16 * num_sms()),
           256, (do, o, D, np.int64(rows), np.int32(L)) + lo)
    qt, dot, kt = transpose_v(q), transpose_v(do), transpose_v(k)
    H = np.int32(qt.shape[1])
    tail = (lse, D)
    flags = (np.int32(L), np.int32(S), np.float32(sc), np.int32(bool(causal)))
    lk, lq = _lay(dk), _lay(dq)
    launch(FILE, f"blu_sdpa_wgmma_tf32_hd{hd}_bwd_dkdv", grid(S, BH), THREADS,
           (tmap(k, "k", FWD_ROWS), tmap(v, "v", FWD_ROWS), tmap(q, "q", STREAM_ROWS), tmap(do, "do", STREAM_ROWS),
            vt_tmap(qt, H), vt_tmap(dot, H)) + tail + (dk, dv) + flags + (lk[0], np.int32(BH)) + lk[1:],
           shared_mem=bwd_smem(hd, True))
    launch(FILE, f"blu_sdpa_wgmma_tf32_hd{hd}_bwd_dq", grid(L, BH), THREADS,
           (tmap(q, "q", FWD_ROWS), tmap(do, "do", FWD_ROWS), tmap(k, "k", STREAM_ROWS), tmap(v, "v", STREAM_ROWS),
            vt_tmap(kt, H)) + tail + (dq,) + flags + (lq[0], np.int32(BH)) + lq[1:],
           shared_mem=bwd_smem(hd, False))
