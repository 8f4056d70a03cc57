"""Flash attention on CUDA: forward saves only the log-sum-exp, backward recomputes.

Variants: 'f32' (kernels/sdpa.cu, SIMT fp32, HD 32/64/128); 'tf32', 'tf32x3' and 'bf16' (kernels/sdpa_mma.cu,
mma.sync on the matrix units, HD 64/128). 'tf32x3' is fp32 on the matrix units: each fp32 operand split as
big + small (both TF32), small*big + big*small + big*big accumulated in fp32 (3xTF32, CUTLASS's
OpMultiplyAddFastF32) -- what PyTorch's fp32 SDPA (the mem-efficient kernel) runs on sm_80+; its error is of
the order of the SIMT fp32 kernel's, not TF32's (measured: see benchmarks/results/attention_h200.json; the long
sums are staged so that the matrix units' truncating accumulation does not grow with the keys).
'bf16_wgmma' (kernels/sdpa_wgmma.cu, backends/cupy/sdpa_wgmma.py) is the Hopper (sm_90a) bf16 kernel: TMA loads,
wgmma, producer/consumer warpgroups, fused or deterministic backward; policy ``attention='mma'``
(``BLUTRAIN_SDPA_KERNEL=mma``) keeps 'bf16' there.
'tf32_wgmma' (kernels/sdpa_wgmma_tf32.cu, backends/cupy/sdpa_wgmma_tf32.py) is the Hopper forward for fp32 tensors
under matmul precision 'tf32'/'bf16' (wgmma .tf32, V read through a transposed scratch copy), with a deterministic
Hopper backward at head dim 64 (:func:`backward_variant`: head dim 128 and ``attention_backward='fused'`` run the
mma.sync 'tf32' backward on its lse). The default on sm_90 (policy ``attention_tf32='auto'``); 'mma'
(``BLUTRAIN_SDPA_TF32=mma``) keeps 'tf32', 'wgmma' requires sm_90. Grouped-query attention runs 'tf32' for it.
Choice (:func:`pick_variant`): bf16 tensors use 'bf16_wgmma' on sm_90, else 'bf16'; fp32 tensors use 'tf32'
when blutensor's matmul precision is 'tf32' or 'bf16', else (strict 'fp32') 'tf32x3' on sm_80+ where its shared
memory fits, as PyTorch's own fp32 SDPA does; policy ``attention_fp32='simt'`` (``BLUTRAIN_SDPA_FP32=simt``) selects the
SIMT kernel 'f32' there
(the earlier default).
Why tf32x3 is the default: in the end-to-end runs (GPT-2 124M, 50 steps from PyTorch's weights and batches) its
loss stays as close to PyTorch fp32 eager as PyTorch fp32 on cuBLASLt instead of cuBLAS stays to itself, and it
is faster than PyTorch's fp32 attention where the SIMT kernel is slower (measured: see
benchmarks/results/e2e_gpt2_fp32_h200.json and e2e_gpt2_fp32_h200_3xtf32_k4096.json). Calls the kernels do not
cover (an explicit mask, dropout, broadcast batch dims, other head dims) run blutensor's generic sdpa.
Backward (:func:`fused_backward`): 'tf32x3' runs one fused kernel (dK, dV, and dQ added with fp32 atomics: 5
products a tile pair instead of 7, dQ's last bits may vary run to run), and so does 'bf16_wgmma' at head dim 64;
'tf32' and 'bf16_wgmma' at 128 have one too, opt-in (FUSED_AUTO);
under the policy's ``deterministic`` (``bt.use_deterministic_algorithms(True)`` / ``BLUTRAIN_DETERMINISTIC=1``), or
``attention_backward='split'`` (``BLUTRAIN_SDPA_BWD=split``), the two deterministic kernels (dK/dV, then dQ). Every
choice reads the current execution policy (:mod:`blutensor.policy`), so a policy scope selects variants per region.
"""

from __future__ import annotations

import math

import numpy as np

from blutensor.backends.cupy import _fallback
from blutensor.backends.cupy import sdpa_wgmma as _wgmma
from blutensor.backends.cupy import sdpa_wgmma_tf32 as _wgmma_tf32
from blutensor.backends.cupy._loader import cupy, launch, smem_optin, suffix
from blutensor.errors import ShapeError
from blutensor.ops import nn_ops
from blutensor.ops.table import Kernel

