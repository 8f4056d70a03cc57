"""NumPy model of kernels/sdpa_wgmma.cu's index math (no GPU): TMA boxes written with the 128-byte swizzle
(16-byte chunk index XOR address bits 7-9), the shared-memory descriptors of every k-step (kmajor / mnmajor in
the kernel: start address, LBO, SBO), the way wgmma walks a descriptor (K-major ``((8,m),(8,2k))`` rows of
128 B with 8-row groups SBO apart; MN-major 64-element atoms LBO apart, 8-row k groups SBO apart; then the
swizzle on the absolute address), the m64nN accumulator layout and the register A fragments built from it.

:func:`forward_tile` and :func:`backward_tile` rebuild one consumer warpgroup's products exactly as the kernel
issues them and return what the tensor cores would compute; tests/test_sdpa_wgmma.py compares them with plain
float64 matrix products. The fused backward's dQ path: :func:`dst_addr` (the kernel's closed-form swizzled
address of each packed dS^T pair, wg::store_dst), :func:`dq_descs` (the transposed-A and MN-major-B descriptors
of wg::dq_chunk), :func:`red_dq` (the fp32 accumulator addresses of wg::red_dq, head dim 128) or, at head dim 64,
:func:`stage_off` (wg::stage_dq's tile-fragment order, each staged tile added whole by :func:`bulk_dq`) and
:func:`frag_rows` (wg::dq_convert reading that order back into rows); :func:`fused_tile` runs one warpgroup's tile
through them and :func:`fused_dq` walks the kernel's work tiles (decode, causal skips, the dS^T buffer parity)
into a dQ accumulator. Usage: python packages/blutensor/dev/emulate_sdpa_wgmma.py
"""

from __future__ import annotations

import numpy as np

BOX = 64  # head-dim elements of a box (128 bytes of bf16)


def hw_swizzle(addr: int) -> int:
    """The address the hardware touches for ``addr`` under the 128-byte swizzle (1024-byte aligned atoms)."""
    return addr ^ (((addr >> 7) & 7) << 4)


