"""NumPy emulation of the register-staged SIMT main loop (gemm_simt_f32.cu, gemm_simt_reg_body: configs with
2 stages): every thread's global loads (16-byte or element-wise, with the bounds it checks), its shared
stores into the K-major [BK][ROWS + 4] stages, its float4 fragment reads of the 32 x 64 warp tile and its
epilogue coordinates, replayed per CTA and compared with float64 A @ B. Catches index-math errors (tile
coverage, tail-first k order, split-K ranges, alignment of the vector path, out-of-bounds reads) on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from blublas import configs

REG_CONFIGS = [c for c in configs.ALL_CONFIGS["simt"].values() if c.stages == 2]


class Stage:
    """BluSimtStage<ROWS, BK, NT, KCONTIG> for every thread at once (arrays indexed [tid, p])."""

    def __init__(self, rows: int, bk: int, nt: int, kcontig: bool):
        self.rows, self.bk, self.nt, self.kcontig = rows, bk, nt, kcontig
        self.runs = rows * bk // 4
        self.vecs = -(-self.runs // nt)
        self.even = self.runs % nt == 0
        assert self.even or self.vecs == 1
        self.sld = rows + 4
        tid = np.arange(nt)
        self.active = np.ones(nt, bool) if self.even else tid < self.runs
        t = np.where(self.active, tid, 0)
        i = t[:, None] + np.arange(self.vecs)[None, :] * nt
        if kcontig:
            self.r, self.kk = i // (bk // 4), (i % (bk // 4)) * 4
        else:
            self.r, self.kk = (i % (rows // 4)) * 4, i // (rows // 4)

    def init(self, ld: int, row0: int, rows_lim: int, k_begin: int) -> None:
        # the kernel keeps run 0's pointer and bound; run p is pstep elements / PROW rows further
        r0, k0 = self.r[:, :1], self.kk[:, :1]
        prow = self.nt // (self.bk // 4) if self.kcontig else 0
        pk = 0 if self.kcontig else self.nt // (self.rows // 4)
        p = np.arange(self.vecs)[None, :]
        self.rrem = rows_lim - row0 - r0 - p * prow
        ptr0 = (row0 + r0) * ld + k_begin + k0 if self.kcontig else (k_begin + k0) * ld + row0 + r0
        self.ptr = ptr0 + p * (prow if self.kcontig else pk) * ld
        # ... which must be the run's own (row, k) element
        direct = (row0 + self.r) * ld + k_begin + self.kk if self.kcontig else (k_begin + self.kk) * ld + row0 + self.r
        act = self.active[:, None] & np.ones_like(p, bool)
        assert np.array_equal(self.ptr[act], direct[act])
        assert np.array_equal(self.rrem[act], (rows_lim - row0 - self.r)[act])

    def load_full(self, mem: Mem, check: bool) -> None:
        """check=False (interior CTA, 16-byte loads allowed): one aligned float4 per run, no bound checks."""
        self.v = np.zeros((self.nt, self.vecs, 4))
        for t in range(self.nt):
            if not self.active[t]:
                continue
            for p in range(self.vecs):
                o = int(self.ptr[t, p])
                if not check:
                    assert o % 4 == 0, "16-byte load of a misaligned address"
                    self.v[t, p] = [mem.read(o + j) for j in range(4)]
                else:
                    for j in range(4):
                        ok = self.rrem[t, p] > (0 if self.kcontig else j)
                        self.v[t, p, j] = mem.read(o + j) if ok else 0.0

    def load_tail(self, mem: Mem, base_step: int, kvalid: int) -> None:
        self.v = np.zeros((self.nt, self.vecs, 4))
        for t in range(self.nt):
            if not self.active[t]:
                continue
            for p in range(self.vecs):
                kk, rr = int(self.kk[t, p]), int(self.rrem[t, p])
                for j in range(4):
                    ok = (rr > 0 and kk + j < kvalid) if self.kcontig else (rr > j and kk < kvalid)
                    self.v[t, p, j] = mem.read(int(self.ptr[t, p]) + base_step + j) if ok else 0.0

    def advance(self, step: int) -> None:
        self.ptr = self.ptr + step

    def store(self, smem: np.ndarray, written: np.ndarray) -> None:
        for t in range(self.nt):
            if not self.active[t]:
                continue
            for p in range(self.vecs):
                d = int(self.kk[t, p]) * self.sld + int(self.r[t, p])
                idx = [d + j * self.sld for j in range(4)] if self.kcontig else [d + j for j in range(4)]
                if not self.kcontig:
                    assert d % 4 == 0, "misaligned float4 shared store"
                for j, x in enumerate(idx):
                    assert 0 <= x < smem.size
                    smem[x] = self.v[t, p, j]
                    written[x] += 1


class Mem:
    """A row-major matrix (rows x cols, leading dimension ld) as flat memory; reads must stay inside it."""

    def __init__(self, x: np.ndarray, ld: int):
        self.rows, self.cols = x.shape
        self.ld = ld
        self.flat = np.zeros(max(self.rows * ld, 1))
        for r in range(self.rows):
            self.flat[r * ld : r * ld + self.cols] = x[r]

    def read(self, off: int) -> float:
        r, c = divmod(off, self.ld)
        assert 0 <= r < self.rows and c < self.cols, f"out-of-bounds read at ({r}, {c}) of {self.rows}x{self.cols}"
        return self.flat[off]


def tile_coords(pid_x: int, pid_y: int, gx: int, gy: int, bm: int, bn: int) -> tuple[int, int]:
    """blu_tile_coords (grouped order, GROUP_M = 8)."""
    pid = pid_y * gx + pid_x
    width = 8 * gx
    first_m = (pid // width) * 8
    gsize = min(gy - first_m, 8)
    r = pid % width
    return (first_m + r % gsize) * bm, (r // gsize) * bn


def emulate(cfg, layout: str, a: np.ndarray, b: np.ndarray, lda: int, ldb: int, splits: int, vec: bool):
    """C = op(a) @ op(b) (summed over split-K partials) the way the register-staged kernel computes it."""
    ta, tb = layout[0] == "t", layout[1] == "t"
    M, K = (a.shape[1], a.shape[0]) if ta else a.shape
    N = b.shape[0] if tb else b.shape[1]
    bm, bn, bk = cfg.bm, cfg.bn, cfg.bk
    nt = (bm // 8) * (bn // 8)
    assert nt == cfg.threads
    chunk, splits = configs.k_chunk_for(cfg, K, splits)
    memA, memB = Mem(a, lda), Mem(b, ldb)
    sta, stb = Stage(bm, bk, nt, not ta), Stage(bn, bk, nt, tb)
    step_a = bk * lda if ta else bk
    step_b = bk if tb else bk * ldb
    gx, gy = -(-N // bn), -(-M // bm)
    out = np.zeros((M, N))
    hits = np.zeros((splits, M, N), int)
    tid = np.arange(nt)
    warp, lane = tid // 32, tid % 32
    wm, wn = warp % (bm // 32), warp // (bm // 32)
    am = wm * 32 + (lane // 8) * 4
    bnn = wn * 64 + (lane % 8) * 4
    rows_of = np.concatenate([am[:, None] + np.arange(4), am[:, None] + 16 + np.arange(4)], axis=1)
    cols_of = np.concatenate([bnn[:, None] + np.arange(4), bnn[:, None] + 32 + np.arange(4)], axis=1)
    for z in range(splits):
        k_begin = z * chunk
        k_end = min(K, k_begin + chunk)
        klen = max(k_end - k_begin, 0)
        nfull, tail = divmod(klen, bk)
        ktiles = nfull + (tail > 0)
        for py in range(gy):
            for px in range(gx):
                m0, n0 = tile_coords(px, py, gx, gy, bm, bn)
                check = not (vec and m0 + bm <= M and n0 + bn <= N)  # the dispatcher's choice of instance
                sta.init(lda, m0, M, k_begin)
                stb.init(ldb, n0, N, k_begin)
                shA = np.full((2, bk * sta.sld), np.nan)
                shB = np.full((2, bk * stb.sld), np.nan)
                acc = np.zeros((nt, 8, 8))
                if tail > 0:
                    sta.load_tail(memA, nfull * step_a, tail)
                    stb.load_tail(memB, nfull * step_b, tail)
                elif ktiles > 0:
                    sta.load_full(memA, check)
                    stb.load_full(memB, check)
                    sta.advance(step_a)
                    stb.advance(step_b)
                if ktiles > 0:
                    wa, wb = np.zeros(shA.shape[1], int), np.zeros(shB.shape[1], int)
                    sta.store(shA[0], wa)
                    stb.store(shB[0], wb)
                for kt in range(ktiles):
                    more = kt + 1 < ktiles
                    if more:
                        sta.load_full(memA, check)
                        stb.load_full(memB, check)
                        sta.advance(step_a)
                        stb.advance(step_b)
                    sa, sb = shA[kt & 1], shB[kt & 1]
                    for k in range(bk):
                        ia = k * sta.sld + rows_of
                        ib = k * stb.sld + cols_of
                        assert ia.max() < sa.size and ib.max() < sb.size
                        assert np.all(am % 4 == 0) and np.all((k * sta.sld + am) % 4 == 0)
                        ra, rb = sa[ia], sb[ib]
                        assert not np.isnan(ra).any() and not np.isnan(rb).any(), "read of an unwritten slot"
                        acc += ra[:, :, None] * rb[:, None, :]
                    if more:
                        wa, wb = np.zeros(shA.shape[1], int), np.zeros(shB.shape[1], int)
                        shA[(kt + 1) & 1] = np.nan  # stale values must never be read
                        shB[(kt + 1) & 1] = np.nan
                        sta.store(shA[(kt + 1) & 1], wa)
                        stb.store(shB[(kt + 1) & 1], wb)
                        # every slot the fragments read is written exactly once per k-tile
                        assert wa.max() == 1 and wb.max() == 1
                r = m0 + rows_of[:, :, None] + 0 * cols_of[:, None, :]
                c = n0 + cols_of[:, None, :] + 0 * rows_of[:, :, None]
                ok = (r < M) & (c < N)
                np.add.at(out, (r[ok], c[ok]), acc[ok])
                np.add.at(hits[z], (r[ok], c[ok]), 1)
    assert np.all(hits == 1), "every output element must be written exactly once per split"
    return out


def _operands(rng, layout: str, m: int, n: int, k: int, pad: int):
    ta, tb = layout[0] == "t", layout[1] == "t"
    ash = (k, m) if ta else (m, k)
    bsh = (n, k) if tb else (k, n)
    a = rng.standard_normal(ash)
    b = rng.standard_normal(bsh)
    if pad < 0:  # leading dimensions rounded up to a multiple of 4 elements (the 16-byte path)
        return a, b, -(-ash[1] // 4) * 4, -(-bsh[1] // 4) * 4
    return a, b, ash[1] + pad, bsh[1] + pad


def _ref(layout, a, b):
    opa = a.T if layout[0] == "t" else a
    opb = b.T if layout[1] == "t" else b
    return opa @ opb


@pytest.mark.parametrize("cfg", REG_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
def test_register_staged_index_math_matches_float64(cfg, layout):
    rng = np.random.default_rng(hash((cfg.name, layout)) % 2**32)
    # odd shapes (scalar path, partial tail tile first), an aligned one (16-byte path) with split-K
    cases = [((cfg.bm + 3, 67, 19), 1, 1, False), ((cfg.bm, cfg.bn + 64, 4 * cfg.bk), 0, 1, True)]
    cases.append(((70, cfg.bn // 2 + 5, 3 * cfg.bk + 5), -1, 3, True))  # vec with ragged M/N/K, split 3
    cases.append(((cfg.bm + 9, cfg.bn + 3, 5 * cfg.bk), -1, 2, True))
    for (m, n, k), pad, splits, vec in cases:
        a, b, lda, ldb = _operands(rng, layout, m, n, k, pad)
        assert not vec or (lda % 4 == 0 and ldb % 4 == 0)
        got = emulate(cfg, layout, a, b, lda, ldb, splits, vec)
        np.testing.assert_allclose(got, _ref(layout, a, b), rtol=1e-12, atol=1e-12)


def test_register_staged_k_zero_and_tiny():
    cfg = configs.ALL_CONFIGS["simt"]["128x128x8_s2"]
    rng = np.random.default_rng(0)
    for layout in ("nn", "nt", "tn"):
        for m, n, k in ((1, 1, 1), (5, 3, 2)):
            a, b, lda, ldb = _operands(rng, layout, m, n, k, 0)
            got = emulate(cfg, layout, a, b, lda, ldb, 1, False)
            np.testing.assert_allclose(got, _ref(layout, a, b), rtol=1e-12, atol=1e-12)


def test_register_staged_configs_are_listed_for_sm90_and_fit():
    order = configs.arch_info(90).order["simt"]
    for cfg in REG_CONFIGS:
        assert cfg.name in order
        assert cfg.threads == (cfg.bm // 8) * (cfg.bn // 8)
        # two shared stages of [BK][BM+4] and [BK][BN+4] floats: what the kernel's pointers assume
        assert cfg.smem_bytes("nt") == 2 * 4 * cfg.bk * (cfg.bm + 4 + cfg.bn + 4)