SIMT_HD = (32, 64, 128)
MMA_HD = (64, 128)
BR = 64  # query (or key) rows per block in every variant but the mma forward
#: warps of a forward and a backward block of the mma kernels per (variant, head dim): MMA_ENTRIES' FW and BW
#: in sdpa_mma.cu (a mma forward block owns 16 queries a warp)
MMA_WARPS = {
    ("tf32", 64): (8, 8),
    ("tf32", 128): (8, 8),
    ("tf32x3", 64): (8, 8),
    ("tf32x3", 128): (8, 8),
    ("bf16", 64): (8, 8),
    ("bf16", 128): (8, 8),
}


def supports(variant: str, hd: int) -> bool:
    return hd in (SIMT_HD if variant == "f32" else MMA_HD)


def _check(q, k, v, variant):
    if (
        q.ndim != 3
        or k.ndim != 3
        or v.ndim != 3
        or q.shape[0] != k.shape[0]
        or k.shape != v.shape
        or q.shape[2] != k.shape[2]
    ):
        raise ShapeError(
            f"flash attention: q {q.shape}, k {k.shape}, v {v.shape} must be (BH, L, HD), (BH, S, HD), (BH, S, HD)"
        )
    want = np.uint16 if variant.startswith("bf16") else np.float32
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.dtype != want or not a.flags.c_contiguous:
            raise ShapeError(
                f"flash attention ({variant}): {name} must be contiguous {np.dtype(want)}, got "
                f"{a.dtype}{'' if a.flags.c_contiguous else ' (not contiguous)'}"
            )
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.data.ptr % 16:
            raise ShapeError(f"flash attention: {name} must start on a 16-byte boundary (copy it)")
    if not supports(variant, q.shape[2]):
        raise ShapeError(f"flash attention ({variant}): head dim {q.shape[2]} not supported")


