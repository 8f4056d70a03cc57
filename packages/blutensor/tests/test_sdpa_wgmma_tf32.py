"""The Hopper tf32 flash attention (variant 'tf32_wgmma': kernels/sdpa_wgmma_tf32.cu, backends/cupy/sdpa_wgmma_tf32.py).

CPU: the emulator of the kernel's index math (dev/emulate_sdpa_wgmma_tf32.py: 32-element swizzle rows, K-major k8
descriptors, the tf32 A fragment, the permuted keys of P and of the V^T scratch) reproduces float64 products tile
by tile and fails on a wrong address or permutation; its tile-by-tile forward stays within tf32 error of float64;
the policy field ``attention_tf32`` / ``BLUTRAIN_SDPA_TF32`` and the variant choice; the host code on the fake CUDA
device (sm_90), the launched kernels modelled in float64 through their raw pointers, tensor maps and layouts: dense
and fused-qkv forward (o, lse) and backward (head dim 64: the Hopper dK/dV and dQ kernels reading the transposed
scratches; 128 and attention_backward='fused': the mma.sync 'tf32' kernels).
GPU (cuda-marked, sm_90): o, lse, dq, dk, dv against float64 on odd shapes, each error at most 5x the mma.sync
'tf32' variant's + 1e-3 (its loaded operands are truncated, not rounded), the deterministic backward bitwise
repeatable, the fused-qkv strided path through autograd.
"""

from __future__ import annotations

import math
import struct
import sys
from pathlib import Path

import blutensor as bt
import numpy as np
import pytest
from attention_reference import sdpa_reference
from blutensor.backends.cupy import sdpa, sdpa_gqa, tma
from blutensor.backends.cupy import sdpa_wgmma_tf32 as wt

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "dev"))
sys.path.insert(0, str(ROOT.parents[1] / "testing"))
import emulate_sdpa_wgmma_tf32 as em  # noqa: E402
import fake_cuda  # noqa: E402

KERNEL = ROOT / "src" / "blutensor" / "backends" / "cupy" / "kernels" / "sdpa_wgmma_tf32.cu"
#: tf32 products of O(1) values: max |got - ref| / max(1, max |ref|)
TOL = {"o": 1e-2, "lse": 1e-2, "dq": 3e-2, "dk": 3e-2, "dv": 3e-2}


def _ints(rng, shape):
    """Small integers: exact in tf32 and in float64 products, so an emulated product must match exactly."""
    return rng.integers(-3, 4, shape).astype(np.float64)


# ------------------------------------------------------------------------------------------- emulator (CPU)
@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("cw", [0, 1])
def test_emulated_tile_products_match_float64(hd, cw):
    """S = Q K^T and P V of one consumer warpgroup, through TMA boxes, swizzle, descriptors and the A fragment,
    equal the float64 products; the key tile starts past 0 and runs over S (zero-filled K rows and V^T positions)."""
    bn = em.FWD_TILES[hd][0]
    rng = np.random.default_rng(hd + cw)
    S = bn + 13
    q, k, v = _ints(rng, (128, hd)), _ints(rng, (S, hd)), _ints(rng, (S, hd))
    for k0 in (0, bn):
        s, pv = em.forward_tile(q, k, v, cw, hd, k0=k0, round_tf32=False)
        kk = np.zeros((bn, hd))
        vv = np.zeros((bn, hd))
        n = min(bn, S - k0)
        kk[:n], vv[:n] = k[k0:k0 + n], v[k0:k0 + n]
        ref = q[64 * cw:64 * cw + 64] @ kk.T
        assert np.array_equal(s, ref)
        assert np.array_equal(pv, ref @ vv)


@pytest.mark.parametrize("cw", [0, 1])
def test_emulated_backward_tile_matches_float64(cw):
    """The backward tile: A X^T, B Y^T by SS, then (A X^T) Y and (B Y^T) X as RS products whose B operands are the
    transposed streamed tiles (Y^T, X^T) with the permuted positions."""
    hd = 64
    rng = np.random.default_rng(11 + cw)
    a, b = _ints(rng, (128, hd)), _ints(rng, (128, hd))
    x, y = _ints(rng, (64, hd)), _ints(rng, (64, hd))
    s, dp, ps, pd = em.backward_tile(a, b, x, y, cw, hd, round_tf32=False)
    A, B = a[64 * cw:64 * cw + 64], b[64 * cw:64 * cw + 64]
    assert np.array_equal(s, A @ x.T) and np.array_equal(dp, B @ y.T)
    assert np.array_equal(ps, A @ x.T @ y) and np.array_equal(pd, B @ y.T @ x)


