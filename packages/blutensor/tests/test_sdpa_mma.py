"""Flash attention on the matrix units (kernels/sdpa_mma.cu): the tf32x3 variant (fp32 on the matrix units).

CPU: the 3xTF32 fragment math of the lane-level emulation (dev/emulate_sdpa_mma.py) against float64 -- fp32-level
error, far below plain TF32's; the emulated tf32x3 flash attention (forward and backward, split and fused) at the
same tolerances as the SIMT fp32 kernel; NVRTC compiles every entry; ``pick_variant``'s and ``fused_backward``'s
choices; the deterministic switch. GPU (cuda-marked):
the kernels against the float64 reference at the same tolerances (the CPU twin is the emulation test).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import blutensor as bt
import numpy as np
import pytest
from blutensor.backends.cupy import sdpa

DEV = Path(__file__).resolve().parents[1] / "dev"
sys.path.insert(0, str(DEV))
import emulate_sdpa_mma as em  # noqa: E402
import kernel_reference as ref  # noqa: E402

KDIR = Path(bt.__file__).resolve().parent / "backends" / "cupy" / "kernels"
RNG = np.random.default_rng(11)


def _frag_err(X, n=30):
    errs = []
    for _ in range(n):
        A = RNG.standard_normal((16, X.KS)).astype(np.float32)
        B = RNG.standard_normal((X.KS, 8)).astype(np.float32)
        e = A.astype(np.float64) @ B.astype(np.float64)
        errs.append(np.abs(em.fragment_product(X, A, B) - e).max() / np.abs(e).max())
    return max(errs)


def test_tf32x3_fragment_product_is_fp32_accurate():
    """One m16n8k8 step: 3xTF32 (big/small split, three mma) is fp32-level; plain TF32 is ~1000x worse."""
    e3, e1 = _frag_err(em.Tf32x3), _frag_err(em.Tf32)
    assert e3 < 1e-6  # fp32 rounding of a k=8 sum of O(1) products: a few ulp
    assert e1 > 1e-4  # tf32 keeps 10 mantissa bits: ~2^-11 relative per operand
    assert e3 < e1 / 100


def test_tf32x3_split_is_exact_and_tf32():
    x = RNG.standard_normal(1000).astype(np.float32) * np.float32(1e3)
    s = em.split3(x[:, None])
    big, small = s[:, 0], s[:, 1]
    assert not (big.view(np.uint32) & 0x1FFF).any()  # big masked: an exact tf32 value, x - big exact
    small = em.tf32_value(small)  # what the mma reads of small (its 13 low bits are don't-care)
    # big + small recovers x to ~2^-22 relative (small keeps 11 of the 13 remaining bits)
    assert np.abs(big.astype(np.float64) + small - x).max() <= np.abs(x).max() * 2.0**-21


def test_tf32x3_split_keeps_inf_and_nan():
    """The guard-free big (integer add + mask): inf stays inf; nan input may lose big but small stays nan."""
    x = np.array([[np.inf], [-np.inf], [np.nan], [np.float32(np.nan) * -1]], np.float32)
    x = np.concatenate([x, np.frombuffer(np.array([0x7FFFFFFF], np.uint32).tobytes(), np.float32)[None]])
    s = em.split3(x)
    assert np.isinf(s[:2, 0]).all()
    assert np.isnan(s[:, 0] + em.tf32_value(s[:, 1])).all()  # the mma sees a nan in every row


def test_tf32_cvt_leaves_dont_care_bits():
    """sm_90's cvt.rna.tf32.f32 adds 0x1000 without masking; mma ignores the low bits, the split must mask."""
    x = np.array([1 + 2.0**-11, 1 + 2.0**-12, -3.0, np.inf], np.float32)
    assert (em.tf32(x).view(np.uint32) == x.view(np.uint32) + np.uint32(0x1000))[:3].all()
    assert (em.tf32_value(em.tf32(x))[:3] == np.array([1 + 2.0**-10, 1, -3.0], np.float32)).all()
    assert np.isinf(em.tf32(x)[3])