def _names(variant: str, hd: int, kind: str = "fwd"):
    """(kernel file, entry suffix, threads per block) of a variant's forward ('fwd') or backward ('bwd')."""
    if variant == "f32":
        return "sdpa.cu", f"simt_hd{hd}", 64 * (hd // 32)
    return "sdpa_mma.cu", f"{variant}_hd{hd}", 32 * MMA_WARPS[variant, hd][kind == "bwd"]


def _fwd_rows(variant: str, hd: int) -> int:
    """Queries per forward block."""
    return BR if variant == "f32" else 16 * MMA_WARPS[variant, hd][0]


def _mma_smem(variant: str, hd: int, kind: str) -> int:
    """Dynamic shared memory of the mma kernels, kind 'fwd', 'bwd' or 'fused' (must match sdpa_mma.cu)."""
    es = 2 if variant == "bf16" else 4
    pad = 8 if variant == "bf16" else 4  # BF16::PAD / TF32::PAD in sdpa_mma.cu
    row = (hd + pad) * es
    if kind == "fwd":
        return 4 * BR * row  # K, V tiles, two stages (cp.async double buffering)
    bwd = 6 * BR * row + 4 * BR * 4  # own 2 tiles + 2 stages x 2 tiles; lse/D (dK/dV: per stage)
    return bwd + (BR * SLD * 4 if kind == "fused" else 0)  # fused: the tile's dS, [query][key]


#: variants with a fused backward kernel (dQ accumulated with fp32 atomics); SLD: the mma kernels' dS row stride
FUSED_BWD = ("tf32", "tf32x3", "bf16_wgmma")
#: where 'auto' takes it, variant -> head dims (None: every head dim): tf32x3 (faster than split on a GPT-2 layer
#: and at T=16384: benchmarks/results/attention_h200.json); bf16_wgmma at head dim 64, where each dQ partial is added
#: by one bulk reduction, at long sequences (FUSED_MIN_SEQ); not at 128 (red.global.add dQ, not yet timed ahead);
#: not tf32, whose HD-64 split kernels run two blocks a multiprocessor and the fused one (+18 KB shared) only one, so
#: split is faster -- BLUTRAIN_SDPA_BWD=fused selects any of FUSED_BWD
FUSED_AUTO: dict[str, tuple[int, ...] | None] = {"tf32x3": None, "bf16_wgmma": (64,)}
#: under 'auto', the shortest sequence (max(L, S)) a variant's fused backward is taken at: with the (lse, D) pairs
#: bulk-copied into each stage, bf16_wgmma's split pair is the faster one on a GPT-2 layer (T=1024: 0.455 vs 0.488
#: ms) and the fused kernel at T=16384 (6.09 vs 6.61 ms; benchmarks/results/attention_lse_stage_h200.json)
FUSED_MIN_SEQ: dict[str, int] = {"bf16_wgmma": 4096}
SLD = BR + 8
#: values of the policy's ``attention_backward`` (BLUTRAIN_SDPA_BWD; 'auto': fused for FUSED_AUTO, unless
#: deterministic algorithms are required)
SDPA_BWD = ("auto", "fused", "split")


def fused_backward(variant: str, hd: int, seq: int | None = None) -> bool:
    """Whether the backward of ``variant`` runs the fused kernel (dQ by fp32 atomics, not bitwise repeatable).

    Never under the policy's ``deterministic`` or ``attention_backward='split'``, nor where its shared memory does
    not fit; else for FUSED_AUTO ('auto', at sequences ``seq`` of at least FUSED_MIN_SEQ where that is known) or
    FUSED_BWD ('fused')."""
    from blutensor.policy import current

    pol = current()
    mode = pol.attention_backward
    if mode == "split" or variant not in FUSED_BWD:
        return False
    if mode == "auto" and (variant not in FUSED_AUTO or hd not in (FUSED_AUTO[variant] or (hd,))):
        return False
    if mode == "auto" and seq is not None and seq < FUSED_MIN_SEQ.get(variant, 0):
        return False
    if pol.deterministic:
        return False
    need = _wgmma.fused_smem(hd) if variant == "bf16_wgmma" else _mma_smem(variant, hd, "fused")
    return need <= smem_optin()


def flash_attention_forward(q, k, v, causal: bool = False, scale: float | None = None, variant: str = "f32"):
    """(o, lse) for q (BH, L, HD), k/v (BH, S, HD); lse (BH, L) fp32, natural log."""
    cp = cupy()
    _check(q, k, v, variant)
    BH, L, hd = q.shape
    S = k.shape[1]
    sc = float(scale) if scale is not None else 1.0 / math.sqrt(hd)
    o = cp.empty_like(q)
    lse = cp.empty((BH, L), dtype=cp.float32)
    if variant == "bf16_wgmma":
        _wgmma.forward(q, k, v, o, lse, causal, scale)
        return o, lse
    if variant == "tf32_wgmma":
        _wgmma_tf32.forward(q, k, v, o, lse, causal, scale)
        return o, lse
    if BH == 0 or L == 0:
        return o, lse
    file, tag, threads = _names(variant, hd)
    smem = 0 if variant == "f32" else _mma_smem(variant, hd, "fwd")
    launch(
        file,
        f"blu_sdpa_forward_{tag}",
        (math.ceil(L / _fwd_rows(variant, hd)), BH),
        threads,
        (q, k, v, o, lse, np.int32(L), np.int32(S), np.float32(sc), np.int32(bool(causal))),
        shared_mem=smem,
    )
    return o, lse


def flash_attention_backward(
    q, k, v, o, lse, do, causal: bool = False, scale: float | None = None, variant: str = "f32"
):
    """(dq, dk, dv): recomputes the probabilities from q, k and lse (fused kernel with atomic dQ or two
    deterministic kernels: :func:`fused_backward`)."""
    cp = cupy()
    _check(q, k, v, variant)
    BH, L, hd = q.shape
    S = k.shape[1]
    sc = float(scale) if scale is not None else 1.0 / math.sqrt(hd)
    if variant == "bf16_wgmma":
        dq, dk, dv = cp.empty_like(q), cp.empty_like(k), cp.empty_like(v)
        _wgmma.backward(q, k, v, o, lse, do, dq, dk, dv, causal, scale)
        return dq, dk, dv
    variant = backward_variant(variant, hd)
    if variant == "tf32_wgmma":
        dq, dk, dv = cp.empty_like(q), cp.empty_like(k), cp.empty_like(v)
        _wgmma_tf32.backward(q, k, v, o, lse, do, dq, dk, dv, causal, scale)
        return dq, dk, dv
    fused = fused_backward(variant, hd)
    dq = cp.zeros_like(q) if fused else cp.empty_like(q)
    dk, dv = cp.empty_like(k), cp.empty_like(v)
    if BH == 0 or L == 0 or S == 0:
        dq.fill(0), dk.fill(0), dv.fill(0)
        return dq, dk, dv
    D = cp.empty((BH, L), dtype=cp.float32)
    rows = BH * L
    launch(
        "sdpa.cu",
        f"blu_sdpa_backward_preprocess_{suffix(q)}",
        min(math.ceil(rows / 8), 65535 * 8),
        256,
        (do, o, D, np.int64(rows), np.int32(hd)),
    )
    file, tag, threads = _names(variant, hd, "bwd")
    args = (q, k, v, do, lse, D)
    tail = (np.int32(L), np.int32(S), np.float32(sc), np.int32(bool(causal)))
    if fused:
        launch(file, f"blu_sdpa_backward_fused_{tag}", (math.ceil(S / BR), BH), threads, args + (dq, dk, dv) + tail,
               shared_mem=_mma_smem(variant, hd, "fused"))
        return dq, dk, dv
    smem = 0 if variant == "f32" else _mma_smem(variant, hd, "bwd")
    launch(
        file,
        f"blu_sdpa_backward_dkdv_{tag}",
        (math.ceil(S / BR), BH),
        threads,
        args + (dk, dv) + tail,
        shared_mem=smem,
    )
    launch(
        file,
        f"blu_sdpa_backward_dq_{tag}",
        (math.ceil(L / BR), BH),
        threads,
        args + (dq,) + tail,
        shared_mem=smem,
    )
    return dq, dk, dv


def backward_variant(variant: str, hd: int) -> str:
    """The variant whose backward kernels run for ``variant``'s forward. 'tf32_wgmma': its own deterministic
    backward at the head dims it has (sdpa_wgmma_tf32.BWD_HDS) unless :func:`fused_backward` takes the fused
    mma.sync 'tf32' kernel (``attention_backward='fused'``); else the mma.sync 'tf32' backward (same lse
    convention: it recomputes the probabilities from the Hopper forward's lse). Others: themselves."""
    if variant != "tf32_wgmma":
        return variant
    if hd in _wgmma_tf32.BWD_HDS and not fused_backward("tf32", hd):
        return "tf32_wgmma"
    return "tf32"


def _prepared(a, n: int, hd: int):
    """``a`` as a contiguous, 16-byte aligned (BH, n, hd) array (copied only when needed)."""
    cp = cupy()
    a = cp.ascontiguousarray(a)
    if a.data.ptr % 16:
        a = a.copy()
    return a.reshape(-1, n, hd)


#: values of the policy's ``attention_fp32`` (BLUTRAIN_SDPA_FP32): how strict-fp32 attention runs (default 'tf32x3')
SDPA_FP32 = ("simt", "tf32x3")
_cc: dict[int, int] = {}


def _compute_capability() -> int:
    """Compute capability of the current device as an int (80, 90, ...; cached)."""
    cp = cupy()
    dev = cp.cuda.runtime.getDevice()
    if dev not in _cc:
        _cc[dev] = int(cp.cuda.Device(dev).compute_capability)
    return _cc[dev]


def sdpa_fp32() -> str:
    """'tf32x3' (default) or 'simt': the kernel of fp32 attention under strict matmul precision (the current
    execution policy's ``attention_fp32``)."""
    from blutensor.policy import current

    return current().attention_fp32


def pick_variant(dtype, hd: int) -> str | None:
    """Variant for storage ``dtype`` and head dim under blutensor's matmul precision (None: unsupported).

    bf16: 'bf16_wgmma' (kernels/sdpa_wgmma.cu: TMA, wgmma, warp specialisation) on sm_90 unless
    the policy's ``attention`` is 'mma', else the mma.sync 'bf16'.
    fp32: 'tf32' under matmul precision 'tf32'/'bf16' ('tf32_wgmma', the Hopper kernels, on sm_90 unless the
    policy's ``attention_tf32`` is 'mma'; 'wgmma' off sm_90 is a ValueError); under 'fp32' 'tf32x3' on sm_80+
    (``attention_fp32='simt'``: the SIMT 'f32'); 'f32' wherever the matrix-unit kernels do not apply."""
    if dtype == np.uint16:
        if hd in MMA_HD and _wgmma.available(hd, _compute_capability()):
            return "bf16_wgmma"
        return "bf16" if hd in MMA_HD else None
    if dtype != np.float32:
        return None
    from blutensor.gemm import get_matmul_precision

    prec = get_matmul_precision()
    want = "tf32" if prec in ("tf32", "bf16") else ("tf32x3" if sdpa_fp32() == "tf32x3" else "f32")
    if (
        want != "f32"
        and hd in MMA_HD
        and _compute_capability() >= 80
        and _mma_smem(want, hd, "bwd") <= smem_optin()
    ):
        if want == "tf32" and _wgmma_tf32.available(hd, _compute_capability()):
            return "tf32_wgmma"  # its backward is the 'tf32' one, whose shared memory was checked
        return want
    return "f32" if hd in SIMT_HD else None


class SdpaCuda(Kernel):
    """scaled_dot_product_attention on CUDA as flash attention (no probabilities kept)."""

    PLUGIN_NAME = "blutensor.cuda.sdpa"
    OP = "sdpa"
    BACKEND = "cuda"
    DTYPES = ("float32", "bfloat16")
    PRIORITY = 10
    BF16_NATIVE = True
    SAVES = (0, 1, 2)
    SAVES_OUTPUT = True
    SAME_DTYPE = (0, 1, 2)

    @staticmethod
    def forward(ctx, q, k, v, mask=None, scale=None, is_causal=False, dropout_p=0.0, seed=0, offset=0):
        variant = pick_variant(q.dtype, q.shape[-1]) if q.ndim >= 2 else None
        ok = (
            variant is not None
            and mask is None
            and not dropout_p
            and q.ndim >= 2
            and k.ndim == q.ndim
            and v.ndim == q.ndim
            and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]
            and k.shape == v.shape
            and q.shape[-1] == k.shape[-1]
            and k.dtype == q.dtype == v.dtype
        )
        if not ok:
            return _fallback.forward(
                ctx,
                nn_ops.sdpa_forward,
                (q, k, v),
                dict(mask=mask, scale=scale, is_causal=is_causal, dropout_p=dropout_p, seed=seed, offset=offset),
                bf16_inputs=(q.dtype == np.uint16,) * 3,
            )
        L, hd = q.shape[-2:]
        S = k.shape[-2]
        q3 = _prepared(q, L, hd)
        k3 = _prepared(k, S, hd)
        v3 = _prepared(v, S, hd)
        o, lse = flash_attention_forward(q3, k3, v3, bool(is_causal), scale, variant)
        ctx.saved = (q3, k3, v3, o, lse, bool(is_causal), scale, variant, q.shape, k.shape)
        return o.reshape(q.shape)

    @staticmethod
    def backward(ctx, g):
        if _fallback.used(ctx):
            return _fallback.backward(ctx, nn_ops.sdpa_backward, g)
        q3, k3, v3, o, lse, causal, scale, variant, qshape, kshape = ctx.saved
        do = _prepared(g, q3.shape[1], q3.shape[2])
        dq, dk, dv = flash_attention_backward(q3, k3, v3, o, lse, do, causal, scale, variant)
        needs = tuple(ctx.needs) + (True,) * 3
        return (
            dq.reshape(qshape) if needs[0] else None,
            dk.reshape(kshape) if needs[1] else None,
            dv.reshape(kshape) if needs[2] else None,
            None,
        )


