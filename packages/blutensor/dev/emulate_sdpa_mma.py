"""Lane-level NumPy emulation of kernels/sdpa_mma.cu (no GPU): a line-by-line transliteration of the
forward, dK/dV and dQ kernels over the 32 lanes of each warp, with mma.sync modelled by the PTX fragment
layouts (m16n8k8 tf32 and 3xtf32, m16n8k16 bf16). It checks the tiling, masking, online softmax and the
accumulator -> A-operand conversion against the float64 reference; the fragment layouts themselves are
the PTX ISA's and are confirmed only by the GPU run (the cuda-marked tests/test_cuda_kernels.py).

Usage: python packages/blutensor/dev/emulate_sdpa_mma.py
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_reference as ref  # noqa: E402

LANE = np.arange(32)
G = LANE >> 2
T = LANE & 3
BR = 64  # rows of a staged tile; rows of a backward block
#: warps of a forward / backward block per fragment class (MMA_ENTRIES' FW / BW in sdpa_mma.cu)
WARPS = {"Tf32": (8, 8), "Tf32x3": (8, 8), "Bf16": (8, 8)}
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
#: tf32x3 tolerances (max abs error / max |ref|): fp32-level, like the SIMT kernel's (kernel_reference.TOL f32)
TOL_X3 = {"fwd": 1e-5, "bwd": 5e-5}


def f32(x):
    return np.asarray(x, dtype=np.float32)


def tf32(x):
    """cvt.rna.tf32.f32 as sm_90 executes it: the bits plus 0x1000 (round to nearest, ties away from zero) with
    the 13 low bits left as don't-care (inf/nan passed through); tf32_value() is what mma.sync reads."""
    u = f32(x).view(np.uint32).astype(np.uint64)
    finite = (u & 0x7F800000) != 0x7F800000
    u = np.where(finite, (u + 0x1000) & 0xFFFFFFFF, u).astype(np.uint32)
    return u.view(np.float32)


def rz32(x):
    """float64 -> fp32 rounded toward zero (the matrix units' fp32 accumulation)."""
    x = np.asarray(x, np.float64)
    r = x.astype(np.float32)
    over = np.abs(r.astype(np.float64)) > np.abs(x)
    return np.where(over, np.nextafter(r, np.float32(0)), r).astype(np.float32)


