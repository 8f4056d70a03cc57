"""NumPy emulation of the shared-memory side of kernels/gemm_wgmma_{bf16,tf32}.cu (no GPU): the swizzled
tile loaders (blu_load_swz / blu_load_swz_f32, both the 16-byte cp.async and the element path), the matrix
descriptors each k16/k8 step builds, and the way wgmma walks a descriptor (CUTLASS's canonical GMMA layouts:
K-major ``((8,m),(T,2k)):((8T,SBO),(1,T))``, MN-major ``((T,8,m),(8,k)):((1,T,LBO),(8T,SBO))``, in elements,
then Swizzle<3,4,3> on the absolute byte address). imm-trans 0 reads the K-major form, 1 the MN-major one.

It reconstructs every operand tile the tensor cores would see for each warpgroup and k step, multiplies
them, and compares with op(A) @ op(B) in float64. This is how the inverted B transpose immediate was
proven offline: with ``trans_b = TB`` (the old code) NN/NT/TN are wrong, with ``trans_b = !TB`` exact.
The canonical layouts are CUTLASS's/PTX's; the GPU run (gpu_check.py) is what confirms them.

Usage: python packages/blublas/dev/emulate_wgmma.py
"""

from __future__ import annotations

import numpy as np

ATOM_ROW = 128  # bytes per swizzled row


def swz(r: int, c: int) -> int:
    """blu_swz: byte offset of 16-byte chunk c of 128-byte row r (Swizzle<3,4,3>)."""
    return r * 128 + ((c ^ (r & 7)) << 4)


def hw_swizzle(addr: int) -> int:
    """What the hardware does to an address read through a 128B-swizzle descriptor."""
    return addr ^ (((addr >> 7) & 7) << 4)