@pytest.mark.parametrize("L,S,causal", [(77, 77, True), (100, 130, False)])
def test_cpu_emulated_tf32x3_flash_attention(L, S, causal):
    """CPU twin of the GPU check: emulated tf32x3 flash attention meets the SIMT fp32 tolerances and beats
    the emulated tf32 kernel's error by far (forward and backward)."""
    hd = 64
    q, k, v, do = (RNG.standard_normal((n, hd)).astype(np.float32) for n in (L, S, S, L))
    eo, else_ = ref.sdpa(*(a.astype(np.float64) for a in (q, k, v)), causal)
    egrads = ref.sdpa_backward(*(a.astype(np.float64) for a in (q, k, v, do)), causal)
    errs = {}
    for X in (em.Tf32x3, em.Tf32):
        o, lse = em.forward(X, q, k, v, L, S, hd, 1 / 8, causal)
        D = (o.astype(np.float32) * do).sum(-1).astype(np.float32)
        grads = em.backward(X, q, k, v, do, lse, D, L, S, hd, 1 / 8, causal)
        errs[X.__name__] = (
            max(ref.rel_err(o, eo), ref.rel_err(lse, else_)),
            max(ref.rel_err(a, e) for a, e in zip(grads, egrads)),
        )
    fwd3, bwd3 = errs["Tf32x3"]
    fwd1, bwd1 = errs["Tf32"]
    assert fwd3 <= em.TOL_X3["fwd"] and bwd3 <= em.TOL_X3["bwd"]
    assert fwd3 < fwd1 / 100 and bwd3 < bwd1 / 100


@pytest.mark.parametrize("X", [em.Tf32x3, em.Tf32], ids=["tf32x3", "tf32"])
def test_cpu_emulated_fused_backward(X):
    """CPU twin of the fused backward (dS staged in shared memory, dS K added into dQ with fp32 atomics): same
    tolerance against float64 as the split kernels, dK/dV bitwise the split kernels', dQ within fp32 rounding of
    the split dQ kernel's."""
    L, S, hd, causal = 100, 130, 64, True
    q, k, v, do = (RNG.standard_normal((n, hd)).astype(np.float32) for n in (L, S, S, L))
    egrads = ref.sdpa_backward(*(a.astype(np.float64) for a in (q, k, v, do)), causal)
    o, lse = em.forward(X, q, k, v, L, S, hd, 1 / 8, causal)
    D = (o.astype(np.float32) * do).sum(-1).astype(np.float32)
    split = em.backward(X, q, k, v, do, lse, D, L, S, hd, 1 / 8, causal)
    fused = em.backward(X, q, k, v, do, lse, D, L, S, hd, 1 / 8, causal, fused=True)
    tol = em.TOL_X3["bwd"] if X is em.Tf32x3 else 1e-2
    assert max(ref.rel_err(a, e) for a, e in zip(fused, egrads)) <= tol
    assert np.array_equal(fused[1], split[1]) and np.array_equal(fused[2], split[2])
    assert ref.rel_err(fused[0], split[0]) < (2e-6 if X is em.Tf32x3 else 2e-4)
    assert np.any(fused[0] != 0) and ref.rel_err(fused[0], egrads[0]) > 0  # dq was really accumulated


def test_tf32x3_staged_accumulation_contains_the_truncation_bias(monkeypatch):
    """The matrix units truncate their fp32 sums (modelled: round toward zero); summed straight into the running
    P V accumulator that bias grows with the keys (H200: 1.2e-5 at 1000 keys, 6x the SIMT kernel). Staged
    (TF32X3::mma_acc: three products into a zeroed temporary, one rounded add) it stays near exact fp32
    accumulation. acc_pv over 1024 keys of positive P and V (the bias cannot cancel) vs the same products
    accumulated in float64."""
    rng = np.random.default_rng(7)
    nk = 128  # k-steps of 8 keys
    cs = [rng.uniform(0, 1, (32, 4)) for _ in range(nk)]
    Bs = rng.uniform(0.5, 1.5, (nk * 8, 8 + em.Tf32x3.PAD)).astype(np.float32)
    X, rz32, mma, mma_acc = em.Tf32x3, em.rz32, em.Tf32x3.mma, em.Tf32x3.mma_acc

    def run(mma_acc, rz):
        monkeypatch.setattr(X, "mma_acc", staticmethod(mma_acc))
        monkeypatch.setattr(em, "rz32", rz)
        return em.acc_pv(X, [np.zeros((32, 4))], cs, Bs, 0, nk)[0]

    exact = run(mma, lambda x: np.asarray(x, np.float64))  # float64 accumulation of the same products
    staged = run(mma_acc, rz32)
    unstaged = run(mma, rz32)
    e_st, e_un = (np.abs(a - exact).max() / np.abs(exact).max() for a in (staged, unstaged))
    assert e_un > 1e-6  # ~384 truncations of the running sum: biased
    assert e_st < e_un / 10 and e_st < 1e-6  # one rounded add per k-step: like fp32 accumulation


