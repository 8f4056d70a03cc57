"""NumPy model of kernels/sdpa_wgmma_tf32.cu's index math (no GPU): fp32 TMA boxes of 32 columns written with the
128-byte swizzle (16-byte chunk index XOR address bits 7-9), the K-major descriptors of every k8 step (wgt::kmajor:
32 bytes a step inside a 128-byte row, boxes rows_box x 128 B apart, 8-row groups SBO = 1024 apart), the way wgmma
walks a K-major descriptor, the m64nN accumulator layout, the tf32 register A fragment (rows g, g + 8, k columns
t, t + 4 of each warp's 16 rows) and the kernel's way of getting there without shuffles: the keys permuted inside
every group of 8 (position p holds key 2p, p < 4, or 2 (p - 4) + 1), in the registers (wgt::pack_p) and in the
transposed scratches (wgt::transpose_rows, kernel blu_sdpa_wgmma_tf32_hd*_transpose: V^T of the forward, Q^T,
dO^T and K^T of the backward).

:func:`forward_tile` rebuilds one consumer warpgroup's products on one key tile exactly as the kernel issues them
and returns what the tensor cores would compute (S = Q K^T and P V); tests/test_sdpa_wgmma_tf32.py compares them
with float64 matrix products and checks that a wrong address or permutation fails; :func:`backward_tile` does the
same for one backward tile (S^T / dP^T or S / dP by SS, then the RS products with the transposed streamed tiles).
:func:`forward` walks the kernel's key tiles with the online softmax (masking, causal bounds, lse) in float64.
:func:`simulate_forward` / :func:`simulate_backward` run the kernels' producer and consumer loops over their
mbarriers (phases, parities, Q / own buffers, stages, causal skips, late releases) under random interleavings,
failing on a deadlock or on a stage rewritten while a consumer still reads it.
Usage: python packages/blutensor/dev/emulate_sdpa_wgmma_tf32.py
"""

from __future__ import annotations

import numpy as np

BOX = 32  # fp32 elements of a box row (128 bytes)
FWD_TILES = {64: (128, 2, 2), 128: (64, 1, 2)}  # (keys a tile, Q buffers, stages): WGMMA_TF32_ENTRIES


def hw_swizzle(addr: int) -> int:
    """The address the hardware touches for ``addr`` under the 128-byte swizzle (1024-byte aligned atoms)."""
    return addr ^ (((addr >> 7) & 7) << 4)


