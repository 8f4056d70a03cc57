"""NumPy emulation of kernels/sdpa.cu (fp32 SIMT flash attention), vectorised over the rows of a block:
the same dim ownership (float4 chunk c of thread g holds dims 4*(g + G*c) .. +3), the same group sums, tiles
of BC = 32 rows, causal tile bounds, online softmax in base 2, and the separate dK/dV and dQ kernels.
Checks the kernels' logic against the float64 reference without a GPU.

Usage: python packages/blutensor/dev/emulate_sdpa_simt.py
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_reference as ref  # noqa: E402

BR, BC = 64, 32
LOG2E = np.float32(1.4426950408889634)
LN2 = np.float32(0.6931471805599453)


def owned(hd: int) -> np.ndarray:
    """(G, 32) dims held by each thread g of a row group."""
    G = hd // 32
    return np.array([[4 * (g + G * c) + j for c in range(8) for j in range(4)] for g in range(G)])


def group_dot(rows, srow, dims):
    """sum over threads g of the partial dot products (rows: (R, hd), srow: (hd,)) -> (R,)"""
    parts = np.stack([(rows[:, d] * srow[d]).sum(-1, dtype=np.float32) for d in dims], 0)
    return parts.sum(0, dtype=np.float32)


def forward(q, k, v, L, S, hd, scale, causal):
    dims = owned(hd)
    o = np.zeros((L, hd), np.float32)
    lse = np.zeros(L, np.float32)
    c = np.float32(scale) * LOG2E
    for bx in range(math.ceil(L / BR)):
        qi = bx * BR + np.arange(BR)
        valid = qi < L
        qr = np.zeros((BR, hd), np.float32)
        qr[valid] = q[qi[valid]] * c
        acc = np.zeros((BR, hd), np.float32)
        m = np.full(BR, -np.inf, np.float32)
        lsum = np.zeros(BR, np.float32)
        kend = min(S, (bx + 1) * BR) if causal else S
        for k0 in range(0, kend, BC):
            s = np.full((BR, BC), -np.inf, np.float32)
            for j in range(BC):
                kj = k0 + j
                krow = k[kj] if kj < S else np.zeros(hd, np.float32)
                x = group_dot(qr, krow, dims)
                mask = (kj >= S) | (causal & (kj > qi))
                s[:, j] = np.where(mask, -np.inf, x)
            mn = np.maximum(m, s.max(1))
            upd = mn != -np.inf
            alpha = np.where(upd, np.exp2(m - np.where(upd, mn, 0)), 1).astype(np.float32)
            lsum = np.where(upd, lsum * alpha, lsum)
            acc = np.where(upd[:, None], acc * alpha[:, None], acc)
            for j in range(BC):
                kj = k0 + j
                p = np.where(upd, np.exp2(s[:, j] - np.where(upd, mn, 0)), 0).astype(np.float32)
                lsum = lsum + p
                vrow = v[kj] if kj < S else np.zeros(hd, np.float32)
                acc = acc + p[:, None] * vrow[None, :]
            m = np.where(upd, mn, m)
        inv = np.where(lsum > 0, 1 / np.where(lsum > 0, lsum, 1), 0).astype(np.float32)
        o[qi[valid]] = (acc * inv[:, None])[valid]
        lse[qi[valid]] = ((m + np.log2(np.where(lsum > 0, lsum, 1))) * LN2)[valid]
    return o, lse


def backward(q, k, v, do, lse, D, L, S, hd, scale, causal):
    dims = owned(hd)
    c = np.float32(scale) * LOG2E
    dq, dk, dv = np.zeros((L, hd), np.float32), np.zeros((S, hd), np.float32), np.zeros((S, hd), np.float32)
    for bx in range(math.ceil(S / BR)):  # dK/dV: thread group per key
        kj = bx * BR + np.arange(BR)
        kv = kj < S
        kr = np.zeros((BR, hd), np.float32)
        vr = np.zeros((BR, hd), np.float32)
        kr[kv], vr[kv] = k[kj[kv]] * c, v[kj[kv]]
        dkr = np.zeros((BR, hd), np.float32)
        dvr = np.zeros((BR, hd), np.float32)
        q0 = (bx * BR // BC) * BC if causal else 0
        for qt in range(q0, L, BC):
            for i in range(BC):
                qi = qt + i
                qrow = q[qi] if qi < L else np.zeros(hd, np.float32)
                orow = do[qi] if qi < L else np.zeros(hd, np.float32)
                li = lse[qi] * LOG2E if qi < L else np.float32(0)
                di = D[qi] if qi < L else np.float32(0)
                s = group_dot(kr, qrow, dims)
                p = np.exp2(s - li).astype(np.float32)
                p = np.where((qi >= L) | ~kv | (causal & (kj > qi)), 0, p)
                dvr += p[:, None] * orow[None, :]
                dp = group_dot(vr, orow, dims)
                ds = p * (dp - di)
                dkr += ds[:, None] * qrow[None, :]
        dk[kj[kv]] = (dkr * np.float32(scale))[kv]
        dv[kj[kv]] = dvr[kv]
    for bx in range(math.ceil(L / BR)):  # dQ: thread group per query
        qi = bx * BR + np.arange(BR)
        qv = qi < L
        qr = np.zeros((BR, hd), np.float32)
        dor = np.zeros((BR, hd), np.float32)
        qr[qv], dor[qv] = q[qi[qv]] * c, do[qi[qv]]
        li = np.where(qv, lse[np.minimum(qi, L - 1)] * LOG2E, 0).astype(np.float32)
        di = np.where(qv, D[np.minimum(qi, L - 1)], 0).astype(np.float32)
        dqr = np.zeros((BR, hd), np.float32)
        kend = min(S, (bx + 1) * BR) if causal else S
        for k0 in range(0, kend, BC):
            for j in range(BC):
                kj = k0 + j
                krow = k[kj] if kj < S else np.zeros(hd, np.float32)
                vrow = v[kj] if kj < S else np.zeros(hd, np.float32)
                s = group_dot(qr, krow, dims)
                p = np.exp2(s - li).astype(np.float32)
                p = np.where(~qv | (kj >= S) | (causal & (kj > qi)), 0, p)
                dp = group_dot(dor, vrow, dims)
                dqr += (p * (dp - di))[:, None] * krow[None, :]
        dq[qi[qv]] = (dqr * np.float32(scale))[qv]
    return dq, dk, dv


def main() -> int:
    rng = np.random.default_rng(1)
    bad = 0
    for hd in (32, 64, 128):
        for L, S, causal in ((77, 77, False), (77, 77, True), (100, 130, False), (130, 100, True)):
            q, k, v, do = (rng.standard_normal((n, hd)).astype(np.float32) for n in (L, S, S, L))
            sc = 1 / math.sqrt(hd)
            o, lse = forward(q, k, v, L, S, hd, sc, causal)
            eo, else_ = ref.sdpa(*(a.astype(np.float64) for a in (q, k, v)), causal)
            D = (do * o).sum(-1, dtype=np.float32)
            g = backward(q, k, v, do, lse, D, L, S, hd, sc, causal)
            e = ref.sdpa_backward(*(a.astype(np.float64) for a in (q, k, v, do)), causal)
            errs = [ref.rel_err(o, eo), ref.rel_err(lse, else_)] + [ref.rel_err(a, b) for a, b in zip(g, e)]
            ok = max(errs[:2]) <= ref.TOL["sdpa.fwd"]["f32"] and max(errs[2:]) <= ref.TOL["sdpa.bwd"]["f32"]
            bad += not ok
            print(
                f"{'PASS' if ok else 'FAIL'} hd={hd} L={L} S={S} causal={causal}: "
                + " ".join(f"{x:.1e}" for x in errs),
                flush=True,
            )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