@pytest.mark.parametrize("wrong", ["kstep", "box", "perm", "pack"])
def test_emulated_products_fail_on_a_wrong_address(monkeypatch, wrong):
    """Each piece of index math matters: a k-step offset of 16 bytes (bf16's half step), boxes laid out with the
    wrong row count, V^T without the key permutation, or P registers in accumulator order all break P V or S."""
    hd, cw = 64, 0
    bn = em.FWD_TILES[hd][0]
    rng = np.random.default_rng(5)
    q, k, v = _ints(rng, (128, hd)), _ints(rng, (bn, hd)), _ints(rng, (bn, hd))
    if wrong == "kstep":
        monkeypatch.setattr(em, "kmajor", lambda b, r, r0, j: (b + (j >> 2) * r * 128 + r0 * 128 + (j & 3) * 16,
                                                               16, 1024))
    elif wrong == "box":
        monkeypatch.setattr(em, "kmajor", lambda b, r, r0, j: (b + (j >> 2) * 64 * 128 + r0 * 128 + (j & 3) * 32,
                                                               16, 1024))
    elif wrong == "perm":
        monkeypatch.setattr(em, "perm8", lambda p: p)
    else:
        monkeypatch.setattr(em, "pack_p", lambda s, round_tf32=True: s)
    s, pv = em.forward_tile(q, k, v, cw, hd, round_tf32=False)
    ref = q[:64] @ k.T
    assert not (np.array_equal(s, ref) and np.array_equal(pv, ref @ v))


@pytest.mark.parametrize("L, S, hd, causal", [(77, 77, 128, True), (200, 300, 64, False), (150, 150, 64, True)])
def test_emulated_forward_within_tf32_error(L, S, hd, causal):
    """The tile-by-tile forward (truncated Q, K; rounded V, P; the kernel's masks and causal tile bounds) against
    float64 softmax attention: tf32 error, no masking mistakes (which would be O(1))."""
    rng = np.random.default_rng(L + S)
    q, k, v = (rng.standard_normal((n, hd)) for n in (L, S, S))
    sc = 1 / math.sqrt(hd)
    o, lse = em.forward(q, k, v, causal, sc)
    ref = sdpa_reference(q[None], k[None], v[None], np.zeros((1, L, hd)), causal, sc)
    assert np.abs(o - ref["o"][0]).max() < 5e-3
    assert np.abs(lse - ref["lse"][0]).max() < 5e-3


@pytest.mark.parametrize("L, S, causal", [(1000, 1000, True), (77, 77, False), (200, 300, False),
                                         (333, 333, True), (300, 200, True), (100, 400, True)])