def tf32_rna(x) -> np.ndarray:
    """``x`` rounded to tf32 (10 mantissa bits, to nearest, ties away from zero) as float64: cvt.rna.tf32.f32."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x1000) & 0xFFFFE000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def tf32_trunc(x) -> np.ndarray:
    """``x`` as the tensor cores read an fp32 bit pattern as tf32: the low 13 mantissa bits ignored."""
    u = np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)
    return u.view(np.float32).astype(np.float64)


def perm8(p: int) -> int:
    """Key of permuted position ``p`` (0..7) inside a group of 8 (wgt::perm8): 0 2 4 6 1 3 5 7."""
    return 2 * (p & 3) + 1 if p & 4 else 2 * p


def tma_rows(smem: dict, base: int, x: np.ndarray, row0: int, rows_box: int) -> None:
    """The producer's boxes of rows row0 .. row0 + rows_box - 1 of ``x`` (n, HD) fp32: box b (head-dim columns
    32 b ..) at base + b * rows_box * 128, row r at + r * 128, element i at + 4 i, swizzled; rows past n zero."""
    n, hd = x.shape
    for b in range(hd // BOX):
        for r in range(rows_box):
            for i in range(BOX):
                v = x[row0 + r, b * BOX + i] if row0 + r < n else 0.0
                smem[hw_swizzle(base + b * rows_box * 128 + r * 128 + i * 4)] = v


def vt_prep(v: np.ndarray, round_tf32: bool = True) -> np.ndarray:
    """The transposed scratch of one head (wgt::transpose_rows): (HD, Sp), position p holding row
    8 (p >> 3) + perm8(p & 7),
    rounded to tf32, zero for keys >= S (Sp = S rounded up to 8)."""
    S, hd = v.shape
    sp = -(-S // 8) * 8
    vt = np.zeros((hd, sp))
    vv = tf32_rna(v) if round_tf32 else np.asarray(v, np.float64)
    for p in range(sp):
        key = 8 * (p >> 3) + perm8(p & 7)
        if key < S:
            vt[:, p] = vv[key]
    return vt


def tma_vt(smem: dict, base: int, vt: np.ndarray, k0: int, bn: int) -> None:
    """The producer's V^T boxes of key positions k0 .. k0 + bn - 1: box c (32 positions) at base + c * HD * 128,
    head-dim row d at + d * 128, position i at + 4 i, swizzled; positions past Sp zero (TMA's fill)."""
    hd, sp = vt.shape
    for c in range(bn // BOX):
        for d in range(hd):
            for i in range(BOX):
                p = k0 + c * BOX + i
                smem[hw_swizzle(base + c * hd * 128 + d * 128 + i * 4)] = vt[d, p] if p < sp else 0.0


def kmajor(base: int, rows_box: int, row0: int, j: int) -> tuple[int, int, int]:
    """(start, LBO, SBO) of k-step j (8 elements) of a K-major operand (the kernel's wgt::kmajor)."""
    return base + (j >> 2) * rows_box * 128 + row0 * 128 + (j & 3) * 32, 16, 1024


def read_kmajor(smem: dict, desc: tuple[int, int, int], mn: int) -> np.ndarray:
    """The (mn x 8) tf32 operand wgmma reads through a K-major 128-byte-swizzle descriptor: row i at
    (i % 8) * 128 + (i // 8) * SBO, element k at + 4 k, then the swizzle on the absolute address."""
    start, _lbo, sbo = desc
    out = np.full((mn, 8), np.nan)
    for i in range(mn):
        for k in range(8):
            out[i, k] = smem.get(hw_swizzle(start + (i % 8) * 128 + (i // 8) * sbo + k * 4), np.nan)
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


def pack_p(s_regs: np.ndarray, round_tf32: bool = True) -> np.ndarray:
    """wgt::pack_p: k-step kk's A registers 4 kk .. 4 kk + 3 = s[4 kk], s[4 kk + 2], s[4 kk + 1], s[4 kk + 3]."""
    p = np.zeros_like(s_regs)
    for kk in range(s_regs.shape[1] // 4):
        for r, src in enumerate((0, 2, 1, 3)):
            p[:, 4 * kk + r] = s_regs[:, 4 * kk + src]
    return tf32_rna(p) if round_tf32 else p


def a_fragment(p_regs: np.ndarray, kk: int) -> np.ndarray:
    """The 64 x 8 A operand an RS wgmma .tf32 reads at k-step kk from registers p[4 kk .. 4 kk + 3]: a0 row g k t,
    a1 row g + 8 k t, a2 row g k t + 4, a3 row g + 8 k t + 4 (warp w's rows 16 w ..)."""
    a = np.full((64, 8), np.nan)
    for th in range(128):
        w, g, t = th >> 5, (th & 31) >> 2, th & 3
        for r in range(4):
            a[16 * w + g + 8 * (r & 1), t + 4 * (r >> 1)] = p_regs[th, 4 * kk + r]
    return a


def ss(smem, a_base, a_rows_box, a_row0, b_base, b_rows_box, n, hd) -> np.ndarray:
    """The kernel's ss_product: (64 x n) = A B^T over hd / 8 k-steps (both K-major)."""
    acc = np.zeros((64, n))
    for j in range(hd // 8):
        a = read_kmajor(smem, kmajor(a_base, a_rows_box, a_row0, j), 64)
        b = read_kmajor(smem, kmajor(b_base, b_rows_box, 0, j), n)
        acc += a @ b.T
    return acc


def rs(smem, p_regs, vt_base, k, hd) -> np.ndarray:
    """The kernel's rs_product: (64 x hd) += P V, P from registers, B the V^T tile (hd rows x k positions)."""
    acc = np.zeros((64, hd))
    for kk in range(k // 8):
        a = a_fragment(p_regs, kk)
        b = read_kmajor(smem, kmajor(vt_base, hd, 0, kk), hd)  # (hd x 8): B^T
        acc += a @ b.T
    return acc


def forward_tile(q, k, v, cw: int, hd: int, k0: int = 0, round_tf32: bool = True):
    """One forward iteration of consumer warpgroup ``cw`` on a 128-query block and the key tile at ``k0``: (S, P V)
    as the tensor cores compute them, P = the given S's values passed through pack_p and the A fragment, V through
    the V^T scratch and its tensor map. smem offsets as struct Fwd: Q at 0, K at QB * QTILE, V^T at + KTILE."""
    bn, qb, _ = FWD_TILES[hd]
    smem: dict = {}
    qtile, ktile = 128 * hd * 4, bn * hd * 4
    sQ = 0
    sK = qb * qtile
    sV = sK + ktile
    tma_rows(smem, sQ, q, 0, 128)
    tma_rows(smem, sK, k, k0, bn)
    tma_vt(smem, sV, vt_prep(v, round_tf32), k0, bn)
    s = ss(smem, sQ, 128, cw * 64, sK, bn, bn, hd)
    pv = rs(smem, pack_p(to_regs(s), round_tf32), sV, bn, hd)
    return s, pv


STREAM_ROWS = 64  # rows of the backward's streamed tiles


def backward_tile(own_a, own_b, x, y, cw: int, hd: int, round_tf32: bool = True):
    """One backward iteration of consumer warpgroup ``cw`` (struct Bwd's smem: own A at 0, B at OWN, the stage's
    X, Y, XT, YT tiles from 2 OWN, TILE apart): own A/B (128 rows: K, V or Q, dO), streamed X/Y (64 rows: Q, dO
    or K, V) and their transposes: (A X^T, B Y^T, (A X^T) Y through Y^T, (B Y^T) X through X^T)."""
    smem: dict = {}
    own, tl = 128 * hd * 4, STREAM_ROWS * hd * 4
    sA, sB, sX = 0, own, 2 * own
    sY, sXT, sYT = sX + tl, sX + 2 * tl, sX + 3 * tl
    tma_rows(smem, sA, own_a, 0, 128)
    tma_rows(smem, sB, own_b, 0, 128)
    tma_rows(smem, sX, x, 0, STREAM_ROWS)
    tma_rows(smem, sY, y, 0, STREAM_ROWS)
    tma_vt(smem, sXT, vt_prep(x, round_tf32), 0, STREAM_ROWS)
    tma_vt(smem, sYT, vt_prep(y, round_tf32), 0, STREAM_ROWS)
    s = ss(smem, sA, 128, cw * 64, sX, STREAM_ROWS, STREAM_ROWS, hd)
    dp = ss(smem, sB, 128, cw * 64, sY, STREAM_ROWS, STREAM_ROWS, hd)
    ps = rs(smem, pack_p(to_regs(s), round_tf32), sYT, STREAM_ROWS, hd)
    pd = rs(smem, pack_p(to_regs(dp), round_tf32), sXT, STREAM_ROWS, hd)
    return s, dp, ps, pd


def forward(q, k, v, causal: bool, scale: float):
    """(o, lse) of one head as the kernel computes them, tile by tile, in float64: Q and K truncated to tf32 (the
    tensor cores' reading), V and P rounded; online softmax with the kernel's masks and causal tile bounds."""
    L, hd = q.shape
    S = k.shape[0]
    bn = FWD_TILES[hd][0]
    qt, kt = tf32_trunc(q), tf32_trunc(k)
    vt = vt_prep(v)
    o = np.zeros((L, hd))
    lse = np.full(L, -np.inf)
    for q0 in range(0, L, 128):
        rows = np.arange(q0, min(q0 + 128, L))
        nt = -(-(min(S, q0 + 128) if causal else S) // bn)
        m = np.full(len(rows), -np.inf)
        lsum = np.zeros(len(rows))
        acc = np.zeros((len(rows), hd))
        for it in range(nt):
            keys = np.arange(it * bn, it * bn + bn)
            kk = np.where(keys[:, None] < S, kt[np.minimum(keys, S - 1)], 0.0)
            s = qt[rows] @ kk.T * scale
            bad = (keys[None, :] >= S) | (causal & (keys[None, :] > rows[:, None]))
            s = np.where(bad, -np.inf, s)
            mx = np.maximum(m, s.max(1))
            mu = np.where(np.isinf(mx), 0.0, mx)
            al = np.exp(m - mu)
            e = np.exp(s - mu[:, None])
            pos = np.arange(it * bn, it * bn + bn)
            vk = np.zeros((bn, hd))  # V rows back from the scratch's permuted positions
            for p in pos:
                if p < vt.shape[1]:
                    key = 8 * (p >> 3) + perm8(p & 7)
                    vk[key - it * bn] = vt[:, p]
            acc = acc * al[:, None] + tf32_rna(e) @ vk
            lsum = lsum * al + e.sum(1)
            m = mx
        o[rows] = np.where(lsum[:, None] > 0, acc / np.where(lsum > 0, lsum, 1)[:, None], 0.0)
        lse[rows] = np.where(lsum > 0, m + np.log(np.where(lsum > 0, lsum, 1)), -np.inf)
    return o, lse


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    for hd in (64, 128):
        bn = FWD_TILES[hd][0]
        q = rng.integers(-3, 4, (128, hd)).astype(np.float64)
        k = rng.integers(-3, 4, (bn + 5, hd)).astype(np.float64)
        v = rng.integers(-3, 4, (bn + 5, hd)).astype(np.float64)
        for cw in (0, 1):
            s, pv = forward_tile(q, k, v, cw, hd, round_tf32=False)
            ref = q[64 * cw:64 * cw + 64] @ k[:bn].T
            print(hd, cw, "S", np.abs(s - ref).max(), "PV", np.abs(pv - ref @ v[:bn]).max())


# ---------------------------------------------------------------------------------------------- mbarrier protocol
class Barrier:
    """An mbarrier: ``count`` arrivals complete the current phase; wait(parity) passes once the phase of that parity
    has completed (a fresh barrier counts its 'previous' phase, parity 1, as completed)."""

    def __init__(self, count: int) -> None:
        self.count, self.arrived, self.phase = count, 0, 0

    def arrive(self) -> None:
        self.arrived += 1
        assert self.arrived <= self.count
        if self.arrived == self.count:
            self.arrived, self.phase = 0, self.phase + 1

    def ready(self, parity: int) -> bool:
        return (self.phase & 1) != parity


def _run(threads, rng) -> None:
    """Interleave generator threads (each yields a (barrier, parity) it waits for) in a random order until all end;
    AssertionError on a deadlock."""
    waiting = {i: None for i in range(len(threads))}
    while waiting:
        ready = [i for i, w in waiting.items() if w is None or w[0].ready(w[1])]
        assert ready, "deadlock: every thread waits on an mbarrier phase that never completes"
        i = ready[rng.integers(len(ready))]
        try:
            waiting[i] = next(threads[i])
        except StopIteration:
            del waiting[i]


def simulate_forward(L: int, S: int, causal: bool, hd: int, BH: int, ctas: int, seed: int = 0) -> int:
    """The forward's producer / 8 consumer warps of every CTA (wgt::forward's loops, QB Q buffers, ST stages) under
    random interleavings: every stage and Q buffer a consumer reads holds the tile it expects (no overwrite before
    release), and the kernel terminates. Returns the number of K/V tiles consumed."""
    bn, QB, ST = FWD_TILES[hd]
    nmb = -(-L // 128)
    total = nmb * BH
    rng = np.random.default_rng(seed)
    consumed = [0]

    def cta(b):
        qfull, qempty = [Barrier(1) for _ in range(QB)], [Barrier(8) for _ in range(QB)]
        full, empty = [Barrier(1) for _ in range(ST)], [Barrier(8) for _ in range(ST)]
        qbuf, stage = [None] * QB, [None] * ST

        def tiles(wt):
            q0 = (nmb - 1 - wt // BH) * 128
            return q0, -(-(min(S, q0 + 128) if causal else S) // bn)

        def producer():
            kv = n = 0
            for wt in range(b, total, ctas):
                q0, nt = tiles(wt)
                qb = n % QB
                yield qempty[qb], ((n // QB) & 1) ^ 1
                qbuf[qb] = wt
                qfull[qb].arrive()  # expect_tx + the loads' bytes: complete at once in this model
                for it in range(nt):
                    s = kv % ST
                    yield empty[s], ((kv // ST) & 1) ^ 1
                    stage[s] = (wt, it)
                    full[s].arrive()
                    kv += 1
                n += 1

        def consumer():
            kv = n = 0
            for wt in range(b, total, ctas):
                q0, nt = tiles(wt)
                qb = n % QB
                yield qfull[qb], (n // QB) & 1
                assert qbuf[qb] == wt
                s0 = kv % ST
                yield full[s0], (kv // ST) & 1
                assert stage[s0] == (wt, 0)
                for it in range(1, nt):
                    st, pst = (kv + it) % ST, (kv + it - 1) % ST
                    yield full[st], ((kv + it) // ST) & 1
                    assert stage[st] == (wt, it) and stage[pst] == (wt, it - 1) and qbuf[qb] == wt
                    yield None
                    assert stage[pst] == (wt, it - 1)  # P V of the previous tile still reads it
                    empty[pst].arrive()
                    consumed[0] += 1
                pst = (kv + nt - 1) % ST
                assert stage[pst] == (wt, nt - 1) and qbuf[qb] == wt
                empty[pst].arrive()
                consumed[0] += 1
                qempty[qb].arrive()
                kv += nt
                n += 1

        return [producer()] + [consumer() for _ in range(8)]

    threads = [t for b in range(min(ctas, total)) for t in cta(b)]
    _run(threads, rng)
    return consumed[0]


def simulate_backward(L: int, S: int, causal: bool, dkdv: bool, BH: int, ctas: int, ST: int, seed: int = 0) -> int:
    """The backward's producer / 8 consumer warps (wgt::backward's loops: one own buffer, ST stages of streamed
    tiles, a tile released at the top of the next iteration or at the end, causal skips per warpgroup) under random
    interleavings; checks as :func:`simulate_forward`. Returns the number of (warp, tile) products run."""
    nob = -(-(S if dkdv else L) // 128)
    total = nob * BH
    rng = np.random.default_rng(seed)
    worked = [0]

    def decode(wt):
        blk = wt // BH if dkdv else nob - 1 - wt // BH
        own0 = blk * 128
        first, end = (own0 if causal else 0, L) if dkdv else (0, min(S, own0 + 128) if causal else S)
        return own0, first, (-(-(end - first) // 64) if end > first else 0)

    def cta(b):
        ofull, oempty = Barrier(1), Barrier(8)
        full, empty = [Barrier(1) for _ in range(ST)], [Barrier(8) for _ in range(ST)]
        own, stage = [None], [None] * ST

        def producer():
            kv = n = 0
            for wt in range(b, total, ctas):
                own0, first, nt = decode(wt)
                yield oempty, (n & 1) ^ 1
                own[0] = wt
                ofull.arrive()
                for it in range(nt):
                    s = kv % ST
                    yield empty[s], ((kv // ST) & 1) ^ 1
                    stage[s] = (wt, it)
                    full[s].arrive()
                    kv += 1
                n += 1

        def consumer(cw):
            kv = n = 0
            for wt in range(b, total, ctas):
                own0, first, nt = decode(wt)
                yield ofull, n & 1
                pending = -1
                for it in range(nt):
                    st = (kv + it) % ST
                    x0 = first + it * 64
                    skip = causal and (x0 + 63 < own0 + cw * 64 if dkdv else x0 > own0 + cw * 64 + 63)
                    if pending >= 0:
                        assert stage[pending][0] == wt and own[0] == wt
                        empty[pending].arrive()
                        pending = -1
                    yield full[st], ((kv + it) // ST) & 1
                    assert stage[st] == (wt, it) and own[0] == wt
                    if skip:
                        empty[st].arrive()
                        continue
                    worked[0] += 1
                    yield None
                    pending = st
                assert own[0] == wt
                if pending >= 0:
                    assert stage[pending][0] == wt
                    empty[pending].arrive()
                oempty.arrive()
                kv += nt
                n += 1

        return [producer()] + [consumer(w // 4) for w in range(8)]

    threads = [t for b in range(min(ctas, total)) for t in cta(b)]
    _run(threads, rng)
    return worked[0]