def tma_tile(smem: dict, base: int, x: np.ndarray, row0: int, rows_box: int) -> None:
    """The producer's boxes of rows row0 .. row0 + rows_box - 1 of ``x`` (n, HD): box b (head-dim columns
    64 b ..) at base + b * rows_box * 128, row r at + r * 128, swizzled; rows past n zero-filled."""
    n, hd = x.shape
    for b in range(hd // BOX):
        for r in range(rows_box):
            for i in range(BOX):
                v = x[row0 + r, b * BOX + i] if row0 + r < n else 0.0
                smem[hw_swizzle(base + b * rows_box * 128 + r * 128 + i * 2)] = v


def kmajor(base: int, rows_box: int, row0: int, j: int) -> tuple[int, int, int]:
    """(start, LBO, SBO) of k-step j of a K-major operand (the kernel's wg::kmajor)."""
    return base + (j >> 2) * rows_box * 128 + row0 * 128 + (j & 3) * 32, 16, 1024


def mnmajor(base: int, rows_box: int, kk: int) -> tuple[int, int, int]:
    """(start, LBO, SBO) of k-step kk of an MN-major B operand (the kernel's wg::mnmajor)."""
    return base + kk * 2048, rows_box * 128, 1024


def read_operand(smem: dict, desc: tuple[int, int, int], trans: int, mn: int) -> np.ndarray:
    """The (mn x 16) bf16 operand wgmma reads through a descriptor; trans 0: K-major, 1: MN-major."""
    start, lbo, sbo = desc
    out = np.full((mn, 16), np.nan)
    for i in range(mn):
        for k in range(16):
            if trans == 0:
                off = (i % 8) * 128 + (i // 8) * sbo + (k // 8) * 16 + (k % 8) * 2
            else:
                off = (i % 64) * 2 + (i // 64) * lbo + (k % 8) * 128 + (k // 8) * sbo
            out[i, k] = smem.get(hw_swizzle(start + off), np.nan)
    return out


def acc_pos(i: int, w: int, lane: int) -> tuple[int, int]:
    """(row, column) of accumulator element i of warp w, lane ``lane`` (m64nN layout)."""
    g, t = lane >> 2, lane & 3
    return 16 * w + g + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * t + (i & 1)


def to_regs(m: np.ndarray) -> np.ndarray:
    """A 64 x N matrix as the per-thread accumulator arrays (128 threads x N/2)."""
    n = m.shape[1]
    regs = np.zeros((128, n // 2))
    for th in range(128):
        for i in range(n // 2):
            regs[th, i] = m[acc_pos(i, th >> 5, th & 31)]
    return regs


def from_regs(regs: np.ndarray) -> np.ndarray:
    n = regs.shape[1] * 2
    m = np.full((64, n), np.nan)
    for th in range(128):
        for i in range(n // 2):
            m[acc_pos(i, th >> 5, th & 31)] = regs[th, i]
    return m


def a_fragment(regs: np.ndarray, kk: int) -> np.ndarray:
    """The 64 x 16 A operand an RS wgmma reads at k-step kk from packed registers p[4 kk .. 4 kk + 3], packed as
    the kernel's pack_p (p[i] = (s[2 i], s[2 i + 1])): a0 row g k 2t, a1 row g+8, a2 row g k 2t+8, a3 row g+8."""
    a = np.full((64, 16), np.nan)
    for th in range(128):
        w, g, t = th >> 5, (th & 31) >> 2, th & 3
        for r in range(4):
            lo, hi = regs[th, 2 * (4 * kk + r)], regs[th, 2 * (4 * kk + r) + 1]
            row = 16 * w + g + 8 * (r & 1)
            col = 2 * t + 8 * (r >> 1)
            a[row, col], a[row, col + 1] = lo, hi
    return a


def ss(smem, a_base, a_rows_box, a_row0, b_base, b_rows_box, n, hd) -> np.ndarray:
    """The kernel's ss_product: (64 x n) = A B^T over hd / 16 k-steps."""
    acc = np.zeros((64, n))
    for j in range(hd // 16):
        a = read_operand(smem, kmajor(a_base, a_rows_box, a_row0, j), 0, 64)
        b = read_operand(smem, kmajor(b_base, b_rows_box, 0, j), 0, n)
        acc += a @ b.T
    return acc


def rs(smem, p_regs, b_base, b_rows_box, k, hd) -> np.ndarray:
    """The kernel's rs_product: (64 x hd) = P B, P from registers, B k rows x hd MN-major."""
    acc = np.zeros((64, hd))
    for kk in range(k // 16):
        a = a_fragment(p_regs, kk)
        b = read_operand(smem, mnmajor(b_base, b_rows_box, kk), 1, hd)  # (hd x 16): B^T
        acc += a @ b.T
    return acc


def forward_tile(q, k, v, cw: int, hd: int):
    """One forward iteration of consumer warpgroup ``cw`` on a 128-query block and a 128-key tile: (S, P V)
    as the tensor cores compute them (P = the given S's values, passed through the register layout)."""
    smem: dict = {}
    tile = 128 * hd * 2
    sQ, sK = 0, tile
    sV = sK + tile
    tma_tile(smem, sQ, q, 0, 128)
    tma_tile(smem, sK, k, 0, 128)
    tma_tile(smem, sV, v, 0, 128)
    s = ss(smem, sQ, 128, cw * 64, sK, 128, 128, hd)
    pv = rs(smem, to_regs(s), sV, 128, 128, hd)
    return s, pv


def backward_tile(own_a, own_b, x, y, cw: int, hd: int):
    """One backward iteration of consumer warpgroup ``cw``: own A/B (128 rows: K, V or Q, dO), streamed X/Y
    (64 rows: Q, dO or K, V): (A X^T, B Y^T, (A X^T) Y, (B Y^T) X) through the kernel's descriptors."""
    smem: dict = {}
    own, tl = 128 * hd * 2, 64 * hd * 2
    sA, sB, sX = 0, own, 2 * own
    sY = sX + tl
    tma_tile(smem, sA, own_a, 0, 128)
    tma_tile(smem, sB, own_b, 0, 128)
    tma_tile(smem, sX, x, 0, 64)
    tma_tile(smem, sY, y, 0, 64)
    s = ss(smem, sA, 128, cw * 64, sX, 64, 64, hd)
    dp = ss(smem, sB, 128, cw * 64, sY, 64, 64, hd)
    return s, dp, rs(smem, to_regs(s), sY, 64, 64, hd), rs(smem, to_regs(dp), sX, 64, 64, hd)


LOG2E = 1.4426950408889634
DST = 64 * 64 * 2  # bytes of one dS^T tile (Bwd::DST)


def bf16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to bf16 (round to nearest even), as float64: cvt.rn.bf16x2.f32 of the kernel's pack."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def dst_addr(dst: int, j: int, w: int, g: int, t: int) -> int:
    """Byte address wg::store_dst writes packed pair j of thread (w, g, t) to (already swizzled: the kernel's
    closed form, which must equal the hardware swizzle of row r, column 8 (j >> 1) + 2 t)."""
    r = 16 * w + g + 8 * (j & 1)
    return dst + r * 128 + (((j >> 1) ^ g) << 4) + 4 * t


def store_dst(smem: dict, dst: int, ds_regs: np.ndarray) -> None:
    """The dS^T tile (per-thread accumulator values, 128 x 32) stored as bf16 pairs: the low half (element 2 j)
    at the pair's address, the high half (2 j + 1) two bytes above (little-endian bf16x2)."""
    for th in range(128):
        w, g, t = th >> 5, (th & 31) >> 2, th & 3
        for j in range(16):
            a = dst_addr(dst, j, w, g, t)
            smem[a], smem[a + 2] = ds_regs[th, 2 * j], ds_regs[th, 2 * j + 1]


def dq_descs(dst: int, k_own: int, c: int, kk: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(A, B) descriptors of k-step kk of wg::dq_chunk: A = dS read transposed (MN-major) from the dS^T tile, B =
    the warpgroup's 64 own keys of K, head-dim box c, MN-major."""
    return mnmajor(dst, 64, kk), mnmajor(k_own + c * 128 * 128, 128, kk)


def dq_chunk(smem: dict, dst: int, k_own: int, c: int) -> np.ndarray:
    """(64 queries x 64) = dS K[:, 64 c ..] as the SS wgmma with TA = TB = 1 computes it."""
    acc = np.zeros((64, 64))
    for kk in range(4):
        da, db = dq_descs(dst, k_own, c, kk)
        a = read_operand(smem, da, 1, 64)  # (64 queries x 16 keys)
        b = read_operand(smem, db, 1, 64)  # (64 head-dim columns x 16 keys): B^T
        acc += a @ b.T
    return acc


def red_dq(acc: np.ndarray, regs: np.ndarray, c: int, x0: int, L: int, hd: int) -> None:
    """wg::red_dq: add chunk c's per-thread partial (128 x 32) into the flat fp32 accumulator rows of one head
    (``acc``: L * hd values, row q at q * hd), two floats a red, rows >= L skipped."""
    for th in range(128):
        w, g, t = th >> 5, (th & 31) >> 2, th & 3
        q0 = x0 + 16 * w + g
        q1 = q0 + 8
        for i in range(0, 32, 4):
            col = 64 * c + 8 * (i >> 2) + 2 * t
            if q0 < L:
                acc[q0 * hd + col : q0 * hd + col + 2] += regs[th, i : i + 2]
            if q1 < L:
                acc[q1 * hd + col : q1 * hd + col + 2] += regs[th, i + 2 : i + 4]


BULK_HDS = (64,)  # head dims whose dQ partials are staged and bulk-reduced (the kernel's bulk_dq)
DQ_TILE = 64 * 64  # fp32 elements of one staged partial


def stage_off(i4: int, th: int) -> int:
    """Float offset in the staging tile of registers 4 i4 .. 4 i4 + 3 of warpgroup thread ``th`` (wg::stage_dq)."""
    return (i4 * 128 + th) * 4


def bulk_dq(acc: np.ndarray, regs: np.ndarray, x0: int) -> None:
    """Stage one warpgroup's 64 x 64 partial (regs (128, 32)) through :func:`stage_off` and add the whole tile into
    the tile-fragment accumulator ``acc`` (flat (ceil(L / 64), 64 * 64)) at query tile x0 / 64, as the bulk
    reduction does."""
    tile = np.zeros(DQ_TILE)
    for th in range(128):
        for i4 in range(8):
            o = stage_off(i4, th)
            tile[o : o + 4] = regs[th, 4 * i4 : 4 * i4 + 4]
    acc[(x0 // 64) * DQ_TILE : (x0 // 64 + 1) * DQ_TILE] += tile


def frag_index(L: int) -> np.ndarray:
    """(L, 64) offsets into a flat tile-fragment accumulator of every (query, column), as wg::dq_convert reads them:
    columns 8 i4 + 2 t, + 1 of query row r of a tile at (i4 * 128 + 32 (r / 16) + 4 (r % 8) + t) * 4
    + 2 ((r / 8) % 2), + 1."""
    idx = np.zeros((L, 64), dtype=np.int64)
    for q in range(L):
        r = q % 64
        for i4 in range(8):
            e0 = (i4 * 128 + 32 * (r // 16) + 4 * (r % 8)) * 4 + 2 * ((r // 8) % 2)
            for t in range(4):
                idx[q, 8 * i4 + 2 * t : 8 * i4 + 2 * t + 2] = (q // 64) * DQ_TILE + e0 + 4 * t + np.arange(2)
    return idx


def frag_rows(acc: np.ndarray, L: int) -> np.ndarray:
    """(L, 64) rows of a flat tile-fragment accumulator (wg::dq_convert's reads, :func:`frag_index`)."""
    return acc[frag_index(L)]


def fused_tile(q, k, v, do, lse, D, own0: int, x0: int, cw: int, causal: bool, scale: float, acc: np.ndarray,
               nds: int = 0) -> np.ndarray:
    """One fused-backward tile of consumer warpgroup ``cw`` (own keys own0 .., queries x0 .. x0 + 63) of one head:
    S^T, dP^T through the kernel's descriptors, P^T and dS^T with its masks (queries >= L, keys >= S, causal),
    dS^T packed to bf16 and stored through :func:`dst_addr` into buffer ``nds & 1``, the dQ chunks through
    :func:`dq_descs`, added by :func:`red_dq` into ``acc`` (flat L * hd), or at head dim 64 by :func:`bulk_dq` into
    a tile-fragment ``acc``. Returns the bf16 dS^T (64 keys x 64 queries) it stored, for a float64 check of the
    product."""
    L, hd = q.shape
    S = k.shape[0]
    smem: dict = {}
    own, tl = 128 * hd * 2, 64 * hd * 2
    sA, sB, sX = 0, own, 2 * own
    sY = sX + tl
    tma_tile(smem, sA, k, own0, 128)
    tma_tile(smem, sB, v, own0, 128)
    tma_tile(smem, sX, q, x0, 64)
    tma_tile(smem, sY, do, x0, 64)
    sv = to_regs(ss(smem, sA, 128, cw * 64, sX, 64, 64, hd))
    dp = to_regs(ss(smem, sB, 128, cw * 64, sY, 64, 64, hd))
    c = scale * LOG2E
    ds = np.zeros((128, 32))
    for th in range(128):
        w, lane = th >> 5, th & 31
        for i in range(32):
            r, col = acc_pos(i, w, lane)
            key, qq = own0 + cw * 64 + r, x0 + col
            lc = lse[qq] * LOG2E if qq < L else 0.0
            dc = D[qq] if qq < L else 0.0
            pv = 2.0 ** (sv[th, i] * c - lc)
            if qq >= L or key >= S or (causal and key > qq):
                pv = 0.0
            ds[th, i] = pv * (dp[th, i] - dc)
    ds = bf16(ds)
    dst = sY + tl + (2 * cw + (nds & 1)) * DST  # sDS: after the stages, 1024-aligned
    assert dst % 1024 == 0
    store_dst(smem, dst, ds)
    if hd in BULK_HDS:
        bulk_dq(acc, to_regs(dq_chunk(smem, dst, sA + cw * 64 * 128, 0)), x0)
        return from_regs(ds)
    for cc in range(hd // BOX):
        red_dq(acc, to_regs(dq_chunk(smem, dst, sA + cw * 64 * 128, cc)), cc, x0, L, hd)
    return from_regs(ds)


def fused_dq(q, k, v, do, lse, D, causal: bool, scale: float) -> tuple[np.ndarray, list]:
    """dQ / scale of one head as the fused kernel accumulates it: its work tiles (128-key blocks; causal: query
    tiles from the block's first key), each consumer warpgroup skipping the tiles its keys cannot see, the dS^T
    buffer alternating per stored tile. Returns (accumulator (L, hd), [(own0, x0, cw, bf16 dS^T), ...])."""
    L, hd = q.shape
    S = k.shape[0]
    acc = np.zeros(-(-L // 64) * DQ_TILE if hd in BULK_HDS else L * hd)
    tiles = []
    nds = [0, 0]
    for own0 in range(0, S, 128):
        first = own0 if causal else 0
        for x0 in range(first, L, 64):
            for cw in (0, 1):
                if causal and x0 + 63 < own0 + cw * 64:
                    continue
                dst = fused_tile(q, k, v, do, lse, D, own0, x0, cw, causal, scale, acc, nds[cw])
                nds[cw] += 1
                tiles.append((own0, x0, cw, dst))
    return (frag_rows(acc, L) if hd in BULK_HDS else acc.reshape(L, hd)), tiles


def check(hd: int, seed: int = 0) -> float:
    """Largest error of the modelled products against NumPy float64, forward and backward, both warpgroups."""
    rng = np.random.default_rng(seed)
    err = 0.0
    q, k, v = (rng.standard_normal((n, hd)) for n in (100, 128, 128))  # 100 rows: the zero-filled tail too
    for cw in (0, 1):
        s, pv = forward_tile(q, k, v, cw, hd)
        qq = np.vstack([q, np.zeros((28, hd))])[cw * 64 : cw * 64 + 64]
        err = max(err, np.abs(s - qq @ k.T).max(), np.abs(pv - s @ v).max())
    a, b = rng.standard_normal((128, hd)), rng.standard_normal((128, hd))
    x, y = rng.standard_normal((64, hd)), rng.standard_normal((64, hd))
    for cw in (0, 1):
        s, dp, sy, dpx = backward_tile(a, b, x, y, cw, hd)
        ar, br = a[cw * 64 : cw * 64 + 64], b[cw * 64 : cw * 64 + 64]
        err = max(err, np.abs(s - ar @ x.T).max(), np.abs(dp - br @ y.T).max())
        err = max(err, np.abs(sy - s @ y).max(), np.abs(dpx - dp @ x).max())
    return float(err)


def check_fused(hd: int, L: int = 100, S: int = 150, causal: bool = True, seed: int = 0) -> float:
    """Largest error of the fused backward's modelled dQ accumulator against the float64 products of the same
    bf16 dS^T tiles and K (one head, the kernel's walk of work tiles)."""
    rng = np.random.default_rng(seed)
    q, k, v, do = (bf16(rng.standard_normal((n, hd))) for n in (L, S, S, L))
    s = q @ k.T / np.sqrt(hd)
    if causal:
        s = np.where(np.triu(np.ones((L, S), bool), 1), -np.inf, s)
    lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    D = (do * (np.exp(s - lse[:, None]) @ v)).sum(-1)
    acc, tiles = fused_dq(q, k, v, do, lse, D, causal, 1 / np.sqrt(hd))
    kp = np.vstack([k, np.zeros((256, hd))])
    want = np.zeros((L + 64, hd))
    for own0, x0, cw, dst in tiles:
        want[x0 : x0 + 64] += dst.T @ kp[own0 + cw * 64 : own0 + cw * 64 + 64]
    return float(np.abs(acc - want[:L]).max())


if __name__ == "__main__":
    for hd in (64, 128):
        print(f"HD {hd}: max error of the modelled wgmma products {check(hd):.2e}, "
              f"of the fused backward's dQ accumulator {check_fused(hd):.2e}")
