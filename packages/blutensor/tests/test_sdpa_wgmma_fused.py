"""The fused backward of the Hopper flash attention (kernels/sdpa_wgmma.cu ``*_bwd_fused`` / ``*_bwd_dq_convert``,
chosen in backends/cupy/sdpa_wgmma.py's ``backward`` by sdpa.py's ``fused_backward``).

CPU: the NumPy model of the kernel's dQ path (dev/emulate_sdpa_wgmma.py: the bf16 dS^T pairs stored at the kernel's
closed-form swizzled addresses, read back through the transposed-A and MN-major-B descriptors, added at the
accumulator addresses of its red.global.add) reproduces float64 products tile by tile, over the kernel's own walk of
work tiles (causal diagonals and skips, odd L and S, HD 64 and 128), and fails when an address is off; the shared
memory fits; the policy picks the fused pair of launches under ``attention_backward='fused'`` and the deterministic
pair under 'auto', ``deterministic`` or 'split'. Twins of the GPU tests run the host code on the shared fake
device with a float64 model of each launched kernel that reads and writes through the launch's raw pointers and
layout arguments: dq/dk/dv against float64, dense, fused-qkv strided and grouped-query, fused and split agreeing.
GPU (cuda-marked, sm_90 only): the same assertions on the real kernels.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import blutensor as bt
import numpy as np
import pytest
from attention_reference import bf16_round as _bf16
from attention_reference import bf16_to_f64 as _f64
from attention_reference import sdpa_reference
from blutensor.backends.cupy import sdpa
from blutensor.backends.cupy import sdpa_wgmma as wg
from cast_emulators import CAST_KERNELS

DEV = Path(__file__).resolve().parents[1] / "dev"
sys.path.insert(0, str(DEV))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "testing"))
import emulate_sdpa_wgmma as em  # noqa: E402
import fake_cuda  # noqa: E402

TOL = {"dq": 5e-2, "dk": 5e-2, "dv": 5e-2}  # bf16 storage of O(1) values, as test_sdpa_wgmma.py's


def _close(name, got, want):
    assert np.abs(got - want).max() <= TOL[name] * max(1.0, np.abs(want).max()), name


# ------------------------------------------------------------------------------------------ index math (CPU)
def _head(L, S, hd, causal, seed):
    rng = np.random.default_rng(seed)
    q, k, v, do = (_bf16(rng.standard_normal((n, hd)))[1] for n in (L, S, S, L))
    ref = sdpa_reference(q[None], k[None], v[None], do[None], causal, 1 / math.sqrt(hd))
    D = (do * ref["o"][0]).sum(-1)
    return q, k, v, do, ref["lse"][0], D, ref


@pytest.mark.parametrize("hd, L, S, causal", [(64, 77, 77, True), (128, 77, 77, True), (64, 130, 200, False),
                                              (128, 130, 130, True), (64, 200, 131, True)])
def test_emulated_fused_dq_partials_match_float64(hd, L, S, causal):
    """Every tile's dQ partial, as the tensor cores would compute it from the swizzled dS^T tile and K, equals
    the float64 product of the same bf16 dS and K (exact: index math), rows >= L never written; the summed
    accumulator times the scale is dQ within bf16 rounding (the masks and causal skips are right)."""
    sc = 1 / math.sqrt(hd)
    q, k, v, do, lse, D, ref = _head(L, S, hd, causal, L + S + hd)
    acc, tiles = em.fused_dq(q, k, v, do, lse, D, causal, sc)
    kp = np.vstack([k, np.zeros((256, hd))])  # TMA's zero fill past S
    want = np.zeros((L + 64, hd))
    for own0, x0, cw, dst in tiles:
        keys = own0 + cw * 64
        want[x0 : x0 + 64] += dst.T @ kp[keys : keys + 64]
        assert np.all(dst[:, max(0, L - x0):] == 0)  # padded queries: no dS
        assert np.all(dst[max(0, S - keys):, :] == 0)  # padded keys: no dS
        if causal:
            assert x0 + 63 >= keys  # skipped tiles never reach the atomics
    assert np.abs(acc - want[:L]).max() <= 1e-9 * max(1.0, np.abs(want).max())
    _close("dq", acc * sc, ref["dq"][0])
    if causal:  # the diagonal tiles of both warpgroups were among them
        assert {(x0 - own0, cw) for own0, x0, cw, _ in tiles} >= {(0, 0), (64, 1)}
    assert len({id(t) for t in tiles}) == len(tiles) and len(tiles) >= 2


@pytest.mark.parametrize("wrong", ["unswizzled dS^T", "dS^T rows swapped", "B box distance", "red column",
                                   "staging order"])
def test_emulated_fused_dq_fails_on_a_wrong_address(monkeypatch, wrong):
    """The model can fail: each of these off-by-something addresses gives a wrong dQ."""
    if wrong == "unswizzled dS^T":
        monkeypatch.setattr(em, "dst_addr", lambda dst, j, w, g, t: dst + (16 * w + g + 8 * (j & 1)) * 128
                            + (j >> 1) * 16 + 4 * t)
    elif wrong == "dS^T rows swapped":
        monkeypatch.setattr(em, "dst_addr", lambda dst, j, w, g, t: dst + (16 * w + g + 8 * (1 - (j & 1))) * 128
                            + (((j >> 1) ^ g) << 4) + 4 * t)
    elif wrong == "B box distance":
        real = em.dq_descs
        monkeypatch.setattr(em, "dq_descs", lambda dst, k_own, c, kk: (real(dst, k_own, c, kk)[0],
                                                                        em.mnmajor(k_own + c * 64 * 128, 128, kk)))
    elif wrong == "red column":
        real_red = em.red_dq
        monkeypatch.setattr(em, "red_dq", lambda acc, regs, c, x0, L, hd: real_red(acc, regs[:, ::-1], c, x0, L, hd))
    else:  # the staged tile written thread-major (each thread's 32 floats together), read back fragment-order
        monkeypatch.setattr(em, "stage_off", lambda i4, th: (th * 8 + i4) * 4)
    hd, L, S = (64, 70, 70) if wrong == "staging order" else (128, 70, 70)
    q, k, v, do, lse, D, ref = _head(L, S, hd, False, 3)
    acc, _ = em.fused_dq(q, k, v, do, lse, D, False, 1 / math.sqrt(hd))
    assert np.abs(acc / math.sqrt(hd) - ref["dq"][0]).max() > 0.1 * np.abs(ref["dq"][0]).max()


def test_fused_shared_memory_fits_hopper():
    """Bwd::SMEM_FUSED (the split kernels' shared memory plus four 8 KB dS^T tiles, and at head dim 64 two 16 KB dQ
    staging tiles) mirrored on the host, inside sm_90's 227 KB opt-in at both head dims (HD 128 keeps its two
    stages)."""
    for hd in wg.HDS:
        stage = 2 * 64 * 64 * 4 if hd in wg.BULK_DQ_HDS else 0
        assert wg.fused_smem(hd) == wg.bwd_smem(hd) + 4 * 64 * 64 * 2 + stage <= 227 * 1024
    src = (Path(sdpa.__file__).resolve().parent / "kernels" / "sdpa_wgmma.cu").read_text()
    assert "SMEM_FUSED = SMEM + 4 * DST + (bulk_dq<HD> ? 2 * STAGE : 0)" in src and "DST = 64 * 64 * 2" in src
    assert "STAGE = 64 * 64 * 4" in src and "constexpr bool bulk_dq = HD == 64;" in src
    assert wg.BULK_DQ_HDS == em.BULK_HDS == (64,) and wg.DQ_TILE == em.DQ_TILE
    assert wg.STAGES == {64: (3, 3), 128: (2, 2)} and "WGMMA_ENTRIES(128, 2, 2)" in src


def test_forward_mask_predicate_covers_every_masked_element():
    """The forward compiles the per-element mask only into the copy of its softmax that a key tile takes when
    ``masked(k0)`` says so, and only a row block's last tile may take it (the middle tiles run the unmasked step
    unconditionally). Brute force over small shapes: wherever an element would be masked, the predicate is true,
    and it never is for a middle tile."""
    src = (Path(sdpa.__file__).resolve().parent / "kernels" / "sdpa_wgmma.cu").read_text()
    assert "return k0 + BN > S || (causal && k0 + BN - 1 > q0 + cw * 64);" in src
    assert "for (int it = 1; it < nt - 1; ++it) step(false, it);" in src
    assert "const int nt = ((causal ? min(S, q0 + BM) : S) + BN - 1) / BN;" in src
    for L in (1, 63, 64, 65, 130, 200, 256, 384):
        for S in (1, 64, 100, 128, 129, 256, 300):
            for causal in (False, True):
                for q0 in range(0, L, 128):
                    nt = -(-(min(S, q0 + 128) if causal else S) // 128)
                    for cw in (0, 1):
                        rows = np.arange(q0 + 64 * cw, q0 + 64 * cw + 64)[:, None]
                        for it in range(nt):
                            k0 = 128 * it
                            keys = np.arange(k0, k0 + 128)[None, :]
                            hit = (keys >= S) | (causal & (keys > rows))
                            pred = k0 + 128 > S or (causal and k0 + 127 > q0 + 64 * cw)
                            assert pred or not hit.any(), (L, S, causal, q0, cw, it)
                            assert it in (0, nt - 1) or not pred, (L, S, causal, q0, cw, it)


def test_backward_column_spans_are_the_element_masks():
    """The backward kernels mask each element by two compares of its constant column fcol(i, 0) against the row's
    bounds from span_of; brute force over small shapes and every tile and thread: exactly the elements the direct
    conditions (dK/dV: query >= L, key >= S, causal key > query; dQ: query >= L, key >= S, causal key > query)
    mask are masked."""
    src = (Path(sdpa.__file__).resolve().parent / "kernels" / "sdpa_wgmma.cu").read_text()
    for needle in ("lo = causal ? row - x0 : 0;", "hi = row < S ? L - x0 : lo;", "lo = 0;",
                   "hi = row < L ? (causal ? min(S, row + 1) : S) - x0 : 0;",
                   'asm("mov.b32 %0, %1;" : "=r"(a) : "r"(lo - 2 * t));',
                   'asm("mov.b32 %0, %1;" : "=r"(b) : "r"(hi - 2 * t));',
                   "__device__ __forceinline__ int fcol(int i, int t) { return 8 * (i >> 2) + 2 * t + (i & 1); }"):
        assert needle in src, needle

    def span(dkdv, row, x0, t, L, S, causal):
        if dkdv:
            lo = row - x0 if causal else 0
            hi = L - x0 if row < S else lo
        else:
            lo = 0
            hi = ((min(S, row + 1) if causal else S) - x0) if row < L else 0
        return lo - 2 * t, hi - 2 * t

    ci = np.array([8 * (i >> 2) + (i & 1) for i in range(32)])
    for L in (1, 63, 64, 77, 130):
        for S in (1, 64, 77, 129):
            for causal in (False, True):
                for dkdv in (False, True):
                    nown, nstr = (S, L) if dkdv else (L, S)
                    for row in range(0, -(-nown // 128) * 128):
                        for x0 in range(0, nstr, 64):
                            for t in range(4):
                                a, b = span(dkdv, row, x0, t, L, S, causal)
                                col = x0 + ci + 2 * t
                                if dkdv:  # row = key, col = query
                                    masked = (col >= L) | (row >= S) | (causal & (row > col))
                                else:  # row = query, col = key
                                    masked = (row >= L) | (col >= S) | (causal & (col > row))
                                assert (((ci >= a) & (ci < b)) == ~masked).all(), (L, S, causal, dkdv, row, x0, t)


def test_emulator_spells_the_kernels_address_math():
    """The model's closed forms are the kernel's (the same expressions in wg::store_dst, wg::dq_chunk, wg::red_dq),
    so the emulated checks above are checks of the kernel."""
    src = (Path(sdpa.__file__).resolve().parent / "kernels" / "sdpa_wgmma.cu").read_text()
    for needle in ("const int r = 16 * w + g + 8 * (j & 1);",
                   "dst + (unsigned)(r * 128 + (((j >> 1) ^ g) << 4) + 4 * t)",
                   "blu_wgmma_ss_m64n64k16<1, 1>(acc, mnmajor(dst, 64, kk), mnmajor(k_own + (unsigned)(c * 128 * 128), "
                   "128, kk),",
                   "const int col = 64 * c + 8 * (i >> 2) + 2 * t;",
                   "const int q0 = x0 + 16 * w + g, q1 = q0 + 8;",
                   "k_own = sA + cw * 64 * 128",
                   "(2 * cw + (nds & 1)) * B::DST",
                   "const unsigned sDS = sX + 2 * ST * TILE;",
                   "const bool valid = frow8(i) ? ci >= a1 && ci < b1 : ci >= a0 && ci < b0;",
                   "stg + (unsigned)((i4 * 128 + th) * 16)",  # em.stage_off, in bytes
                   "stage_dq(stg, dqp, tid & 127);",
                   "dqa + ((long long)bh * nqb + x0 / 64) * 4096",  # em.bulk_dq's tile x0 / 64
                   "const int e0 = (part * 128 + 32 * (r / 16) + 4 * (r % 8)) * 4 + 2 * ((r / 8) % 2);",
                   "tile + e0 + 4 * t",  # em.frag_index
                   "const float* tile = acc + ((row / L) * nqb + q / 64) * 4096;"):
        assert needle in src, needle


@pytest.fixture
def device(monkeypatch):
    state = {"smem": 227 * 1024}
    monkeypatch.setattr(sdpa, "_compute_capability", lambda: 90)
    monkeypatch.setattr(sdpa, "smem_optin", lambda: state["smem"])
    for var in ("BLUTRAIN_SDPA_KERNEL", "BLUTRAIN_SDPA_BWD", "BLUTRAIN_DETERMINISTIC"):
        monkeypatch.delenv(var, raising=False)
    bt.policy.reset_defaults()
    with bt.policy.scope(attention_backward="fused"):  # the fused kernel is under test (at 128 'auto' keeps the pair)
        yield state


def test_fused_backward_choice_for_wgmma(device):
    """'fused' takes the fused Hopper kernel; 'auto' takes it at head dim 64 only (FUSED_AUTO); 'split' and
    deterministic algorithms the split pair, and so does a device whose shared memory does not hold it."""
    with bt.policy.scope(attention_backward="auto"):
        assert sdpa.fused_backward("bf16_wgmma", 64) and not sdpa.fused_backward("bf16_wgmma", 128)
        assert sdpa.fused_backward("tf32x3", 64) and sdpa.fused_backward("tf32x3", 64, 1024)
        # by sequence length: the split pair below FUSED_MIN_SEQ, the fused kernel from it on
        n = sdpa.FUSED_MIN_SEQ["bf16_wgmma"]
        assert not sdpa.fused_backward("bf16_wgmma", 64, 1024) and not sdpa.fused_backward("bf16_wgmma", 64, n - 1)
        assert sdpa.fused_backward("bf16_wgmma", 64, n) and sdpa.fused_backward("bf16_wgmma", 64, 16384)
    assert sdpa.fused_backward("bf16_wgmma", 64, 1024)  # 'fused' (this fixture's scope): at any length
    assert sdpa.fused_backward("bf16_wgmma", 64) and sdpa.fused_backward("bf16_wgmma", 128)
    with bt.policy.scope(attention_backward="fused"):
        assert sdpa.fused_backward("bf16_wgmma", 128)
    with bt.policy.scope(attention_backward="split"):
        assert not sdpa.fused_backward("bf16_wgmma", 64)
    bt.use_deterministic_algorithms(True)
    try:
        assert not sdpa.fused_backward("bf16_wgmma", 64)
        with bt.policy.scope(attention_backward="fused"):
            assert not sdpa.fused_backward("bf16_wgmma", 64)
    finally:
        bt.use_deterministic_algorithms(False)
    device["smem"] = wg.fused_smem(128) - 1
    assert not sdpa.fused_backward("bf16_wgmma", 128) and sdpa.fused_backward("bf16_wgmma", 64)


# ------------------------------------------------------------------------- host code on the fake device (CPU)
def _rows(a, n, hd, lay):
    """(BH, n, hd) float64 view of the bf16 (or fp32) memory behind ``a`` through a layout (H, sb, sh, st)."""
    H, sb, sh, st = (int(x) for x in lay)
    BH = a.shape[0] if a.ndim == 3 else a.shape[0] * a.shape[2]
    return fake_cuda.host_view(a.data.ptr, np.uint16, (BH // H, H, n, hd), (sb, sh, st, 1)).reshape(BH, n, hd)


def _put(a, n, hd, lay, x):
    """Write float64 ``x`` (BH, n, hd) as bf16 into ``a``'s memory through the layout (H, sb, sh, st)."""
    H, sb, sh, st = (int(v) for v in lay)
    BH = x.shape[0]
    view = fake_cuda.host_view(a.data.ptr, np.uint16, (BH // H, H, n, hd), (sb, sh, st, 1))
    view[...] = _bf16(x.reshape(BH // H, H, n, hd))[0]


def _dense(t):
    """A tensor map stand-in (the array itself) as float64 (BH, n, hd)."""
    x = _f64(np.asarray(t).view(np.ndarray))
    return x if x.ndim == 3 else x.transpose(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3])


def _model(log):
    """float64 models of the launched kernels, by entry name, reading and writing through their arguments."""

    def probs(K, Q, lse, L, S, sc, causal):
        s = Q @ K.transpose(0, 2, 1) * sc
        if causal:
            s = np.where(np.triu(np.ones((L, S), bool), 1), -np.inf, s)
        return np.exp(s - lse[..., None])

    def launch(file, name, grid, block, args, shared_mem=0):
        assert file == "sdpa_wgmma.cu"
        kind = name.split("_hd")[1].split("_", 1)[1]
        hd = int(name.split("_hd")[1].split("_")[0])
        log.append((kind, grid, block, shared_mem))
        if kind == "preprocess":  # (lse * log2 e, D) pairs, (BH, ceil(L / 64) * 64, 2), zero past L
            do, o, lse, ld, BH, L, *lay = args
            L = int(L)
            assert ld.shape == wg.lse_d_shape(int(BH), L) and ld.shape[1] % 64 == 0
            D = (_f64(_rows(do, L, hd, lay)) * _f64(_rows(o, L, hd, lay))).sum(-1)
            ld[...] = 0
            ld[:, :L, 0] = np.asarray(lse, np.float64).reshape(-1, L) * np.log2(np.e)
            ld[:, :L, 1] = D
            return
        if kind == "bwd_dq_convert":
            acc, dq, rows, L, sc, *lay = args
            assert not np.isnan(acc).any()
            a = np.asarray(acc, np.float64)
            if hd in wg.BULK_DQ_HDS:  # the tile-fragment order, read back into rows as the kernel does
                assert acc.shape == wg.dq_accumulator_shape(acc.shape[0], int(L), hd)
                a = a.reshape(acc.shape[0], -1)[:, em.frag_index(int(L))]
            _put(dq, int(L), hd, lay, a * np.float32(sc))
            return
        if kind == "bwd_dq":
            tq, tdo, tk, tv, ld, dq, L, S, sc, causal, *lay = args
        else:
            tk, tv, tq, tdo, ld, dk, dv, *rest = args
            acc = rest.pop(0) if kind == "bwd_fused" else None
            L, S, sc, causal, *lay = rest
        L, S, sc, causal = int(L), int(S), float(sc), bool(causal)
        lay = (lay[0],) + tuple(lay[2:])  # (H, BH, sb, sh, st) -> (H, sb, sh, st)
        Q, dO, K, V = (_dense(t) for t in (tq, tdo, tk, tv))
        pairs = np.asarray(ld, np.float64)
        assert not pairs[:, L:].any()  # the padding the dK/dV kernels' bulk copies read is zero
        P = probs(K, Q, pairs[:, :L, 0] / np.log2(np.e), L, S, sc, causal)
        dS = P * (dO @ V.transpose(0, 2, 1) - pairs[:, :L, 1][..., None])
        if kind == "bwd_dq":
            _put(dq, L, hd, lay, dS @ K * sc)
            return
        _put(dk, S, hd, lay, dS.transpose(0, 2, 1) @ Q * sc)
        _put(dv, S, hd, lay, P.transpose(0, 2, 1) @ dO)
        if acc is not None:
            assert not np.isnan(acc).any() and not acc.any()  # zeroed by the host, then only added to
            part = (dS @ K).astype(np.float32)
            if hd in wg.BULK_DQ_HDS:  # staged partials in the tile-fragment order (em.stage_off / frag_index)
                flat = acc.reshape(acc.shape[0], -1)
                flat[:, em.frag_index(L)] += part
            else:
                acc += part

    return launch


@pytest.fixture
def fake(monkeypatch, device):
    """The host code of sdpa_wgmma / sdpa on the shared fake device (sm_90), the kernels modelled in float64."""
    cp = fake_cuda.install(monkeypatch, compute_capability=90, kernels=CAST_KERNELS)  # bf16 sums compute values
    log = []
    monkeypatch.setattr(wg, "cupy", lambda: cp)
    monkeypatch.setattr(sdpa, "cupy", lambda: cp)
    monkeypatch.setattr(wg, "launch", _model(log))
    monkeypatch.setattr(wg, "tmap", lambda a, name, rows: a)
    monkeypatch.setattr(wg, "num_sms", lambda: 132)
    return cp, log


def _dense_case(cp, BH, L, S, hd, seed):
    rng = np.random.default_rng(seed)
    (qb, q), (kb, k), (vb, v), (db, do) = (_bf16(rng.standard_normal((BH, n, hd))) for n in (L, S, S, L))
    return (q, k, v, do), tuple(cp.asarray(a) for a in (qb, kb, vb, db))


def _run_dense(cp, host, dev, causal, sc):
    q, k, v, do = host
    ref = sdpa_reference(q, k, v, do, causal, sc)
    o = cp.asarray(_bf16(ref["o"])[0])
    lse = cp.asarray(ref["lse"].astype(np.float32))
    return ref, sdpa.flash_attention_backward(*dev[:3], o, lse, dev[3], causal, sc, "bf16_wgmma")


CASES = [(6, 1000, 1000, 64, True), (5, 77, 77, 128, False), (3, 200, 300, 64, False), (1, 77, 77, 64, True)]


@pytest.mark.parametrize("BH, L, S, hd, causal", CASES)
def test_fused_host_path_matches_float64(fake, BH, L, S, hd, causal):
    """CPU twin of test_cuda_fused_matches_float64: 'auto' launches preprocess, the fused kernel (the dK/dV
    kernel's grid and the fused shared memory) and the dq conversion; dq/dk/dv within the bf16 tolerances; the
    deterministic pair gives the same within bf16 rounding."""
    cp, log = fake
    if L == 1000:
        BH = 1  # the float64 model is the cost here, not the host code
    sc = 1.0 / math.sqrt(hd)
    host, dev = _dense_case(cp, BH, L, S, hd, BH * L + hd)
    ref, fused = _run_dense(cp, host, dev, causal, sc)
    assert [e[0] for e in log] == ["preprocess", "bwd_fused", "bwd_dq_convert"]
    assert log[1][1:] == (wg.grid(S, BH), wg.THREADS, wg.fused_smem(hd))
    for name, g in zip(("dq", "dk", "dv"), fused):
        _close(name, _f64(np.asarray(g)), ref[name])
    log.clear()
    with bt.policy.scope(deterministic=True):
        _, split = _run_dense(cp, host, dev, causal, sc)
    assert [e[0] for e in log] == ["preprocess", "bwd_dkdv", "bwd_dq"]
    for name, a, b in zip(("dq", "dk", "dv"), fused, split):
        _close(name, _f64(np.asarray(a)), _f64(np.asarray(b)))


def test_split_path_repeatable_and_fused_default(fake):
    """CPU twin of test_cuda_split_path_is_bitwise_repeatable: deterministic algorithms and 'split' run the split
    pair (bitwise repeatable), 'fused' the fused kernel."""
    cp, log = fake
    host, dev = _dense_case(cp, 2, 130, 130, 64, 11)
    with bt.policy.scope(deterministic=True):
        _, g1 = _run_dense(cp, host, dev, True, 0.125)
        _, g2 = _run_dense(cp, host, dev, True, 0.125)
    with bt.policy.scope(attention_backward="split"):
        _, g3 = _run_dense(cp, host, dev, True, 0.125)
    for a, b, c in zip(g1, g2, g3):
        assert (np.asarray(a) == np.asarray(b)).all() and (np.asarray(a) == np.asarray(c)).all()
    assert "bwd_fused" not in [e[0] for e in log]
    log.clear()
    _run_dense(cp, host, dev, True, 0.125)
    assert [e[0] for e in log] == ["preprocess", "bwd_fused", "bwd_dq_convert"]


@pytest.mark.parametrize("B, T, H, hd, causal", [(2, 150, 3, 64, True), (3, 77, 2, 128, False)])
def test_fused_qkv_host_path_matches_float64(fake, B, T, H, hd, causal):
    """CPU twin of test_cuda_fused_qkv_fused_backward: q/k/v strided views of one (B, T, 3, H, HD) projection, dq
    written by the conversion through dq's (sb, sh, st) layout into the dqkv slices."""
    cp, log = fake
    rng = np.random.default_rng(T)
    qkvb, qkv = _bf16(rng.standard_normal((B, T, 3, H, hd)))
    dob, do = _bf16(rng.standard_normal((B, T, H, hd)))
    sc = 1.0 / math.sqrt(hd)

    def heads(a):
        return a.transpose(0, 2, 1, 3).reshape(B * H, T, hd)

    ref = sdpa_reference(heads(qkv[:, :, 0]), heads(qkv[:, :, 1]), heads(qkv[:, :, 2]), heads(do), causal, sc)
    o = cp.asarray(_bf16(ref["o"].reshape(B, H, T, hd).transpose(0, 2, 1, 3))[0])
    lse = cp.asarray(ref["lse"].astype(np.float32))
    dqkv = sdpa.qkv_attention_backward(cp.asarray(qkvb), o, lse, cp.asarray(dob), causal, sc, "bf16_wgmma")
    assert [e[0] for e in log] == ["preprocess", "bwd_fused", "bwd_dq_convert"]
    d = _f64(np.asarray(dqkv))
    for j, name in enumerate(("dq", "dk", "dv")):
        _close(name, heads(d[:, :, j]), ref[name])


def test_gqa_host_path_runs_the_fused_backward_per_member(fake, monkeypatch):
    """CPU twin of test_cuda_gqa_fused_backward: the grouped-query wrapper's per-member Hopper backward takes the
    fused kernel, each member's dq written through its strided member view."""
    from blutensor.backends.cupy import sdpa_gqa

    cp, log = fake
    monkeypatch.setattr(sdpa_gqa, "cupy", lambda: cp)
    B, Hq, Hk, L, E = 1, 4, 2, 70, 64
    rng = np.random.default_rng(2)
    (qb, q), (db, do) = (_bf16(rng.standard_normal((B, Hq, L, E))) for _ in range(2))
    (kb, k), (vb, v) = (_bf16(rng.standard_normal((B, Hk, L, E))) for _ in range(2))
    G, sc = Hq // Hk, 1 / 8
    kr, vr = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    ref = sdpa_reference(q.reshape(-1, L, E), kr.reshape(-1, L, E), vr.reshape(-1, L, E), do.reshape(-1, L, E),
                         True, sc)
    o = cp.asarray(_bf16(ref["o"].reshape(B, Hq, L, E))[0])
    lse = cp.asarray(ref["lse"].reshape(B, Hk, G, L).transpose(2, 0, 1, 3).reshape(G, B * Hk, L).astype(np.float32))
    dq, dk, dv = sdpa_gqa.gqa_backward(cp.asarray(qb), cp.asarray(kb), cp.asarray(vb), o, lse, cp.asarray(db),
                                       True, sc, "bf16_wgmma")
    assert [e[0] for e in log] == ["preprocess", "bwd_fused", "bwd_dq_convert"] * G
    _close("dq", _f64(np.asarray(dq)).reshape(-1, L, E), ref["dq"])
    _close("dk", _f64(np.asarray(dk)), ref["dk"].reshape(B, Hk, G, L, E).sum(2))
    _close("dv", _f64(np.asarray(dv)), ref["dv"].reshape(B, Hk, G, L, E).sum(2))


# ---------------------------------------------------------------------------------------------------- GPU
def _sm90() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0 and int(cupy.cuda.Device().compute_capability) == 90
    except Exception:
        return False


@pytest.fixture
def gpu(monkeypatch):
    import cupy as cp

    for var in ("BLUTRAIN_SDPA_KERNEL", "BLUTRAIN_SDPA_BWD", "BLUTRAIN_DETERMINISTIC"):
        monkeypatch.delenv(var, raising=False)
    bt.policy.reset_defaults()
    with bt.policy.scope(attention_backward="fused"):  # the fused kernel is under test (at 128 'auto' keeps the pair)
        yield cp


def _gpu_dense(cp, BH, L, S, hd, causal):
    rng = np.random.default_rng(BH * L + hd)
    (qb, q), (kb, k), (vb, v), (db, do) = (_bf16(rng.standard_normal((BH, n, hd))) for n in (L, S, S, L))
    sc = 1.0 / math.sqrt(hd)
    gq, gk, gv, gdo = (cp.asarray(a) for a in (qb, kb, vb, db))
    o, lse = sdpa.flash_attention_forward(gq, gk, gv, causal, sc, "bf16_wgmma")

    def bwd():
        return tuple(g.get() for g in sdpa.flash_attention_backward(gq, gk, gv, o, lse, gdo, causal, sc,
                                                                     "bf16_wgmma"))

    return sdpa_reference(q, k, v, do, causal, sc), bwd


@pytest.mark.cuda
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("BH, L, S, hd, causal", CASES + [(7, 333, 333, 128, True)])
def test_cuda_fused_matches_float64(gpu, BH, L, S, hd, causal):
    """The fused kernel against float64; the split pair agrees within bf16 rounding."""
    cp = gpu
    assert sdpa.fused_backward("bf16_wgmma", hd)
    ref, bwd = _gpu_dense(cp, BH, L, S, hd, causal)
    fused = bwd()
    for name, g in zip(("dq", "dk", "dv"), fused):
        _close(name, _f64(g), ref[name])
    with bt.policy.scope(deterministic=True):
        split = bwd()
    for name, a, b in zip(("dq", "dk", "dv"), fused, split):
        _close(name, _f64(a), _f64(b))


@pytest.mark.cuda
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 (Hopper) GPU")
def test_cuda_split_path_is_bitwise_repeatable(gpu):
    """deterministic=True and attention_backward='split' run the split pair: bitwise repeatable; the fused kernel
    stays within the tolerance of it."""
    cp = gpu
    ref, bwd = _gpu_dense(cp, 2, 130, 130, 64, True)
    with bt.policy.scope(deterministic=True):
        g1, g2 = bwd(), bwd()
    with bt.policy.scope(attention_backward="split"):
        g3 = bwd()
    for a, b, c in zip(g1, g2, g3):
        assert (a == b).all() and (a == c).all()
    for name, a, b in zip(("dq", "dk", "dv"), bwd(), g1):
        _close(name, _f64(a), _f64(b))


@pytest.mark.cuda
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("B, T, H, hd, causal", [(2, 1000, 3, 64, True), (3, 77, 2, 128, False)])
def test_cuda_fused_qkv_fused_backward(gpu, B, T, H, hd, causal):
    """The fused-qkv strided path with the fused backward against float64."""
    cp = gpu
    rng = np.random.default_rng(T)
    qkvb, qkv = _bf16(rng.standard_normal((B, T, 3, H, hd)))
    dob, do = _bf16(rng.standard_normal((B, T, H, hd)))
    sc = 1.0 / math.sqrt(hd)
    g = cp.asarray(qkvb)
    o, lse = sdpa.qkv_attention_forward(g, causal, sc, "bf16_wgmma")
    assert sdpa.fused_backward("bf16_wgmma", hd)
    d = _f64(sdpa.qkv_attention_backward(g, o, lse, cp.asarray(dob), causal, sc, "bf16_wgmma").get())

    def heads(a):
        return a.transpose(0, 2, 1, 3).reshape(B * H, T, hd)

    ref = sdpa_reference(heads(qkv[:, :, 0]), heads(qkv[:, :, 1]), heads(qkv[:, :, 2]), heads(do), causal, sc)
    for j, name in enumerate(("dq", "dk", "dv")):
        _close(name, heads(d[:, :, j]), ref[name])


@pytest.mark.cuda
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 (Hopper) GPU")
def test_cuda_gqa_fused_backward(gpu):
    """F.scaled_dot_product_attention(enable_gqa=True) on the Hopper kernel (attention='wgmma'): the backward by
    the fused kernel per group member, against float64."""
    import blutensor.nn.functional as F

    B, Hq, Hk, L, E = 2, 8, 2, 333, 64
    rng = np.random.default_rng(9)
    (qb, q), (db, do) = (_bf16(rng.standard_normal((B, Hq, L, E))) for _ in range(2))
    (kb, k), (vb, v) = (_bf16(rng.standard_normal((B, Hk, L, E))) for _ in range(2))
    G, sc = Hq // Hk, 1 / 8

    def dev(a):
        t = bt.tensor(a.astype(np.float32), device="cuda").to(bt.bfloat16).detach()
        t.requires_grad = True
        return t

    ts = [dev(a) for a in (q, k, v)]
    with bt.policy.scope(attention="wgmma"):
        assert sdpa.fused_backward("bf16_wgmma", E)
        y = F.scaled_dot_product_attention(*ts, is_causal=True, scale=sc, enable_gqa=True)
        (y * bt.tensor(do.astype(np.float32), device="cuda").to(bt.bfloat16)).sum().to(bt.float32).backward()
    kr, vr = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    ref = sdpa_reference(q.reshape(-1, L, E), kr.reshape(-1, L, E), vr.reshape(-1, L, E), do.reshape(-1, L, E),
                         True, sc)
    got = [t.grad.detach().to(bt.float32).to("cpu").numpy().astype(np.float64) for t in ts]
    _close("dq", got[0].reshape(-1, L, E), ref["dq"])
    _close("dk", got[1], ref["dk"].reshape(B, Hk, G, L, E).sum(2))
    _close("dv", got[2], ref["dv"].reshape(B, Hk, G, L, E).sum(2))