def tf32_value(x):
    """The tf32 number an mma operand register holds: the 13 low mantissa bits ignored (masked)."""
    return (f32(x).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def bf16(x):
    return f32(ref.bf16_round(f32(x)))


def ldmatrix32(X, rows, cols, nmat):
    """ldmatrix.m8n8.x{nmat}.b16 on fp32 data: lane i addresses row (i % 8) of matrix (i // 8), 4 floats at
    X[rows[i], cols[i]:+4]; lane (g, t) receives fp32 element (g, t) of each matrix -> (32, nmat)."""
    out = np.zeros((32, nmat), np.float32)
    for j in range(nmat):
        M = np.stack([X[rows[8 * j + r], cols[8 * j + r] : cols[8 * j + r] + 4] for r in range(8)])
        out[:, j] = M[G, T]
    return out


class Tf32:
    """Fragments loaded the way sdpa_mma.cu does by default (A and K-like B through ldmatrix on b16 pairs) from
    tiles rounded to tf32 once when staged (TF32::ROUND_TILES): the loaders move bits only."""

    KS, PAD = 8, 4
    stage = staticmethod(tf32)  # round_tile / load_tile

    @staticmethod
    def load_a(X, r0, k0):  # -> (32, 4)
        j = LANE >> 3
        return ldmatrix32(X, r0 + (j & 1) * 8 + (LANE & 7), k0 + (j >> 1) * 4, 4)

    @staticmethod
    def load_bt(X, n0, k0):  # B[k][n] = X[n0 + n][k0 + k] -> (32, 2)
        lane = LANE & 15
        return ldmatrix32(X, n0 + (lane & 7), k0 + (lane >> 3) * 4, 2)

    @staticmethod
    def load_b(X, k0, n0):  # B[k][n] = X[k0 + perm(k)][n0 + n]: B row t <-> k 2t, row t + 4 <-> k 2t + 1
        return Tf32.raw_b(X, k0, n0)

    @staticmethod
    def raw_b(X, k0, n0):
        return np.stack([X[k0 + 2 * T, n0 + G], X[k0 + 2 * T + 1, n0 + G]], 1)

    @staticmethod
    def mma(c, a, b):
        a, b = tf32_value(a), tf32_value(b)
        A = np.zeros((16, 8), np.float64)
        A[G, T], A[G + 8, T], A[G, T + 4], A[G + 8, T + 4] = a[:, 0], a[:, 1], a[:, 2], a[:, 3]
        B = np.zeros((8, 8), np.float64)
        B[T, G], B[T + 4, G] = b[:, 0], b[:, 1]
        return c + c_frag(A @ B)

    @staticmethod
    def mma_acc(c, a, b):
        return Tf32.mma(c, a, b)

    @staticmethod
    def raw_c_to_a(cs, kk):  # the accumulator IS the A fragment under the k permutation (no shuffles)
        c = cs[kk]
        return np.stack([c[:, 0], c[:, 2], c[:, 1], c[:, 3]], 1)

    @staticmethod
    def c_to_a(cs, kk):
        return tf32(Tf32.raw_c_to_a(cs, kk))

    @staticmethod
    def raw_a_perm(X, r0, k0):  # A from row-major X[r][k] in raw_b's permuted k order (float2 loads)
        return np.stack([X[r0 + G, k0 + 2 * T], X[r0 + G + 8, k0 + 2 * T], X[r0 + G, k0 + 2 * T + 1],
                         X[r0 + G + 8, k0 + 2 * T + 1]], 1)

    load_a_perm = raw_a_perm
    tile_value = staticmethod(tf32)  # the fused backward's dS tile, rounded like every staged tile
    cast = staticmethod(f32)


def split3(x):
    """3xTF32 split of fp32 ``x`` (last axis n) -> (..., 2n): big = tf32(x), small = tf32(x - big)."""
    x = f32(x)
    u = x.view(np.uint32).astype(np.uint64)
    big = (((u + 0x1000) & 0xFFFFE000) & 0xFFFFFFFF).astype(np.uint32).view(np.float32)  # add + mask, no guard
    with np.errstate(invalid="ignore"):
        return np.concatenate([big, tf32(x - big)], -1)


class Tf32x3:
    """tf32x3 fragments (TF32X3 in sdpa_mma.cu): the raw fp32 fragments of Tf32, split into big and small
    halves (registers [0, n) and [n, 2n)); mma = small*big, big*small, big*big, each an m16n8k8 tf32 mma
    accumulating in fp32, modelled as rounding toward zero (the matrix units truncate their fp32 sums);
    mma_acc (the long sums of acc_pv) stages them: a zeroed temporary, then one rounded fp32 add."""

    KS, PAD = 8, 4
    stage = staticmethod(f32)  # tiles stay fp32

    @staticmethod
    def load_a(X, r0, k0):  # -> (32, 8)
        j = LANE >> 3
        return split3(ldmatrix32(X, r0 + (j & 1) * 8 + (LANE & 7), k0 + (j >> 1) * 4, 4))

    @staticmethod
    def load_bt(X, n0, k0):  # -> (32, 4)
        lane = LANE & 15
        return split3(ldmatrix32(X, n0 + (lane & 7), k0 + (lane >> 3) * 4, 2))

    @staticmethod
    def load_b(X, k0, n0):
        return split3(Tf32.raw_b(X, k0, n0))

    @staticmethod
    def mma(c, a, b):  # small * big, big * small, big * big straight into the accumulator
        for a_, b_ in ((a[:, 4:], b[:, :2]), (a[:, :4], b[:, 2:]), (a[:, :4], b[:, :2])):
            c = rz32(Tf32.mma(c, a_, b_))
        return c

    @staticmethod
    def mma_acc(c, a, b):  # staged: the three products into a zeroed temporary, then one rounded fp32 add
        return f32(np.asarray(c, np.float64) + Tf32x3.mma(np.zeros((32, 4)), a, b))

    @staticmethod
    def c_to_a(cs, kk):
        return split3(Tf32.raw_c_to_a(cs, kk))

    @staticmethod
    def load_a_perm(X, r0, k0):
        return split3(Tf32.raw_a_perm(X, r0, k0))

    tile_value = staticmethod(f32)  # tiles stay fp32
    cast = staticmethod(f32)


def fragment_product(X, A, B):
    """A (16, KS) @ B (KS, 8) through X's fragment loaders and mma (A staged row-major, B as the K-like
    operand B[k][n] = Bt[n][k]) -> (16, 8) float64; checks the fragment math of one mma step."""
    As = np.zeros((16, X.KS + X.PAD), np.float32)
    As[:, : X.KS] = A
    Bs = np.zeros((8, X.KS + X.PAD), np.float32)
    Bs[:, : X.KS] = B.T
    As, Bs = X.stage(As), X.stage(Bs)
    c = X.mma(np.zeros((32, 4)), X.load_a(As, 0, 0), X.load_bt(Bs, 0, 0))
    out = np.zeros((16, 8))
    out[G, 2 * T], out[G, 2 * T + 1], out[G + 8, 2 * T], out[G + 8, 2 * T + 1] = c[:, 0], c[:, 1], c[:, 2], c[:, 3]
    return out


def ldmatrix(X, rows, cols, nmat, trans=False):
    """ldmatrix.m8n8.x{nmat}[.trans].b16: lane i addresses row (i % 8) of matrix (i // 8) at X[rows[i], cols[i]:+8];
    returns (32, nmat, 2): lane (g, t) gets M[g][2t:2t+2] (trans: M[2t][g], M[2t+1][g])."""
    out = np.zeros((32, nmat, 2), np.float32)
    for j in range(nmat):
        M = np.stack([X[rows[8 * j + r], cols[8 * j + r] : cols[8 * j + r] + 8] for r in range(8)])
        if trans:
            M = M.T
        out[:, j, 0], out[:, j, 1] = M[G, 2 * T], M[G, 2 * T + 1]
    return out


class Bf16:
    """Fragments loaded the way sdpa_mma.cu does by default (ldmatrix; BLU_NO_LDMATRIX: plain loads)."""

    KS, PAD = 16, 8
    stage = staticmethod(f32)

    @staticmethod
    def load_a(X, r0, k0):  # -> (32, 4, 2)
        j = LANE >> 3
        return ldmatrix(X, r0 + (j & 1) * 8 + (LANE & 7), k0 + (j >> 1) * 8, 4)

    @staticmethod
    def load_bt(X, n0, k0):  # B[k][n] = X[n0 + n][k0 + k]
        lane = LANE & 15
        return ldmatrix(X, n0 + (lane & 7), k0 + (lane >> 3) * 8, 2)

    @staticmethod
    def load_b(X, k0, n0):  # B[k][n] = X[k0 + k][n0 + n]
        lane = LANE & 15
        return ldmatrix(X, k0 + lane, np.full(32, n0), 2, trans=True)

    @staticmethod
    def load_a_plain(X, r0, k0):
        def pair(r, k):
            return np.stack([X[r, k], X[r, k + 1]], -1)

        return np.stack(
            [
                pair(r0 + G, k0 + 2 * T),
                pair(r0 + G + 8, k0 + 2 * T),
                pair(r0 + G, k0 + 2 * T + 8),
                pair(r0 + G + 8, k0 + 2 * T + 8),
            ],
            1,
        )

    @staticmethod
    def mma(c, a, b):
        A = np.zeros((16, 16), np.float64)
        for j in (0, 1):
            A[G, 2 * T + j], A[G + 8, 2 * T + j] = a[:, 0, j], a[:, 1, j]
            A[G, 2 * T + 8 + j], A[G + 8, 2 * T + 8 + j] = a[:, 2, j], a[:, 3, j]
        B = np.zeros((16, 8), np.float64)
        for j in (0, 1):
            B[2 * T + j, G], B[2 * T + 8 + j, G] = b[:, 0, j], b[:, 1, j]
        return c + c_frag(A @ B)

    @staticmethod
    def mma_acc(c, a, b):
        return Bf16.mma(c, a, b)

    @staticmethod
    def c_to_a(cs, kk):
        c0, c1 = cs[2 * kk], cs[2 * kk + 1]
        return bf16(np.stack([c0[:, 0:2], c0[:, 2:4], c1[:, 0:2], c1[:, 2:4]], 1))

    cast = staticmethod(bf16)


def c_frag(Cm):
    """(16, 8) matrix -> (32, 4) accumulator fragments."""
    return np.stack([Cm[G, 2 * T], Cm[G, 2 * T + 1], Cm[G + 8, 2 * T], Cm[G + 8, 2 * T + 1]], 1)


def acc_pv(X, acc, cs, Bs, k0, nk, al0=None, al1=None):
    """acc_pv of sdpa_mma.cu: acc (x alpha first when given) + sum over nk k-steps of A(cs, kk) B(Bs rows k0 + ..)
    with X.mma_acc (staged for tf32x3) up to 8 n-tiles (HD 64), X.mma beyond."""
    mma = X.mma_acc if len(acc) <= 8 else X.mma
    out = []
    for d, c in enumerate(acc):
        if al0 is not None:
            c = np.concatenate([c[:, 0:2] * al0[:, None], c[:, 2:4] * al1[:, None]], 1)
        for kk in range(nk):
            c = mma(c, X.c_to_a(cs, kk), X.load_b(Bs, k0 + kk * X.KS, d * 8))
        out.append(c)
    return out


def load_tile(X, src, r0, n, hd):
    """Rows [r0, r0 + 64) of src staged as sdpa_mma.cu does (zeros past n; X.stage: tf32 rounds the tile)."""
    tile = np.zeros((BR, hd + X.PAD), np.float32)
    rows = min(BR, max(0, n - r0))
    tile[:rows, :hd] = src[r0 : r0 + rows]
    return X.stage(tile)


def forward(X, q, k, v, L, S, hd, scale, causal):
    """One (BH) slice: returns (o, lse) like blu_sdpa_forward_*."""
    o = np.zeros((L, hd), np.float32)
    lse = np.zeros(L, np.float32)
    c = np.float32(scale * LOG2E)
    fw = WARPS[X.__name__][0]
    fr = 16 * fw  # queries of a block
    for bx in range(math.ceil(L / fr)):
        q0 = bx * fr
        Qs = np.concatenate([load_tile(X, q, q0 + j * BR, L, hd) for j in range(fr // BR)])
        for w in range(fw):
            row0, row1 = q0 + w * 16 + G, q0 + w * 16 + G + 8
            qa = [X.load_a(Qs, w * 16, ks * X.KS) for ks in range(hd // X.KS)]
            acc = [np.zeros((32, 4)) for _ in range(hd // 8)]
            m0 = np.full(32, -np.inf, np.float32)
            m1 = m0.copy()
            l0 = np.zeros(32, np.float32)
            l1 = l0.copy()
            kend = min(S, q0 + fr) if causal else S
            for k0 in range(0, kend, BR):
                if causal and k0 > q0 + w * 16 + 15:
                    continue  # the warp skips a tile its rows all precede
                Ks, Vs = load_tile(X, k, k0, S, hd), load_tile(X, v, k0, S, hd)
                s = [np.zeros((32, 4)) for _ in range(BR // 8)]
                for ks in range(hd // X.KS):
                    for n in range(BR // 8):
                        s[n] = X.mma(s[n], qa[ks], X.load_bt(Ks, n * 8, ks * X.KS))
                for n in range(BR // 8):
                    s[n] = f32(s[n]) * c
                    for e in range(4):
                        key = k0 + n * 8 + 2 * T + (e & 1)
                        row = row0 if e < 2 else row1
                        s[n][:, e] = np.where((key >= S) | (causal & (key > row)), -np.inf, s[n][:, e])
                mx0 = np.max([s[n][:, e] for n in range(BR // 8) for e in (0, 1)], 0)
                mx1 = np.max([s[n][:, e] for n in range(BR // 8) for e in (2, 3)], 0)
                for off in (1, 2):
                    mx0 = np.maximum(mx0, mx0[LANE ^ off])
                    mx1 = np.maximum(mx1, mx1[LANE ^ off])
                mn0, mn1 = np.maximum(m0, mx0), np.maximum(m1, mx1)
                mu0, mu1 = np.where(mn0 == -np.inf, 0, mn0), np.where(mn1 == -np.inf, 0, mn1)
                al0, al1 = np.exp2(m0 - mu0), np.exp2(m1 - mu1)
                l0, l1 = l0 * al0, l1 * al1
                for n in range(BR // 8):
                    s[n][:, 0:2] = np.exp2(s[n][:, 0:2] - mu0[:, None])
                    s[n][:, 2:4] = np.exp2(s[n][:, 2:4] - mu1[:, None])
                    l0 = l0 + s[n][:, 0] + s[n][:, 1]
                    l1 = l1 + s[n][:, 2] + s[n][:, 3]
                acc = acc_pv(X, acc, s, Vs, 0, BR // X.KS, al0, al1)  # O = O * alpha + P V
                m0, m1 = mn0, mn1
            for off in (1, 2):
                l0 = l0 + l0[LANE ^ off]
                l1 = l1 + l1[LANE ^ off]
            for d in range(hd // 8):
                for rows, cols, li in ((row0, (0, 1), l0), (row1, (2, 3), l1)):
                    ok = rows < L
                    for j, col in enumerate(cols):
                        o[rows[ok], d * 8 + 2 * T[ok] + j] = X.cast(acc[d][ok, col] / li[ok])
            for rows, m, li in ((row0, m0, l0), (row1, m1, l1)):
                ok = (rows < L) & (T == 0)
                lse[rows[ok]] = (m[ok] + np.log2(li[ok])) * LN2
    return o, lse


def _reduce_halves(parts):
    """Warps w and w + 4 (same rows) add their partial fp32 accumulators, warp w's first (BWD_THREADS)."""
    return [[f32(f32(a) + f32(b)) for a, b in zip(parts[w], parts[w + 4])] for w in range(4)]


def dq_atomic(X, Ss, Ks, dq, q0, L, hd, bw, scale):
    """dq_atomic of sdpa_mma_frag.cuh for every warp of a fused block: rows (w % 4) * 16 .., head-dim columns
    (w // 4) * hd / (bw / 4) .. of dS K (a zeroed, staged accumulator over the 64 keys), added into the fp32
    ``dq`` (float32 adds: the atomics, in some order)."""
    dw = hd // (bw // 4)
    for w in range(bw):
        lr, part = (w % 4) * 16, w // 4
        acc = [np.zeros((32, 4)) for _ in range(dw // 8)]
        for kk in range(BR // X.KS):
            a = X.load_a_perm(Ss, lr, kk * X.KS)
            for n in range(dw // 8):
                acc[n] = X.mma_acc(acc[n], a, X.load_b(Ks, kk * X.KS, part * dw + n * 8))
        for n in range(dw // 8):
            col = part * dw + n * 8 + 2 * T
            for rows, cs in ((q0 + lr + G, (0, 1)), (q0 + lr + G + 8, (2, 3))):
                ok = rows < L
                for j, e in enumerate(cs):
                    val = f32(f32(acc[n][ok, e]) * np.float32(scale))
                    dq[rows[ok], col[ok] + j] = f32(dq[rows[ok], col[ok] + j] + val)


def backward(X, q, k, v, do, lse, D, L, S, hd, scale, causal, fused=False):
    """(dq, dk, dv) of one slice like blu_sdpa_backward_dkdv_* and blu_sdpa_backward_dq_*: warp w owns rows
    (w % 4) * 16 .. +15; with 8 warps half w // 4 of every streamed tile, the halves' sums added at the end.
    ``fused`` (Tf32, Tf32x3): blu_sdpa_backward_fused_*, the dK/dV kernel staging each tile's dS and adding dS K
    into a zeroed fp32 dq (dq_atomic) instead of the separate dQ kernel."""
    c = np.float32(scale * LOG2E)
    dk, dv, dq = np.zeros((S, hd)), np.zeros((S, hd)), np.zeros((L, hd))
    if fused:
        dq = np.zeros((L, hd), np.float32)
    sub = BR // 2
    bw = WARPS[X.__name__][1]
    for bx in range(math.ceil(S / BR)):  # ---- dK/dV
        kb0 = bx * BR
        Ks, Vs = load_tile(X, k, kb0, S, hd), load_tile(X, v, kb0, S, hd)
        dkp, dvp = [], []
        tiles = {}  # fused: q0 -> the tile's dS as Ss[query][key] (tile_value)
        for w in range(bw):
            wr, subs = w % 4, ([w // 4] if bw == 8 else [0, 1])
            key0, key1 = kb0 + wr * 16 + G, kb0 + wr * 16 + G + 8
            dka = [np.zeros((32, 4)) for _ in range(hd // 8)]
            dva = [np.zeros((32, 4)) for _ in range(hd // 8)]
            for q0 in range(kb0 if causal else 0, L, BR):
                Qs, Os = load_tile(X, q, q0, L, hd), load_tile(X, do, q0, L, hd)
                Ls = np.zeros(BR, np.float32)
                Ds = np.zeros(BR, np.float32)
                nr = min(BR, L - q0)
                Ls[:nr], Ds[:nr] = lse[q0 : q0 + nr] * np.float32(LOG2E), D[q0 : q0 + nr]
                for qs0 in (h * sub for h in subs):  # 8 warps: this warp's half of the tile; 4: both
                    st = [np.zeros((32, 4)) for _ in range(sub // 8)]
                    dpt = [np.zeros((32, 4)) for _ in range(sub // 8)]
                    for ks in range(hd // X.KS):
                        ak, av = X.load_a(Ks, wr * 16, ks * X.KS), X.load_a(Vs, wr * 16, ks * X.KS)
                        for n in range(sub // 8):
                            st[n] = X.mma(st[n], ak, X.load_bt(Qs, qs0 + n * 8, ks * X.KS))
                            dpt[n] = X.mma(dpt[n], av, X.load_bt(Os, qs0 + n * 8, ks * X.KS))
                    for n in range(sub // 8):
                        for e in range(4):
                            qi = qs0 + n * 8 + 2 * T + (e & 1)
                            qg = q0 + qi
                            key = key0 if e < 2 else key1
                            p = np.exp2(f32(st[n][:, e]) * c - Ls[qi])
                            p = np.where((qg >= L) | (key >= S) | (causal & (key > qg)), 0, p)
                            st[n][:, e] = p
                            dpt[n][:, e] = p * (f32(dpt[n][:, e]) - Ds[qi])
                            if fused:
                                Ss = tiles.setdefault(q0, np.zeros((BR, BR + 8), np.float32))
                                Ss[qi, wr * 16 + G + (0 if e < 2 else 8)] = X.tile_value(dpt[n][:, e])
                    dva = acc_pv(X, dva, st, Os, qs0, sub // X.KS)  # dV += P^T dO
                    dka = acc_pv(X, dka, dpt, Qs, qs0, sub // X.KS)  # dK += dS^T Q
            dkp.append(dka)
            dvp.append(dva)
        for q0, Ss in tiles.items():  # fused: after each tile, every warp adds its part of dS K
            dq_atomic(X, Ss, Ks, dq, q0, L, hd, bw, scale)
        if bw == 8:
            dkp, dvp = _reduce_halves(dkp), _reduce_halves(dvp)
        for w, (dka, dva) in enumerate(zip(dkp, dvp)):
            key0, key1 = kb0 + w * 16 + G, kb0 + w * 16 + G + 8
            for d in range(hd // 8):
                for keys, cols in ((key0, (0, 1)), (key1, (2, 3))):
                    ok = keys < S
                    for j, col in enumerate(cols):
                        dk[keys[ok], d * 8 + 2 * T[ok] + j] = X.cast(dka[d][ok, col] * scale)
                        dv[keys[ok], d * 8 + 2 * T[ok] + j] = X.cast(dva[d][ok, col])
    for bx in range(0 if fused else math.ceil(L / BR)):  # ---- dQ (the fused kernel has added it)
        q0 = bx * BR
        Qs, Os = load_tile(X, q, q0, L, hd), load_tile(X, do, q0, L, hd)
        Ls = np.zeros(BR, np.float32)
        Ds = np.zeros(BR, np.float32)
        nr = min(BR, L - q0)
        Ls[:nr], Ds[:nr] = lse[q0 : q0 + nr] * np.float32(LOG2E), D[q0 : q0 + nr]
        dqp = []
        for w in range(bw):
            wr, subs = w % 4, ([w // 4] if bw == 8 else [0, 1])
            r0, r1 = wr * 16 + G, wr * 16 + G + 8
            dqa = [np.zeros((32, 4)) for _ in range(hd // 8)]
            kend = min(S, q0 + BR) if causal else S
            for k0 in range(0, kend, BR):
                Ks, Vs = load_tile(X, k, k0, S, hd), load_tile(X, v, k0, S, hd)
                for ks0 in (h * sub for h in subs):
                    s = [np.zeros((32, 4)) for _ in range(sub // 8)]
                    dp = [np.zeros((32, 4)) for _ in range(sub // 8)]
                    for ks in range(hd // X.KS):
                        aq, ao = X.load_a(Qs, wr * 16, ks * X.KS), X.load_a(Os, wr * 16, ks * X.KS)
                        for n in range(sub // 8):
                            s[n] = X.mma(s[n], aq, X.load_bt(Ks, ks0 + n * 8, ks * X.KS))
                            dp[n] = X.mma(dp[n], ao, X.load_bt(Vs, ks0 + n * 8, ks * X.KS))
                    for n in range(sub // 8):
                        for e in range(4):
                            key = k0 + ks0 + n * 8 + 2 * T + (e & 1)
                            rr = r0 if e < 2 else r1
                            row = q0 + rr
                            p = np.exp2(f32(s[n][:, e]) * c - Ls[rr])
                            p = np.where((row >= L) | (key >= S) | (causal & (key > row)), 0, p)
                            dp[n][:, e] = p * (f32(dp[n][:, e]) - Ds[rr])
                    dqa = acc_pv(X, dqa, dp, Ks, ks0, sub // X.KS)  # dQ += dS K
            dqp.append(dqa)
        for w, dqa in enumerate(_reduce_halves(dqp) if bw == 8 else dqp):
            r0, r1 = w * 16 + G, w * 16 + G + 8
            for d in range(hd // 8):
                for rr, cols in ((r0, (0, 1)), (r1, (2, 3))):
                    ok = q0 + rr < L
                    for j, col in enumerate(cols):
                        dq[q0 + rr[ok], d * 8 + 2 * T[ok] + j] = X.cast(dqa[d][ok, col] * scale)
    return dq, dk, dv


def main() -> int:
    rng = np.random.default_rng(0)
    bad = 0
    for name, X, tol_f, tol_b in (
        ("tf32", Tf32, 4e-3, 1e-2),
        ("tf32x3", Tf32x3, TOL_X3["fwd"], TOL_X3["bwd"]),
        ("bf16", Bf16, 2e-2, 4e-2),
    ):
        for L, S, causal in ((77, 77, False), (77, 77, True), (100, 130, False), (130, 100, True)):
            hd = 64
            q, k, v, do = (X.cast(rng.standard_normal((n, hd))) for n in (L, S, S, L))
            scale = 1 / math.sqrt(hd)
            o, lse = forward(X, q, k, v, L, S, hd, scale, causal)
            eo, else_ = ref.sdpa(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal)
            D = (f32(do) * f32(o)).sum(-1).astype(np.float32)
            dq, dk, dv = backward(X, q, k, v, do, lse, D, L, S, hd, scale, causal)
            e = ref.sdpa_backward(*(a.astype(np.float64) for a in (q, k, v, do)), causal)
            errs = dict(
                o=ref.rel_err(o, eo),
                lse=ref.rel_err(lse, else_),
                dq=ref.rel_err(dq, e[0]),
                dk=ref.rel_err(dk, e[1]),
                dv=ref.rel_err(dv, e[2]),
            )
            if X is not Bf16:  # the fused backward (fp32 storage)
                fq, fk, fv = backward(X, q, k, v, do, lse, D, L, S, hd, scale, causal, fused=True)
                errs.update(fused_dq=ref.rel_err(fq, e[0]), fused_dk=ref.rel_err(fk, e[1]),
                            fused_dv=ref.rel_err(fv, e[2]))
            bwd = max(v_ for k_, v_ in errs.items() if "d" in k_)
            ok = errs["o"] <= tol_f and errs["lse"] <= tol_f and bwd <= tol_b
            bad += not ok
            print(
                f"{'PASS' if ok else 'FAIL'} {name} L={L} S={S} causal={causal}: "
                + " ".join(f"{k_}={v_:.2e}" for k_, v_ in errs.items()),
                flush=True,
            )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
