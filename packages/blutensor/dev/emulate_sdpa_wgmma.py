"""NumPy model of kernels/sdpa_wgmma.cu's index math (no GPU): TMA boxes written with the 128-byte swizzle
(16-byte chunk index XOR address bits 7-9), the shared-memory descriptors of every k-step (kmajor / mnmajor in
the kernel: start address, LBO, SBO), the way wgmma walks a descriptor (K-major ``((8,m),(8,2k))`` rows of
128 B with 8-row groups SBO apart; MN-major 64-element atoms LBO apart, 8-row k groups SBO apart; then the
swizzle on the absolute address), the m64nN accumulator layout and the register A fragments built from it.

:func:`forward_tile` and :func:`backward_tile` rebuild one consumer warpgroup's products exactly as the kernel
issues them and return what the tensor cores would compute; tests/test_sdpa_wgmma.py compares them with plain
float64 matrix products. Usage: python packages/blutensor/dev/emulate_sdpa_wgmma.py
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


if __name__ == "__main__":
    for hd in (64, 128):
        print(f"HD {hd}: max error of the modelled wgmma products {check(hd):.2e}")