def test_mbarrier_protocol_terminates_and_never_overwrites(L, S, causal):
    """The kernels' producer / consumer loops over their mbarriers (emulator model: Q buffers, stages, the one own
    buffer of the backward, causal skips, releases one tile late) under random interleavings on 1, 3 and many CTAs:
    no deadlock, every tile a consumer reads is the one it expects, every tile consumed."""
    BH = 3
    for ctas in (1, 3, 64):
        for hd in (64, 128):
            bn = em.FWD_TILES[hd][0]
            want = sum(-(-(min(S, q0 + 128) if causal else S) // bn) for q0 in range(0, L, 128)) * BH * 8
            assert em.simulate_forward(L, S, causal, hd, BH, ctas, seed=ctas + hd) == want
        for dkdv, st in ((True, wt.BWD_STAGES[64][0]), (False, wt.BWD_STAGES[64][1])):
            assert em.simulate_backward(L, S, causal, dkdv, BH, ctas, st, seed=ctas) > 0


def test_tf32_rounding_model():
    """tf32_rna rounds to 10 mantissa bits, ties away from zero (cvt.rna); tf32_trunc drops the low 13 bits."""
    one = np.float32(1.0)
    ulp = 2.0 ** -10
    x = np.array([1 + ulp / 2, 1 + ulp / 2 - 2 ** -20, -(1 + ulp / 2), 1 + 3 * ulp / 4], np.float32)
    assert list(em.tf32_rna(x)) == [1 + ulp, 1.0, -(1 + ulp), 1 + ulp]
    assert list(em.tf32_trunc(x)) == [1.0, 1.0, -1.0, 1.0]
    assert em.tf32_rna(one) == 1.0


def test_emulator_spells_the_kernels_address_math():
    """The kernel text holds the formulas the emulator models (a change to one must change the other)."""
    src = KERNEL.read_text()
    for needle in ("(j >> 2) * rows_box * 128 + row0 * 128 + (j & 3) * 32), 16, 1024)",
                   "s[4 * kk + 1] = __uint_as_float(rna(b));", "s[4 * kk + 2] = __uint_as_float(rna(a));",
                   "blu_tma_load4(x + 2 * TILE + c * HD * 128, tmXT, x0 + c * BOX, 0, hh, bb, full + 8 * s);",
                   "const unsigned x = sX + st * NT * TILE, y = x + TILE, xt = x + 2 * TILE, yt = x + 3 * TILE;",
                   "rs_product_f<64, HD>(acc1, sv, yt);  // dV += P^T dO",
                   "rs_product_f<64, HD>(acc0, dp, xt);  // dK += dS^T Q",
                   "WGMMA_TF32_BWD_ENTRIES(64, 2, 3)",
                   "blu_mbar_wait(qempty + 8 * qb, ((n / QB) & 1) ^ 1);",
                   "blu_mbar_wait(qfull + 8 * qb, (n / QB) & 1);",
                   "blu_mbar_wait(oempty, (n & 1) ^ 1);", "blu_mbar_wait(ofull, n & 1);",
                   "if (lane == 0) blu_mbar_arrive(empty + 8 * pending);",
                   "return (p & 4) ? 2 * (p & 3) + 1 : 2 * p;",
                   "p[4 * kk + 1] = rna(s[4 * kk + 2]);",
                   "p[4 * kk + 2] = rna(s[4 * kk + 1]);",
                   "const int kl = 8 * (tx >> 3) + perm8(tx & 7);",
                   "blu_tma_load4(k + KTILE + c * HD * 128, tmVt, it * BN + c * BOX, 0, hh, bb, full + 8 * s);",
                   "WGMMA_TF32_ENTRIES(64, 128, 2, 2)", "WGMMA_TF32_ENTRIES(128, 64, 1, 2)",
                   "blu-nvrtc-archs: 90a"):
        assert needle in src, needle
    assert em.FWD_TILES == wt.FWD_TILES


def test_shared_memory_fits_hopper():
    for hd in wt.HDS:
        assert wt.fwd_smem(hd) <= 227 * 1024
    assert wt.fwd_smem(64) == 1024 + 2 * 128 * 64 * 4 + 2 * 2 * 128 * 64 * 4 + 8 * 8
    for dkdv in (True, False):
        assert wt.bwd_smem(64, dkdv) <= 227 * 1024
    assert wt.bwd_smem(64, True) == 1024 + 2 * 128 * 64 * 4 + 2 * 4 * 64 * 64 * 4 + 8 * 6
    assert wt.bwd_smem(64, False) == 1024 + 2 * 128 * 64 * 4 + 3 * 3 * 64 * 64 * 4 + 8 * 8


# --------------------------------------------------------------------------------------- policy and choice
@pytest.fixture
def device(monkeypatch):
    """A fake sm_90 device with H200 shared memory; restores the matmul precision."""
    from blutensor.gemm import get_matmul_precision

    state = {"cc": 90, "smem": 227 * 1024}
    monkeypatch.setattr(sdpa, "_compute_capability", lambda: state["cc"])
    monkeypatch.setattr(sdpa, "smem_optin", lambda: state["smem"])
    for var in ("BLUTRAIN_SDPA_TF32", "BLUTRAIN_SDPA_BWD", "BLUTRAIN_DETERMINISTIC", "BLUTRAIN_SDPA_KERNEL"):
        monkeypatch.delenv(var, raising=False)
    bt.policy.reset_defaults()
    prec = get_matmul_precision()
    yield state
    bt.set_matmul_precision(prec)


def test_policy_field_and_environment(monkeypatch):
    assert bt.ExecutionPolicy().attention_tf32 == "auto"
    assert bt.ExecutionPolicy.from_env({"BLUTRAIN_SDPA_TF32": "wgmma"}).attention_tf32 == "wgmma"
    assert bt.ExecutionPolicy.from_env({"BLUTRAIN_SDPA_TF32": "mma"}).attention_tf32 == "mma"
    with pytest.raises(ValueError, match="BLUTRAIN_SDPA_TF32"):
        bt.ExecutionPolicy.from_env({"BLUTRAIN_SDPA_TF32": "fast"})
    with pytest.raises(ValueError, match="attention_tf32"):
        bt.ExecutionPolicy(attention_tf32="wgmma2")
    assert wt.SDPA_TF32 == bt.policy.CHOICES["attention_tf32"]


def test_pick_variant_tf32_wgmma(device):
    f32, u16 = np.dtype(np.float32), np.dtype(np.uint16)
    for prec in ("tf32", "bf16"):
        bt.set_matmul_precision(prec)
        assert sdpa.pick_variant(f32, 64) == "tf32_wgmma"  # default 'auto' on sm_90
        assert sdpa.pick_variant(f32, 32) == "f32"
        with bt.policy.scope(attention_tf32="mma"):
            assert sdpa.pick_variant(f32, 64) == "tf32"
        with bt.policy.scope(attention_tf32="wgmma"):
            assert sdpa.pick_variant(f32, 64) == "tf32_wgmma"
            assert sdpa.pick_variant(f32, 128) == "tf32_wgmma"
            assert sdpa.pick_variant(f32, 32) == "f32"  # a head dim the matrix-unit kernels lack
            assert sdpa.pick_variant(u16, 64) == "bf16_wgmma"  # bf16 unaffected
    bt.set_matmul_precision("fp32")
    with bt.policy.scope(attention_tf32="wgmma"):
        assert sdpa.pick_variant(f32, 64) == "tf32x3"  # strict fp32 is not tf32
    bt.set_matmul_precision("tf32")
    device["cc"] = 80
    assert sdpa.pick_variant(f32, 64) == "tf32"  # 'auto' off sm_90: the mma.sync kernels
    with bt.policy.scope(attention_tf32="wgmma"), pytest.raises(ValueError, match="sm_90.*sm_80"):
        sdpa.pick_variant(f32, 64)


def test_backward_choice_and_gqa(device):
    """'tf32_wgmma''s backward: its own (deterministic) at head dim 64 under 'auto', 'split' and deterministic
    algorithms; the mma.sync 'tf32' one at head dim 128 and under 'fused' (the atomic-dQ kernel); grouped-query
    attention keeps 'tf32'."""
    assert sdpa.backward_variant("tf32_wgmma", 64) == "tf32_wgmma"
    assert sdpa.backward_variant("tf32_wgmma", 128) == "tf32"
    with bt.policy.scope(attention_backward="split"):
        assert sdpa.backward_variant("tf32_wgmma", 64) == "tf32_wgmma"
    with bt.policy.scope(attention_backward="fused"):
        assert sdpa.backward_variant("tf32_wgmma", 64) == "tf32"
        with bt.policy.scope(deterministic=True):
            assert sdpa.backward_variant("tf32_wgmma", 64) == "tf32_wgmma"
    assert sdpa.backward_variant("bf16_wgmma", 64) == "bf16_wgmma" and sdpa.backward_variant("tf32", 64) == "tf32"
    assert sdpa_gqa.strided_variant("tf32_wgmma", np.float32, 64) == "tf32"
    assert sdpa.supports("tf32_wgmma", 64) and not sdpa.supports("tf32_wgmma", 32)


# ------------------------------------------------------------------------- host code on the fake device (CPU)
def _signatures() -> dict:
    """Entry suffix ('fwd', 'transpose', 'bwd_dkdv', ...) -> the C parameter types of the kernel file's macros."""
    import re

    text = KERNEL.read_text().replace("\\\n", " ").replace("BLU_TM", "BluTmap")
    sigs = {}
    for m in re.finditer(r"blu_sdpa_wgmma_tf32_hd##HD##_(\w+)\(([^)]*)\)", text):
        types = []
        for a in m.group(2).split(","):
            a = " ".join(a.split())
            types.append("tmap" if "BluTmap" in a else "ptr" if "*" in a else "i64" if "long long" in a
                         else "f32" if a.startswith("float") else "i32")
        sigs[m.group(1)] = types
    return sigs


SIGS = _signatures()


def _check_args(entry: str, args) -> None:
    """The launch's arguments match the kernel's C signature in count and scalar types (a mismatch on the GPU reads
    garbage past the parameters)."""
    want = SIGS[entry]
    assert len(args) == len(want), (entry, len(args), len(want))
    for i, (a, w) in enumerate(zip(args, want)):
        got = ("tmap" if isinstance(a, np.ndarray) and a.dtype == tma.TMAP_DTYPE else
               "ptr" if hasattr(a, "data") and hasattr(a.data, "ptr") else
               {np.int32: "i32", np.int64: "i64", np.float32: "f32"}.get(type(a)))
        assert got == w, (entry, i, got, w)


def test_signatures_parsed():
    assert set(SIGS) == {"fwd", "transpose", "preprocess", "bwd_dkdv", "bwd_dq"}
    assert SIGS["fwd"][:3] == ["tmap"] * 3 and SIGS["bwd_dkdv"][:6] == ["tmap"] * 6 and len(SIGS["bwd_dq"]) == 17


def _through(spec, name):
    """(B*H, rows, cols) float64 view of the fp32 memory a tensor map describes (dims innermost first)."""
    inner, rows, H, B = spec.dims
    st, sh, sb = (s // 4 for s in spec.strides)
    return fake_cuda.host_view(spec.ptr, np.float32, (B, H, rows, inner), (sb, sh, st, 1)).reshape(B * H, rows,
                                                                                                    inner)


def _model(log, specs):
    """float64 models of the launched kernels, by entry name, reading and writing through their arguments."""

    def spec(arr):
        return specs[struct.unpack("<Q", np.asarray(arr).tobytes()[:8])[0]]

    def launch_tf32(file, name, grid, block, args, shared_mem=0):
        assert file == wt.FILE
        hd = int(name.split("_hd")[1].split("_")[0])
        kind = name.rsplit("_", 1)[1]
        log.append((kind, grid, block, shared_mem))
        _check_args(name.split(f"_hd{hd}_")[1], args)
        if kind == "transpose":
            v, vt, S, sp, H, sb, sh, st = args
            S, sp, H = int(S), int(sp), int(H)
            assert grid == (math.ceil(sp / 32), hd // 32, grid[2]) and block == (32, 8)
            BH = grid[2]
            vv = fake_cuda.host_view(v.data.ptr, np.float32, (BH // H, H, S, hd), (int(sb), int(sh), int(st), 1))
            out = fake_cuda.host_view(vt.data.ptr, np.float32, (BH, hd, sp))
            for bh, x in enumerate(np.asarray(vv, np.float64).reshape(BH, S, hd)):
                out[bh] = em.vt_prep(x)
            return
        if kind == "preprocess":
            do, o, D, rows, L, H, sb, sh, st = args
            BH, L, H = int(rows) // int(L), int(L), int(H)
            lay = (int(sb), int(sh), int(st), 1)
            d_o, oo = (fake_cuda.host_view(a.data.ptr, np.float32, (BH // H, H, L, hd), lay) for a in (do, o))
            D[...] = (np.asarray(d_o, np.float64) * np.asarray(oo, np.float64)).sum(-1).reshape(D.shape)
            return
        if kind in ("dkdv", "dq"):
            return bwd(kind, hd, args, grid, shared_mem)
        assert kind == "fwd"
        tq, tk, tvt, o, lse, L, S, sc, causal, H, BH, sb, sh, st = args
        L, S, H, BH, sc, causal = int(L), int(S), int(H), int(BH), float(sc), bool(causal)
        sq, sk, svt = spec(tq), spec(tk), spec(tvt)
        bn = wt.FWD_TILES[hd][0]
        assert sq.box == (32, 128, 1, 1) and sk.box == (32, bn, 1, 1) and svt.box == (32, hd, 1, 1)
        assert tma.spec_problem(sq) == tma.spec_problem(sk) == tma.spec_problem(svt) == ""
        Q, K, VT = (np.asarray(_through(s, n), np.float64) for s, n in ((sq, "q"), (sk, "k"), (svt, "vt")))
        assert Q.shape == (BH, L, hd) and K.shape == (BH, S, hd) and VT.shape[:2] == (BH, hd)
        V = np.zeros((BH, S, hd))
        for p in range(VT.shape[2]):  # back from the permuted positions
            key = 8 * (p >> 3) + em.perm8(p & 7)
            if key < S:
                V[:, key] = VT[:, :, p]
        ref = sdpa_reference(em.tf32_trunc(Q), em.tf32_trunc(K), V, np.zeros_like(Q), causal, sc)
        out = fake_cuda.host_view(o.data.ptr, np.float32, (BH // H, H, L, hd), (int(sb), int(sh), int(st), 1))
        out[...] = ref["o"].reshape(BH // H, H, L, hd)
        lse[...] = ref["lse"].astype(np.float32).reshape(lse.shape)
        assert grid == wt.grid(L, BH) and block == wt.THREADS and shared_mem == wt.fwd_smem(hd)

    def untranspose(arr, n, rows):
        """(BH, n, HD) back from a transposed scratch's map (positions permuted in groups of 8)."""
        sp = spec(arr)
        assert sp.box == (32, sp.dims[1], 1, 1) and tma.spec_problem(sp) == ""
        X = np.asarray(_through(sp, "t"), np.float64)
        out = np.zeros((X.shape[0], n, X.shape[1]))
        for p in range(X.shape[2]):
            r = 8 * (p >> 3) + em.perm8(p & 7)
            if r < n:
                out[:, r] = X[:, :, p]
        return out

    def rows_of(arr, box_rows):
        sp = spec(arr)
        assert sp.box == (32, box_rows, 1, 1) and tma.spec_problem(sp) == ""
        return np.asarray(_through(sp, "x"), np.float64)

    def bwd(kind, hd, args, grid, shared_mem):
        if kind == "dkdv":
            tk, tv, tq, tdo, tqt, tdot, lse, D, dk, dv, L, S, sc, causal, H, BH, sb, sh, st = args
            K, V = rows_of(tk, 128), rows_of(tv, 128)
            Q, dO = rows_of(tq, 64), rows_of(tdo, 64)
            Qt, dOt = untranspose(tqt, int(L), 64), untranspose(tdot, int(L), 64)  # the B operands of dK, dV
        else:
            tq, tdo, tk, tv, tkt, lse, D, dq, L, S, sc, causal, H, BH, sb, sh, st = args
            Q, dO = rows_of(tq, 128), rows_of(tdo, 128)
            K, V = rows_of(tk, 64), rows_of(tv, 64)
            Kt = untranspose(tkt, int(S), 64)
        L, S, sc, causal, H, BH = int(L), int(S), float(sc), bool(causal), int(H), int(BH)
        s = Q @ K.transpose(0, 2, 1) * sc
        if causal:
            s = np.where(np.triu(np.ones((L, S), bool), 1), -np.inf, s)
        P = np.exp(s - np.asarray(lse, np.float64).reshape(BH, L)[..., None])
        dS = P * (dO @ V.transpose(0, 2, 1) - np.asarray(D, np.float64).reshape(BH, L)[..., None])
        lay = (int(sb), int(sh), int(st), 1)

        def put(a, n, x):
            fake_cuda.host_view(a.data.ptr, np.float32, (BH // H, H, n, hd), lay)[...] = x.reshape(BH // H, H, n, hd)

        if kind == "dkdv":
            put(dk, S, dS.transpose(0, 2, 1) @ Qt * sc)
            put(dv, S, P.transpose(0, 2, 1) @ dOt)
        else:
            put(dq, L, dS @ Kt * sc)
        assert grid == wt.grid(S if kind == "dkdv" else L, BH)
        assert shared_mem == wt.bwd_smem(hd, kind == "dkdv")

    def launch_bwd(file, name, grid, block, args, shared_mem=0):
        log.append((name, grid, block, shared_mem))
        if name.startswith("blu_sdpa_backward_preprocess"):
            do, o, D, rows, hd = args
            D[...] = (np.asarray(do, np.float64) * np.asarray(o, np.float64)).sum(-1).reshape(D.shape)
            return
        assert file == "sdpa_mma.cu" and name.endswith(f"tf32_hd{args[0].shape[-1]}"), name
        q, k, v, do, lse, D, *outs = args
        L, S, sc, causal = (x for x in outs[-4:])
        Q, K, V, dO = (np.asarray(a, np.float64) for a in (q, k, v, do))
        s = Q @ K.transpose(0, 2, 1) * float(sc)
        if bool(causal):
            s = np.where(np.triu(np.ones((int(L), int(S)), bool), 1), -np.inf, s)
        P = np.exp(s - np.asarray(lse, np.float64)[..., None])
        dS = P * (dO @ V.transpose(0, 2, 1) - np.asarray(D, np.float64)[..., None])
        if "_dq_" in name:
            outs[0][...] = dS @ K * float(sc)
        else:
            outs[0][...] = dS.transpose(0, 2, 1) @ Q * float(sc)
            outs[1][...] = P.transpose(0, 2, 1) @ dO

    return launch_tf32, launch_bwd


@pytest.fixture
def fake(monkeypatch, device):
    """The host code of sdpa_wgmma_tf32 / sdpa on the shared fake device (sm_90), the kernels modelled in float64,
    tensor maps encoded as an index into the specs the host built (checked by TMA's rules first)."""
    cp = fake_cuda.install(monkeypatch, compute_capability=90)
    log, specs = [], []

    def encode(spec):
        specs.append(spec)
        return struct.pack("<Q", len(specs) - 1) + bytes(120)

    tma.clear_cache()
    monkeypatch.setattr(tma, "driver_encode", encode)
    launch_tf32, launch_bwd = _model(log, specs)
    monkeypatch.setattr(wt, "cupy", lambda: cp)
    monkeypatch.setattr(sdpa, "cupy", lambda: cp)
    monkeypatch.setattr(wt, "launch", launch_tf32)
    monkeypatch.setattr(sdpa, "launch", launch_bwd)
    monkeypatch.setattr(wt, "num_sms", lambda: 132)
    bt.set_matmul_precision("tf32")
    with bt.policy.scope(attention_tf32="wgmma", attention_backward="split"):
        yield cp, log
    tma.clear_cache()


def _errors(got: dict, want: dict) -> dict:
    return {n: float(np.abs(got[n] - want[n]).max() / max(1.0, np.abs(want[n]).max())) for n in got}


@pytest.mark.parametrize("BH, L, S, hd, causal", [(1, 1000, 1000, 64, True), (3, 77, 77, 128, False),
                                                 (2, 200, 300, 64, False), (2, 333, 333, 128, True)])
def test_dense_host_path_matches_float64(fake, BH, L, S, hd, causal):
    """CPU twin of test_cuda_tf32_wgmma_matches_float64_and_mma_sync: the V^T transpose then the forward (grid,
    threads, shared memory, tensor maps, o's layout), o and lse within tf32 error; the backward launches the
    preprocess and the mma.sync 'tf32' dK/dV and dQ kernels, dq/dk/dv within tf32 error."""
    cp, log = fake
    rng = np.random.default_rng(BH * L + S + hd)
    q, k, v, do = (rng.standard_normal((BH, n, hd)).astype(np.float32) for n in (L, S, S, L))
    sc = 1 / math.sqrt(hd)
    want = sdpa_reference(*(a.astype(np.float64) for a in (q, k, v, do)), causal, sc)
    assert sdpa.pick_variant(np.dtype(np.float32), hd) == "tf32_wgmma"
    gq, gk, gv, gdo = (cp.asarray(a) for a in (q, k, v, do))
    o, lse = sdpa.flash_attention_forward(gq, gk, gv, causal, sc, "tf32_wgmma")
    assert [e[0] for e in log] == ["transpose", "fwd"]
    dq, dk, dv = sdpa.flash_attention_backward(gq, gk, gv, o, lse, gdo, causal, sc, "tf32_wgmma")
    names = [e[0] for e in log[2:]]
    if hd == 64:  # the Hopper backward
        assert names == ["preprocess", "transpose", "transpose", "transpose", "dkdv", "dq"]
        with bt.policy.scope(deterministic=True):
            again = sdpa.flash_attention_backward(gq, gk, gv, o, lse, gdo, causal, sc, "tf32_wgmma")
        assert all((np.asarray(a) == np.asarray(b)).all() for a, b in zip((dq, dk, dv), again))
    else:
        assert names == ["blu_sdpa_backward_preprocess_f32", f"blu_sdpa_backward_dkdv_tf32_hd{hd}",
                         f"blu_sdpa_backward_dq_tf32_hd{hd}"]
    got = {"o": np.asarray(o, np.float64), "lse": np.asarray(lse, np.float64)}
    got.update(zip(("dq", "dk", "dv"), (np.asarray(g, np.float64) for g in (dq, dk, dv))))
    for n, e in _errors(got, want).items():
        assert e <= TOL[n], (n, e)


@pytest.mark.parametrize("B, T, H, hd, causal", [(2, 150, 3, 64, True), (1, 77, 2, 128, False)])
def test_fused_qkv_host_path_matches_float64(fake, B, T, H, hd, causal):
    """CPU twin of the fused-qkv GPU test: q/k/v strided views of one (B, T, 3, H, HD) projection read through
    4-D tensor maps, V^T made from v's strided layout, o written as (B, T, H, HD); the backward writes dqkv."""
    cp, log = fake
    rng = np.random.default_rng(T + H)
    qkv = rng.standard_normal((B, T, 3, H, hd)).astype(np.float32)
    do = rng.standard_normal((B, T, H, hd)).astype(np.float32)
    sc = 1 / math.sqrt(hd)

    def heads(a):
        return np.asarray(a, np.float64).transpose(0, 2, 1, 3).reshape(B * H, T, hd)

    want = sdpa_reference(heads(qkv[:, :, 0]), heads(qkv[:, :, 1]), heads(qkv[:, :, 2]), heads(do), causal, sc)
    o, lse = sdpa.qkv_attention_forward(cp.asarray(qkv), causal, sc, "tf32_wgmma")
    assert [e[0] for e in log] == ["transpose", "fwd"]
    got = {"o": heads(o), "lse": np.asarray(lse, np.float64)}
    for n, e in _errors(got, want).items():
        assert e <= TOL[n], (n, e)
    log.clear()

    def launch_strided(file, name, grid, block, args, shared_mem=0):
        log.append(name)
        if "preprocess" in name:
            d_o, oo, D = args[:3]
            D[...] = (heads(d_o) * heads(oo)).sum(-1)
            return
        assert file == "sdpa_mma.cu" and f"_strided_tf32_hd{hd}" in name, name
        q, k, v, d_o, ls, D, *outs = args
        s = heads(q) @ heads(k).transpose(0, 2, 1) * sc
        if causal:
            s = np.where(np.triu(np.ones((T, T), bool), 1), -np.inf, s)
        P = np.exp(s - np.asarray(ls, np.float64)[..., None])
        dS = P * (heads(d_o) @ heads(v).transpose(0, 2, 1) - np.asarray(D, np.float64)[..., None])

        def put(dst, x):
            dst[...] = x.reshape(B, H, T, hd).transpose(0, 2, 1, 3)

        if "_dq_" in name:
            put(outs[0], dS @ heads(k) * sc)
        else:
            put(outs[0], dS.transpose(0, 2, 1) @ heads(q) * sc)
            put(outs[1], P.transpose(0, 2, 1) @ heads(d_o))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sdpa, "launch", launch_strided)
        dqkv = sdpa.qkv_attention_backward(cp.asarray(qkv), o, lse, cp.asarray(do), causal, sc, "tf32_wgmma")
    if hd == 64:  # the Hopper backward through the strided maps and layouts
        assert [e[0] for e in log] == ["preprocess", "transpose", "transpose", "transpose", "dkdv", "dq"]
    else:
        assert log == ["blu_sdpa_backward_preprocess_strided_f32", f"blu_sdpa_backward_dkdv_strided_tf32_hd{hd}",
                       f"blu_sdpa_backward_dq_strided_tf32_hd{hd}"]
    got = {n: heads(np.asarray(dqkv)[:, :, j]) for j, n in enumerate(("dq", "dk", "dv"))}
    for n, e in _errors(got, want).items():
        assert e <= TOL[n], (n, e)


def test_bad_input_is_refused_by_name(fake):
    cp, _ = fake
    q = cp.asarray(np.zeros((1, 8, 64), np.float32))
    with pytest.raises(bt.errors.ShapeError, match="head dim 96"):
        wt.forward(cp.asarray(np.zeros((1, 8, 96), np.float32)), q, q, q, q, False, None)
    with pytest.raises(bt.errors.ShapeError, match="k must be float32"):
        wt.forward(q, q.astype(np.float64), q, q, q, False, None)


# ---------------------------------------------------------------------------------------------------- GPU
def _sm90() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0 and int(cupy.cuda.Device().compute_capability) == 90
    except Exception:  # noqa: BLE001 - no CuPy, no driver
        return False


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 (Hopper) GPU")
DENSE = [(4, 1000, 1000, 64, True), (5, 77, 77, 128, False), (3, 200, 300, 64, False), (3, 333, 333, 128, True),
         (2, 300, 200, 128, False), (2, 1000, 1000, 128, False)]
QKV = [(2, 1000, 3, 64, True), (3, 77, 2, 128, True), (1, 300, 5, 64, False)]


@pytest.fixture(scope="module")
def mbarrier_watchdog():
    """sdpa_wgmma_tf32.cu built with BLU_MBAR_SPIN_LIMIT for this module's GPU tests (a deadlock traps instead of
    hanging; fresh module, function and shared-memory opt-in caches, the earlier ones restored after)."""
    from blutensor.backends.cupy import _loader

    plain = _loader.source

    def watched(file: str) -> str:
        text = plain(file)
        return "#define BLU_MBAR_SPIN_LIMIT (1u << 24)\n" + text if file == wt.FILE else text

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_loader, "source", watched)
        mp.setattr(_loader, "_modules", {})
        mp.setattr(_loader, "_functions", {})
        mp.setattr(_loader, "_smem_set", {})
        yield


@pytest.fixture
def gpu(monkeypatch, mbarrier_watchdog):
    """Matmul precision 'tf32' (restored after), policy defaults from a clean environment."""
    from blutensor.gemm import get_matmul_precision

    for var in ("BLUTRAIN_SDPA_TF32", "BLUTRAIN_SDPA_BWD", "BLUTRAIN_DETERMINISTIC"):
        monkeypatch.delenv(var, raising=False)
    bt.policy.reset_defaults()
    prec = get_matmul_precision()
    bt.set_matmul_precision("tf32")
    yield
    bt.set_matmul_precision(prec)


def _check(fast: dict, other: dict) -> None:
    for n, e in fast.items():
        assert e <= TOL[n], f"tf32_wgmma {n}: {e:.3g} > {TOL[n]}"
        assert other[n] <= TOL[n], f"tf32 {n}: {other[n]:.3g} > {TOL[n]}"
        # Q, K, V and dO reach the tensor cores truncated to tf32 (as TMA loads them; the mma.sync kernels round
        # every operand), so the errors run up to ~4x the rounding kernel's on the H200 (dq, 2x300x200, HD 128:
        # 3.1e-3 vs 7.3e-4, through the forward's O and lse); the bound is 5x + 1e-3.
        assert e <= 5 * other[n] + 1e-3, f"tf32_wgmma {n}: {e:.3g} vs mma.sync tf32's {other[n]:.3g}"


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("BH, L, S, hd, causal", DENSE)
def test_cuda_tf32_wgmma_matches_float64_and_mma_sync(gpu, BH, L, S, hd, causal):
    import cupy as cp

    rng = np.random.default_rng(BH * L + 7 * S + hd)
    q, k, v, do = (rng.standard_normal((BH, n, hd)).astype(np.float32) for n in (L, S, S, L))
    sc = 1.0 / math.sqrt(hd)
    want = sdpa_reference(*(a.astype(np.float64) for a in (q, k, v, do)), causal, sc)
    gq, gk, gv, gdo = (cp.asarray(a) for a in (q, k, v, do))
    errs = {}
    for variant in ("tf32_wgmma", "tf32"):
        o, lse = bt.ext.flash_attention_forward(gq, gk, gv, causal, sc, variant)
        g = bt.ext.flash_attention_backward(gq, gk, gv, o, lse, gdo, causal, sc, variant)
        got = {"o": o.get().astype(np.float64), "lse": lse.get().astype(np.float64)}
        got.update(zip(("dq", "dk", "dv"), (x.get().astype(np.float64) for x in g)))
        errs[variant] = _errors(got, want)
    _check(errs["tf32_wgmma"], errs["tf32"])
    o, lse = bt.ext.flash_attention_forward(gq, gk, gv, causal, sc, "tf32_wgmma")
    o2, lse2 = bt.ext.flash_attention_forward(gq, gk, gv, causal, sc, "tf32_wgmma")
    assert bool((o == o2).all()) and bool((lse == lse2).all())
    with bt.policy.scope(deterministic=True):
        first = bt.ext.flash_attention_backward(gq, gk, gv, o, lse, gdo, causal, sc, "tf32_wgmma")
        again = bt.ext.flash_attention_backward(gq, gk, gv, o, lse, gdo, causal, sc, "tf32_wgmma")
    for a, b in zip(first, again):
        assert bool((a == b).all())


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("B, T, H, hd, causal", QKV)
def test_cuda_tf32_wgmma_fused_qkv_matches_float64_and_mma_sync(gpu, B, T, H, hd, causal):
    """GPT-2's path: bt.ext.sdpa_qkv through autograd on a (B, T, 3C) fp32 tensor under precision 'tf32'."""
    rng = np.random.default_rng(B * T + H + hd)
    qkv = rng.standard_normal((B, T, 3, H, hd))
    do = rng.standard_normal((B, T, H, hd))

    def heads(a):
        return a.reshape(B, T, H, hd).transpose(0, 2, 1, 3).reshape(B * H, T, hd)

    want = sdpa_reference(heads(qkv[:, :, 0]), heads(qkv[:, :, 1]), heads(qkv[:, :, 2]), heads(do), causal,
                          1 / math.sqrt(hd))
    errs = {}
    for kernel in ("wgmma", "mma"):
        with bt.policy.scope(attention_tf32=kernel):
            x = bt.tensor(qkv.reshape(B, T, 3 * H * hd).astype(np.float32), device="cuda", requires_grad=True)
            g = bt.tensor(do.reshape(B, T, H * hd).astype(np.float32), device="cuda")
            y = bt.ext.sdpa_qkv(x, H, is_causal=causal)
            y.backward(g)
        d = x.grad.cpu().numpy().astype(np.float64).reshape(B, T, 3, H, hd)
        got = {"o": heads(y.detach().cpu().numpy().astype(np.float64))}
        got.update(zip(("dq", "dk", "dv"), (heads(d[:, :, j]) for j in range(3))))
        errs[kernel] = _errors(got, {n: want[n] for n in got})
    _check(errs["wgmma"], errs["mma"])