def load_swz(
    smem: dict, base: int, g: np.ndarray, r0: int, c0: int, R: int, C: int, rows: int, cols: int, esz: int, vec: bool
) -> None:
    """blu_load_swz (bf16, esz 2) / blu_load_swz_f32 (esz 4): rows x cols of g (cols contiguous) at base."""
    per = 16 // esz  # elements per 16-byte chunk
    atom = rows * 128  # MN-major: 64-element column atoms (only when cols * esz > 128)
    for r in range(rows):
        for c in range(cols):
            gr, gc = r0 + r, c0 + c
            v = g[gr, gc] if (gr < R and gc < C) else 0.0
            cc = c // per
            if vec:  # chunk address, element inside the chunk
                off = (cc // 8) * atom + swz(r, cc % 8) + (c % per) * esz
            else:  # the element path's own expression
                off = (cc >> 3) * atom + swz(r, cc & 7) + (c & (per - 1)) * esz
            smem[base + off] = v


def read_operand(smem: dict, start: int, lbo: int, sbo: int, trans: int, mn: int, kk: int, esz: int) -> np.ndarray:
    """The (mn x kk) operand tile wgmma reads from a descriptor (start, LBO, SBO, 128B swizzle)."""
    per = 16 // esz
    out = np.full((mn, kk), np.nan)
    for i in range(mn):
        for k in range(kk):
            if trans == 0:  # K-major: 8-row groups SBO apart, k contiguous inside the 128-byte row
                off = (i % 8) * 128 + (i // 8) * sbo + (k // per) * 16 + (k % per) * esz
            else:  # MN-major: 64-element (128-byte) atoms LBO apart, 8-k-row groups SBO apart
                off = (i % (128 // esz)) * esz + (i // (128 // esz)) * lbo + (k % 8) * 128 + (k // 8) * sbo
            out[i, k] = smem.get(hw_swizzle(start + off), np.nan)
    return out


def emulate_bf16_tile(
    layout: str, bn: int, m: int, n: int, k: int, vec: bool, fixed: bool = True, seed: int = 0
) -> float:
    """One CTA (tile 128 x bn, k tiles of 64) of gemm_wgmma_body; max |emulated - reference|."""
    rng = np.random.default_rng(seed)
    ta, tb = layout[0] == "t", layout[1] == "t"
    a = rng.integers(-4, 5, size=(k, m) if ta else (m, k)).astype(np.float64)
    b = rng.integers(-4, 5, size=(n, k) if tb else (k, n)).astype(np.float64)
    bm, bk = 128, 64
    a_bytes = bm * bk * 2
    base = 1024 * 5  # any 1024-aligned stage base
    acc = np.zeros((bm, bn))
    for k0 in range(0, k, bk):
        smem: dict = {}
        if ta:
            load_swz(smem, base, a, k0, 0, k, m, bk, bm, 2, vec)
        else:
            load_swz(smem, base, a, 0, k0, m, k, bm, bk, 2, vec)
        if tb:
            load_swz(smem, base + a_bytes, b, 0, k0, n, k, bn, bk, 2, vec)
        else:
            load_swz(smem, base + a_bytes, b, k0, 0, k, n, bk, bn, 2, vec)
        a_addr, b_addr = base, base + a_bytes
        for wg in range(2):
            for j in range(bk // 16):
                # the descriptors of gemm_wgmma_bf16.cu, verbatim
                if ta:
                    da = (a_addr + wg * (bk * 128) + j * 2048, bk * 128, 1024)
                else:
                    da = (a_addr + wg * (64 * 128) + j * 32, 16, 1024)
                db = (b_addr + j * 32, 16, 1024) if tb else (b_addr + j * 2048, bk * 128, 1024)
                trans_a = 1 if ta else 0
                trans_b = (0 if tb else 1) if fixed else (1 if tb else 0)
                at = read_operand(smem, *da, trans_a, 64, 16, 2)  # (64 m, 16 k)
                bt = read_operand(smem, *db, trans_b, bn, 16, 2)  # (bn n, 16 k)
                acc[wg * 64 : wg * 64 + 64] += at @ bt.T
    opa = a.T if ta else a
    opb = b.T if tb else b
    ref = np.zeros((bm, bn))
    ref[: min(m, bm), : min(n, bn)] = (opa @ opb)[:bm, :bn]
    return float(np.max(np.abs(acc - ref))) if np.all(np.isfinite(acc)) else float("inf")


def emulate_tf32_tile(bn: int, m: int, n: int, k: int, vec: bool, seed: int = 0) -> float:
    """One CTA of gemm_wgmma_tf32_body (NT, both K-major, k tiles of 32, k8 steps)."""
    rng = np.random.default_rng(seed)
    a = rng.integers(-4, 5, size=(m, k)).astype(np.float64)
    b = rng.integers(-4, 5, size=(n, k)).astype(np.float64)
    bm, bk = 128, 32
    a_bytes = bm * bk * 4
    base = 1024 * 3
    acc = np.zeros((bm, bn))
    for k0 in range(0, k, bk):
        smem: dict = {}
        load_swz(smem, base, a, 0, k0, m, k, bm, bk, 4, vec)
        load_swz(smem, base + a_bytes, b, 0, k0, n, k, bn, bk, 4, vec)
        for wg in range(2):
            for j in range(bk // 8):
                at = read_operand(smem, base + wg * (64 * 128) + j * 32, 16, 1024, 0, 64, 8, 4)
                bt = read_operand(smem, base + a_bytes + j * 32, 16, 1024, 0, bn, 8, 4)
                acc[wg * 64 : wg * 64 + 64] += at @ bt.T
    ref = np.zeros((bm, bn))
    ref[: min(m, bm), : min(n, bn)] = (a @ b.T)[:bm, :bn]
    return float(np.max(np.abs(acc - ref))) if np.all(np.isfinite(acc)) else float("inf")


def main() -> None:
    for layout in ("nn", "nt", "tn"):
        for bn in (128, 256):
            for shape, vec in (((128, bn, 128), True), ((77, bn - 9, 70), False)):
                new = emulate_bf16_tile(layout, bn, *shape, vec=vec)
                old = emulate_bf16_tile(layout, bn, *shape, vec=vec, fixed=False)
                print(f"bf16 {layout} BN={bn} {shape} vec={vec}: max err fixed {new:g}, old trans-b {old:g}")
    for bn in (128, 256):
        print(
            f"tf32 nt BN={bn}: max err {emulate_tf32_tile(bn, 128, bn, 64, True):g} (vec), "
            f"{emulate_tf32_tile(bn, 70, bn - 5, 45, False):g} (element path)"
        )


if __name__ == "__main__":
    main()