# ---------------------------------------------------------------------------------------------------------------
# Fused-qkv attention: q, k, v read straight out of the (B, T, 3, H, HD) qkv projection (strided views, no
# split copies) and the output written as (B, T, H*HD), ready for the output projection (no transpose copy).
# The backward writes dq, dk, dv into one (B, T, 3*H*HD) gradient, the layout of qkv.


def layout(a) -> tuple[int, int, int]:
    """(sb, sh, st) element strides of a (B, n, H, HD) view with unit stride on HD (see struct Lay)."""
    es = a.itemsize
    sb, st, sh, sd = (s // es for s in a.strides)
    if sd != 1 or any(s % es for s in a.strides):
        raise ShapeError(f"flash attention (strided): the head dim must be contiguous, strides {a.strides}")
    return sb, sh, st


def _lay_args(H: int, lq, lk, lo):
    out = [np.int32(H)]
    for sb, sh, st in (lq, lk, lo):
        out += [np.int64(sb), np.int64(sh), np.int32(st)]
    return tuple(out)


def _check_strided(views, variant):
    want = np.uint16 if variant.startswith("bf16") else np.float32
    for name, a in views:
        sb, sh, st = layout(a)
        if a.dtype != want:
            raise ShapeError(f"flash attention ({variant}): {name} must be {np.dtype(want)}, got {a.dtype}")
        if a.data.ptr % 16 or (st * a.itemsize) % 16 or (sh * a.itemsize) % 16 or (sb * a.itemsize) % 16:
            raise ShapeError(f"flash attention (strided): {name} rows must be 16-byte aligned (strides {a.strides})")


def qkv_attention_forward(qkv5, causal: bool, scale: float | None, variant: str):
    """(o (B, T, H, HD), lse (B*H, T)) for a contiguous qkv5 (B, T, 3, H, HD)."""
    cp = cupy()
    B, T, _, H, hd = qkv5.shape
    q, k, v = qkv5[:, :, 0], qkv5[:, :, 1], qkv5[:, :, 2]
    o = cp.empty((B, T, H, hd), dtype=qkv5.dtype)
    lse = cp.empty((B * H, T), dtype=cp.float32)
    if B * H == 0 or T == 0:
        return o, lse
    _check_strided((("q", q), ("k", k), ("v", v), ("o", o)), variant)
    if variant == "bf16_wgmma":
        _wgmma.forward(q, k, v, o, lse, causal, scale)
        return o, lse
    if variant == "tf32_wgmma":
        _wgmma_tf32.forward(q, k, v, o, lse, causal, scale)
        return o, lse
    sc = float(scale) if scale is not None else 1.0 / math.sqrt(hd)
    file, tag, threads = _names(variant, hd)
    smem = 0 if variant == "f32" else _mma_smem(variant, hd, "fwd")
    launch(
        file,
        f"blu_sdpa_forward_strided_{tag}",
        (math.ceil(T / _fwd_rows(variant, hd)), B * H),
        threads,
        (q, k, v, o, lse, np.int32(T), np.int32(T), np.float32(sc), np.int32(bool(causal)))
        + _lay_args(H, layout(q), layout(k), layout(o)),
        shared_mem=smem,
    )
    return o, lse


def qkv_attention_backward(qkv5, o, lse, do, causal: bool, scale: float | None, variant: str):
    """dqkv (B, T, 3, H, HD) from the saved qkv5, o, lse and do (B, T, H, HD) contiguous."""
    cp = cupy()
    B, T, _, H, hd = qkv5.shape
    dqkv = cp.empty_like(qkv5)
    if B * H == 0 or T == 0:
        dqkv.fill(0)
        return dqkv
    q, k, v = qkv5[:, :, 0], qkv5[:, :, 1], qkv5[:, :, 2]
    dq, dk, dv = dqkv[:, :, 0], dqkv[:, :, 1], dqkv[:, :, 2]
    _check_strided((("do", do), ("o", o)), variant)
    if variant == "bf16_wgmma":
        _wgmma.backward(q, k, v, o, lse, do, dq, dk, dv, causal, scale)
        return dqkv
    variant = backward_variant(variant, hd)
    if variant == "tf32_wgmma":
        _wgmma_tf32.backward(q, k, v, o, lse, do, dq, dk, dv, causal, scale)
        return dqkv
    sc = float(scale) if scale is not None else 1.0 / math.sqrt(hd)
    rows = B * H * T
    D = cp.empty((B * H, T), dtype=cp.float32)
    lo = layout(o)
    launch(
        "sdpa.cu",
        f"blu_sdpa_backward_preprocess_strided_{suffix(qkv5)}",
        min(math.ceil(rows / 8), 65535 * 8),
        256,
        (do, o, D, np.int64(rows), np.int32(hd), np.int32(T), np.int32(H), np.int64(lo[0]), np.int64(lo[1]),
         np.int32(lo[2])),
    )
    file, tag, threads = _names(variant, hd, "bwd")
    tail = (np.int32(T), np.int32(T), np.float32(sc), np.int32(bool(causal))) + _lay_args(
        H, layout(q), layout(k), layout(do)
    )
    if fused_backward(variant, hd):
        dq.fill(0)
        launch(file, f"blu_sdpa_backward_fused_strided_{tag}", (math.ceil(T / BR), B * H), threads,
               (q, k, v, do, lse, D, dq, dk, dv) + tail, shared_mem=_mma_smem(variant, hd, "fused"))
        return dqkv
    smem = 0 if variant == "f32" else _mma_smem(variant, hd, "bwd")
    launch(file, f"blu_sdpa_backward_dkdv_strided_{tag}", (math.ceil(T / BR), B * H), threads,
           (q, k, v, do, lse, D, dk, dv) + tail, shared_mem=smem)
    launch(file, f"blu_sdpa_backward_dq_strided_{tag}", (math.ceil(T / BR), B * H), threads,
           (q, k, v, do, lse, D, dq) + tail, shared_mem=smem)
    return dqkv


def device_arrays(*tensors) -> bool:
    """Whether every tensor holds a real CuPy array: a tracer's arrays (blucompiler) take the op path, which it
    records op by op (the fused kernels read raw device pointers)."""
    return all(type(t._data).__module__.split(".")[0] == "cupy" for t in tensors)


def _fused_ok(qkv, n_head: int, dropout_p: float):
    """The kernel variant when the fused-qkv path applies to ``qkv`` (a Tensor), else None."""
    if qkv.device.type != "cuda" or dropout_p or qkv.ndim != 3 or qkv.shape[-1] % (3 * n_head):
        return None
    if not device_arrays(qkv):
        return None
    from blutensor.ops import dispatch
    from blutensor.ops.dispatch import resolve

    if any(_rewrites_sdpa(o) for o in dispatch.observers):  # e.g. context parallelism's ring attention
        return None
    dt = qkv.dtype.name
    if dispatch.autocast_hook is not None and dt == "float32":  # autocast lowers sdpa to bf16: the op path does
        return None
    if dt not in ("float32", "bfloat16") or resolve("sdpa", "cuda", dt).PLUGIN_NAME != SdpaCuda.PLUGIN_NAME:
        return None  # another sdpa kernel was chosen (BLUTRAIN_KERNELS / use_kernel): honour it
    return pick_variant(qkv._data.dtype, qkv.shape[-1] // (3 * n_head))


def _aligned_contiguous(a, cp):
    """``a`` itself when C-contiguous and 16-byte aligned, else an aligned contiguous copy."""
    if a.flags.c_contiguous and a.data.ptr % 16 == 0:
        return a
    a = cp.ascontiguousarray(a)
    return a if a.data.ptr % 16 == 0 else a.copy()


#: observers (by module prefix) that rewrite 'sdpa' calls: under them sdpa_qkv takes the op-by-op path
SDPA_REWRITERS = ("dtms.",)


def _rewrites_sdpa(obs) -> bool:
    """True when observer ``obs`` (function, bound method or callable object) comes from SDPA_REWRITERS."""
    import types

    owner = getattr(obs, "__self__", None)
    if owner is None and not isinstance(obs, types.FunctionType):
        owner = obs  # a callable instance
    mod = type(owner).__module__ if owner is not None else getattr(obs, "__module__", "") or ""
    return mod.startswith(SDPA_REWRITERS)


def _observed(fn, qkv, attrs):
    """Run ``fn`` through the dispatch observers as op 'sdpa_qkv' (profilers see and time it)."""
    from blutensor.ops import dispatch

    obs = list(dispatch.observers)

    def call(i):
        if i == len(obs):
            return fn()
        return obs[i]("sdpa_qkv", (qkv,), attrs, lambda: call(i + 1))

    return call(0)


def _sdpa_qkv_function():
    from blutensor._tensor import Tensor
    from blutensor.autograd.function import Function

    class SdpaQkv(Function):
        """Flash attention over a fused qkv projection (strided q/k/v, (B, T, H*HD) output)."""

        @staticmethod
        def forward(ctx, qkv, n_head, causal, scale, variant):
            cp = cupy()
            B, T, C3 = qkv.shape
            hd = C3 // (3 * n_head)
            qkv5 = _aligned_contiguous(qkv._data, cp).reshape(B, T, 3, n_head, hd)
            o, lse = qkv_attention_forward(qkv5, causal, scale, variant)
            ctx.saved = (qkv5, o, lse, causal, scale, variant, qkv.dtype)
            return Tensor._from_data(o.reshape(B, T, n_head * hd), qkv.dtype, qkv.device)

        @staticmethod
        def backward(ctx, g):
            qkv5, o, lse, causal, scale, variant, dtype = ctx.saved
            cp = cupy()
            B, T, _, H, hd = qkv5.shape
            do = _aligned_contiguous(g._data.astype(o.dtype, copy=False), cp)
            dqkv = qkv_attention_backward(qkv5, o, lse, do.reshape(B, T, H, hd), causal, scale, variant)
            return Tensor._from_data(dqkv.reshape(B, T, 3 * H * hd), dtype, g.device), None, None, None, None

    return SdpaQkv


_SDPA_QKV = []
_SDPA_QKV_CPU = []


def dispatch_observers() -> list:
    from blutensor.ops import dispatch

    return dispatch.observers


def sdpa_qkv(qkv, n_head: int, is_causal: bool = True, dropout_p: float = 0.0, scale: float | None = None):
    """Attention of a fused projection ``qkv`` (B, T, 3*C) split as (3, H, C/H) -> (B, T, C).

    CUDA (fp32/bf16, head dims the flash kernels cover, no dropout): one strided flash-attention kernel, no
    q/k/v or output copies; dispatch observers (profilers) see it as op 'sdpa_qkv'. Elsewhere, and under an
    observer that rewrites 'sdpa' (context parallelism's ring attention, see SDPA_REWRITERS): the same result
    through view/permute/contiguous and scaled_dot_product_attention (the reference). On the CPU (float32, the
    compiled kernels, no dropout) the compiled attention reads q/k/v in place and writes (B, T, C) directly
    (``backends/numpy/attention.py``, bit-identical to the op-by-op path), seen by observers as 'sdpa_qkv' too."""
    variant = _fused_ok(qkv, n_head, dropout_p)
    if variant is not None:
        if not _SDPA_QKV:
            _SDPA_QKV.append(_sdpa_qkv_function())
        from blutensor.ops import dispatch

        def fn():
            return _SDPA_QKV[0].apply(qkv, int(n_head), bool(is_causal), scale, variant)

        if dispatch.observers:
            return _observed(fn, qkv, {"n_head": int(n_head), "is_causal": bool(is_causal), "scale": scale})
        return fn()
    from blutensor.backends.numpy import attention as cpu_attention

    if cpu_attention.usable(qkv, n_head, dropout_p) and not any(_rewrites_sdpa(o) for o in dispatch_observers()):
        if not _SDPA_QKV_CPU:
            _SDPA_QKV_CPU.append(cpu_attention.sdpa_qkv_function())

        def host():
            return _SDPA_QKV_CPU[0].apply(qkv, int(n_head), bool(is_causal), scale)

        if dispatch_observers():
            return _observed(host, qkv, {"n_head": int(n_head), "is_causal": bool(is_causal), "scale": scale})
        return host()
    import blutensor.nn.functional as F

    B, T, C3 = qkv.shape
    hd = C3 // (3 * n_head)
    parts = qkv.view(B, T, 3, n_head, hd).permute(2, 0, 3, 1, 4)  # (3, B, H, T, hd)
    q, k, v = parts[0].contiguous(), parts[1].contiguous(), parts[2].contiguous()
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    return y.transpose(1, 2).reshape(B, T, n_head * hd)