def test_sdpa_mma_compiles_with_nvrtc():
    """Every entry of sdpa_mma.cu (tf32, tf32x3, bf16; dense and strided; HD 64/128) compiles with NVRTC."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    from blutensor.backends.cupy._loader import source

    err, prog = nvrtc.nvrtcCreateProgram(source("sdpa_mma.cu").encode(), b"sdpa_mma.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    opts = [b"-std=c++17", b"-arch=compute_80"]
    (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, n = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * n
    nvrtc.nvrtcGetProgramLog(prog, log)
    assert res == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")
    _, n = nvrtc.nvrtcGetPTXSize(prog)
    ptx = b" " * n
    nvrtc.nvrtcGetPTX(prog, ptx)
    nvrtc.nvrtcDestroyProgram(prog)
    entries = {m.decode() for m in re.findall(rb"\.entry (blu_\w+)\(", ptx)}
    want = {
        f"blu_sdpa_{k}{s}_{v}_hd{d}"
        for k in ("forward", "backward_dkdv", "backward_dq")
        for s in ("", "_strided")
        for v in ("tf32", "tf32x3", "bf16")
        for d in (64, 128)
    } | {f"blu_sdpa_backward_fused{s}_{v}_hd{d}" for s in ("", "_strided") for v in sdpa.FUSED_BWD for d in (64, 128)
         if v != "bf16_wgmma"}  # the Hopper kernel's fused backward is in sdpa_wgmma.cu (test_sdpa_wgmma.py)
    assert want <= entries, want - entries
    assert b"mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in ptx


@pytest.fixture
def device(monkeypatch):
    """A fake sm_90 device with H200 shared memory; restores the matmul precision."""
    from blutensor.gemm import get_matmul_precision, set_matmul_precision

    state = {"cc": 90, "smem": 227 * 1024}
    monkeypatch.setattr(sdpa, "_compute_capability", lambda: state["cc"])
    monkeypatch.setattr(sdpa, "smem_optin", lambda: state["smem"])
    monkeypatch.delenv("BLUTRAIN_SDPA_FP32", raising=False)
    bt.policy.reset_defaults()
    prec = get_matmul_precision()
    yield state
    set_matmul_precision(prec)


def test_pick_variant(device, monkeypatch):
    from blutensor.gemm import set_matmul_precision

    f32, u16 = np.dtype(np.float32), np.dtype(np.uint16)
    set_matmul_precision("fp32")
    assert sdpa.pick_variant(f32, 64) == "tf32x3"  # strict fp32 default: fp32 on the matrix units, as PyTorch
    assert sdpa.pick_variant(f32, 32) == "f32"
    assert sdpa.pick_variant(f32, 48) is None
    assert sdpa.pick_variant(u16, 64) == "bf16_wgmma"  # sm_90: the Hopper kernels (test_sdpa_wgmma.py)
    assert bt.ExecutionPolicy.from_env({"BLUTRAIN_SDPA_FP32": "TF32X3"}).attention_fp32 == "tf32x3"
    with bt.policy.scope(attention_fp32="tf32x3"):
        assert sdpa.pick_variant(f32, 64) == "tf32x3"
        assert sdpa.pick_variant(f32, 128) == "tf32x3"
        assert sdpa.pick_variant(f32, 32) == "f32"  # head dim the mma kernels lack
    with bt.policy.scope(attention_fp32="simt"):
        assert sdpa.pick_variant(f32, 64) == "f32"
    monkeypatch.setenv("BLUTRAIN_SDPA_FP32", "simt")
    bt.policy.reset_defaults()
    assert sdpa.pick_variant(f32, 64) == "f32"
    monkeypatch.setenv("BLUTRAIN_SDPA_FP32", "fast")
    bt.policy.reset_defaults()
    with pytest.raises(ValueError, match="BLUTRAIN_SDPA_FP32"):
        sdpa.pick_variant(f32, 64)
    monkeypatch.delenv("BLUTRAIN_SDPA_FP32")
    bt.policy.reset_defaults()
    for prec in ("tf32", "bf16"):
        set_matmul_precision(prec)
        assert sdpa.pick_variant(f32, 64) == "tf32_wgmma"  # sm_90: the Hopper tf32 kernels (attention_tf32 'auto')
        with bt.policy.scope(attention_tf32="mma"):
            assert sdpa.pick_variant(f32, 64) == "tf32"
    set_matmul_precision("fp32")
    device["cc"] = 75  # no tf32 mma.sync before sm_80
    assert sdpa.pick_variant(f32, 64) == "f32"
    device["cc"] = 80
    device["smem"] = 163 * 1024  # A100: the HD 128 tiles (200 KB) do not fit
    assert sdpa._mma_smem("tf32x3", 128, "bwd") > device["smem"] >= sdpa._mma_smem("tf32x3", 64, "bwd")
    assert sdpa.pick_variant(f32, 64) == "tf32x3" and sdpa.pick_variant(f32, 128) == "f32"
    set_matmul_precision("tf32")
    assert sdpa.pick_variant(f32, 64) == "tf32" and sdpa.pick_variant(f32, 128) == "f32"


def test_mma_smem_sizes():
    """_mma_smem mirrors sdpa_mma.cu: fp32 storage (tf32, tf32x3) rows of HD + 4 floats, bf16 HD + 8 halves."""
    for hd in (64, 128):
        assert sdpa._mma_smem("tf32x3", hd, "fwd") == sdpa._mma_smem("tf32", hd, "fwd") == 4 * 64 * (hd + 4) * 4
        assert sdpa._mma_smem("bf16", hd, "fwd") == 4 * 64 * (hd + 8) * 2
        assert sdpa._mma_smem("tf32x3", hd, "bwd") == 6 * 64 * (hd + 4) * 4 + 4 * 64 * 4
        assert sdpa._mma_smem("tf32", hd, "fused") == sdpa._mma_smem("tf32", hd, "bwd") + 64 * 72 * 4
        assert sdpa._mma_smem("tf32x3", hd, "fused") <= 227 * 1024  # fits an H100/H200 block
    from blutensor.backends.cupy._loader import source

    src = source("sdpa_mma.cu")  # with sdpa_mma_frag.cuh inlined, as NVRTC sees it
    assert "constexpr int BR = 64;" in src and sdpa.BR == 64
    assert "constexpr int SLD = BR + 8;" in src and sdpa.SLD == 72
    assert sdpa._names("f32", 64, "bwd")[2] == 128 and sdpa._fwd_rows("f32", 64) == 64


def test_fused_backward_choice(device, monkeypatch):
    """The fused backward (atomic dQ) runs for tf32x3 by default and for tf32 when asked (BLUTRAIN_SDPA_BWD=fused);
    never for bf16 / SIMT, under deterministic algorithms, with BLUTRAIN_SDPA_BWD=split, or where its shared memory
    does not fit."""
    monkeypatch.delenv("BLUTRAIN_SDPA_BWD", raising=False)
    monkeypatch.delenv("BLUTRAIN_DETERMINISTIC", raising=False)
    bt.policy.reset_defaults()
    assert sdpa.fused_backward("tf32x3", 64) and not sdpa.fused_backward("tf32", 64)
    assert not sdpa.fused_backward("bf16", 64) and not sdpa.fused_backward("f32", 64)
    with bt.policy.scope(attention_backward="fused"):
        assert sdpa.fused_backward("tf32", 128) and not sdpa.fused_backward("bf16", 64)
    with bt.policy.scope(attention_backward="split"):
        assert not sdpa.fused_backward("tf32x3", 64)
    with pytest.raises(ValueError, match="BLUTRAIN_SDPA_BWD"):
        bt.ExecutionPolicy.from_env({"BLUTRAIN_SDPA_BWD": "atomic"})
    monkeypatch.setenv("BLUTRAIN_SDPA_BWD", "fused")
    monkeypatch.setenv("BLUTRAIN_DETERMINISTIC", "1")
    bt.policy.reset_defaults()
    assert not sdpa.fused_backward("tf32x3", 64)
    bt.use_deterministic_algorithms(False)  # the API call wins over the environment
    assert sdpa.fused_backward("tf32x3", 64)
    with bt.policy.scope(deterministic=True):
        assert not sdpa.fused_backward("tf32x3", 64)
    assert sdpa.fused_backward("tf32x3", 64)
    device["smem"] = sdpa._mma_smem("tf32x3", 128, "fused") - 1
    assert not sdpa.fused_backward("tf32x3", 128) and sdpa.fused_backward("tf32x3", 64)


def test_deterministic_switch(monkeypatch):
    """bt.use_deterministic_algorithms / BLUTRAIN_DETERMINISTIC: off by default, the API wins, bad values named."""
    monkeypatch.delenv("BLUTRAIN_DETERMINISTIC", raising=False)
    bt.policy.reset_defaults()
    assert bt.are_deterministic_algorithms_enabled() is False
    monkeypatch.setenv("BLUTRAIN_DETERMINISTIC", "1")
    assert bt.are_deterministic_algorithms_enabled() is False  # read once, at first use
    bt.policy.reset_defaults()
    assert bt.are_deterministic_algorithms_enabled() is True
    bt.use_deterministic_algorithms(False)
    assert bt.are_deterministic_algorithms_enabled() is False
    with pytest.raises(TypeError, match="bool"):
        bt.use_deterministic_algorithms(1)
    monkeypatch.setenv("BLUTRAIN_DETERMINISTIC", "maybe")
    bt.policy.reset_defaults()
    with pytest.raises(ValueError, match="BLUTRAIN_DETERMINISTIC must be 0 or 1, got 'maybe'"):
        bt.are_deterministic_algorithms_enabled()


def test_mma_warps_mirror_the_entries():
    """sdpa.py's MMA_WARPS (threads and forward rows of each launch) = the FW / BW of every MMA_ENTRIES line, and the
    emulation runs the same block shapes."""
    src = (KDIR / "sdpa_mma.cu").read_text()
    rows = re.findall(r"^MMA_ENTRIES\((\w+), (\w+), \w+, (\d+), (\d+), (\d+), (\d+), (\d+)\)", src, re.M)
    assert len(rows) == 6
    for name, trait, hd, fw, _fmin, bw, _bmin in rows:
        assert sdpa.MMA_WARPS[name, int(hd)] == (int(fw), int(bw)), name
        assert int(fw) in (4, 8) and int(bw) in (4, 8)
        assert sdpa._names(name, int(hd))[2] == 32 * int(fw) and sdpa._names(name, int(hd), "bwd")[2] == 32 * int(bw)
        assert sdpa._fwd_rows(name, int(hd)) == 16 * int(fw)
        if int(hd) == 64:
            emu = {"TF32": "Tf32", "TF32X3": "Tf32x3", "BF16": "Bf16"}[trait]
            assert em.WARPS[emu] == (int(fw), int(bw))


def _cuda_ok() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_ok(), reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("mode", ["fused", "split"])
@pytest.mark.parametrize("L,S,causal", [(77, 77, True), (100, 130, False)])
def test_cuda_tf32x3_matches_reference(L, S, causal, mode, monkeypatch):
    """GPU twin of test_cpu_emulated_tf32x3_flash_attention and test_cpu_emulated_fused_backward: the kernels
    (both backward modes) at the SIMT fp32 tolerances."""
    import cupy as cp

    bt.policy.update(attention_backward=mode)  # reset by conftest

    hd = 64
    q, k, v, do = (RNG.standard_normal((2, n, hd)).astype(np.float32) for n in (L, S, S, L))
    dq_, dk_, dv_, do_ = (cp.asarray(a) for a in (q, k, v, do))
    o, lse = sdpa.flash_attention_forward(dq_, dk_, dv_, causal, None, "tf32x3")
    grads = sdpa.flash_attention_backward(dq_, dk_, dv_, o, lse, do_, causal, None, "tf32x3")
    for b in range(2):
        eo, _ = ref.sdpa(*(a[b].astype(np.float64) for a in (q, k, v)), causal)
        assert ref.rel_err(cp.asnumpy(o[b]), eo) <= em.TOL_X3["fwd"]
        for a, e in zip(grads, ref.sdpa_backward(*(a[b].astype(np.float64) for a in (q, k, v, do)), causal)):
            assert ref.rel_err(cp.asnumpy(a[b]), e) <= em.TOL_X3["bwd"]
