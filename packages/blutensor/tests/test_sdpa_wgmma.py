"""The Hopper flash attention (kernels/sdpa_wgmma.cu, backends/cupy/sdpa_wgmma.py, backends/cupy/tma.py).

CPU: the generated wgmma wrappers are current; NVRTC compiles every entry for sm_90a (wgmma, TMA, setmaxnreg in
the PTX) and, as trapping stubs, for sm_80; the NumPy model of the kernel's swizzled shared-memory descriptors and
register fragments (dev/emulate_sdpa_wgmma.py) reproduces float64 products, and fails when an offset is wrong;
the tensor maps built for dense and fused-qkv layouts; the choice of variant and BLUTRAIN_SDPA_KERNEL.
GPU (cuda-marked, sm_90 only): forward, lse, dq, dk, dv against a float64 NumPy reference on odd shapes, both
paths (dense and fused qkv), and a bitwise repeatable backward under deterministic algorithms (the fused backward:
test_sdpa_wgmma_fused.py).
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import blutensor as bt
import numpy as np
import pytest
from attention_reference import bf16_round as _bf16
from attention_reference import bf16_to_f64 as _f64
from attention_reference import sdpa_reference
from blutensor.backends.cupy import sdpa, tma
from blutensor.backends.cupy import sdpa_wgmma as wg

DEV = Path(__file__).resolve().parents[1] / "dev"
sys.path.insert(0, str(DEV))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "testing"))
import emulate_sdpa_wgmma as em  # noqa: E402
import fake_cuda  # noqa: E402
import gen_hopper  # noqa: E402

KDIR = Path(sdpa.__file__).resolve().parent / "kernels"
ENTRIES = {f"blu_sdpa_wgmma_bf16_hd{d}_{k}" for k in ("fwd", "bwd_dkdv", "bwd_dq", "bwd_fused", "bwd_dq_convert",
                                                     "preprocess") for d in (64, 128)}


def test_generated_wgmma_wrappers_are_current():
    text = (KDIR / "hopper.cuh").read_text()
    assert gen_hopper.generated_block() in text


def _ptx(arch: str) -> bytes:
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    from blutensor.backends.cupy._loader import source

    err, prog = nvrtc.nvrtcCreateProgram(source("sdpa_wgmma.cu").encode(), b"sdpa_wgmma.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    opts = [b"-std=c++17", f"-arch={arch}".encode()]
    (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, n = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * n
    nvrtc.nvrtcGetProgramLog(prog, log)
    assert res == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")
    _, n = nvrtc.nvrtcGetPTXSize(prog)
    ptx = b" " * n
    nvrtc.nvrtcGetPTX(prog, ptx)
    nvrtc.nvrtcDestroyProgram(prog)
    return ptx


def test_nvrtc_compiles_every_entry_for_sm90a():
    ptx = _ptx("compute_90a")
    entries = {m.decode() for m in re.findall(rb"\.entry (blu_\w+)\(", ptx)}
    assert ENTRIES <= entries, ENTRIES - entries
    for needle in (b"wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16", b"cp.async.bulk.tensor.4d",
                   b"setmaxnreg.inc", b"mbarrier.try_wait.parity", b"red.global.add.v2.f32",
                   b"fence.proxy.async.shared::cta", b"bar.sync",
                   b"cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32", b"cp.async.bulk.wait_group.read"):
        assert needle in ptx, needle


def test_other_architectures_get_trapping_stubs():
    ptx = _ptx("compute_80")
    assert ENTRIES <= {m.decode() for m in re.findall(rb"\.entry (blu_\w+)\(", ptx)}
    assert b"wgmma.mma_async" not in ptx and b"cp.async.bulk" not in ptx and b"trap" in ptx


def test_loader_builds_the_file_for_sm90a_only():
    from blutensor.backends.cupy._loader import arch_target

    assert arch_target("sdpa_wgmma.cu", "90") == "90a"
    assert arch_target("sdpa_wgmma.cu", "80") == "80"
    assert arch_target("sdpa_mma.cu", "90") == "90"


@pytest.mark.parametrize("hd", [64, 128])
def test_emulated_descriptors_and_fragments_reproduce_the_products(hd):
    assert em.check(hd) < 1e-9


def test_emulation_fails_on_a_wrong_offset(monkeypatch):
    """The model can fail: an MN-major operand read with the wrong atom distance (LBO) is garbage."""
    monkeypatch.setattr(em, "mnmajor", lambda base, rows_box, kk: (base + kk * 2048, 64 * 128 + 1024, 1024))
    assert not em.check(128) < 1e-3


def test_descriptor_advance_equals_a_fresh_descriptor():
    """hopper.cuh's blu_desc_add (one 32-bit add on the start-address field) gives blu_desc of the advanced address
    for every 16-byte-aligned shared address and k-step offset of a CTA (below sm_90's 227 KB), with the leading
    and stride byte offsets the kernels use; kmajor/mnmajor build their k-steps that way."""
    src = (Path(sdpa.__file__).resolve().parent / "kernels" / "hopper.cuh").read_text()
    assert "return (d & 0xFFFFFFFF00000000ull) | (unsigned long long)((unsigned)d + (bytes >> 4));" in src
    assert ("(unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)((lbo & 0x3FFFFu) >> 4) << 16) |"
            in src)
    cu = (Path(sdpa.__file__).resolve().parent / "kernels" / "sdpa_wgmma.cu").read_text()
    assert "return blu_desc_add(blu_desc(base + (unsigned)(row0 * 128), 16, 1024)," in cu
    assert "return blu_desc_add(blu_desc(base, (unsigned)(rows_box * 128), 1024), (unsigned)(kk * 2048));" in cu

    def desc(addr, lbo, sbo):
        return ((addr & 0x3FFFF) >> 4) | (((lbo & 0x3FFFF) >> 4) << 16) | (((sbo & 0x3FFFF) >> 4) << 32) | (1 << 62)

    def desc_add(d, nbytes):
        return (d & 0xFFFFFFFF00000000) | ((d + (nbytes >> 4)) & 0xFFFFFFFF)

    limit = 227 * 1024
    offsets = sorted({(j >> 2) * rb * 128 + (j & 3) * 32 for rb in (64, 128) for j in range(8)}
                     | {kk * 2048 for kk in range(8)})
    for lbo in (16, 64 * 128, 128 * 128):
        for addr in range(0, limit, 16 * 37):
            d = desc(addr, lbo, 1024)
            for off in offsets:
                if addr + off < limit:
                    assert desc_add(d, off) == desc(addr + off, lbo, 1024), (addr, off, lbo)


def test_shared_memory_fits_hopper():
    for hd in wg.HDS:
        assert wg.fwd_smem(hd) <= 227 * 1024 and wg.bwd_smem(hd) <= 227 * 1024


def _fake(shape, strides_el, ptr=0x10000, dtype=np.uint16):
    es = np.dtype(dtype).itemsize
    return SimpleNamespace(shape=shape, ndim=len(shape), strides=tuple(s * es for s in strides_el), itemsize=es,
                           dtype=np.dtype(dtype), data=SimpleNamespace(ptr=ptr))


def test_tensor_maps_of_dense_and_fused_qkv_layouts(monkeypatch):
    cp = fake_cuda.install(monkeypatch)  # the shared fake device, removed from sys.modules after the test
    driver = cp.device.tensor_map_driver  # the device's cuTensorMapEncodeTiled, in place of libcuda's
    monkeypatch.setattr(tma, "_CUDA", driver)
    seen = driver.calls
    tma._cache.clear()
    try:
        B, T, H, hd = 2, 77, 3, 64
        q = _fake((B, T, H, hd), (T * 3 * H * hd, 3 * H * hd, hd, 1))  # q of a (B, T, 3, H, HD) projection
        m = wg.tmap(q, "q", 128)
        s = seen[-1]
        assert (s["dtype"], s["rank"], s["addr"]) == (tma.DTYPE_BF16, 4, 0x10000)
        assert s["dims"] == (hd, T, H, B) and s["box"] == (64, 128, 1, 1)
        assert s["strides"] == (3 * H * hd * 2, hd * 2, T * 3 * H * hd * 2)
        assert m.dtype == tma.TMAP_DTYPE and m.tobytes()[:16] == np.array([tma.DTYPE_BF16, 4], "<u8").tobytes()
        d = _fake((5, 1000, 128), (1000 * 128, 128, 1))
        wg.tmap(d, "k", 64)
        assert seen[-1]["dims"] == (128, 1000, 1, 5) and seen[-1]["strides"][0] == 256
        assert seen[-1]["strides"][2] == 256000
        n = len(seen)
        with pytest.raises(tma.TmaError, match="flash attention .wgmma. v.*16-byte"):
            wg.tmap(_fake((5, 10, 64), (640, 64, 1), ptr=0x10008), "v", 64)
        with pytest.raises(tma.TmaError, match="strides"):
            wg.tmap(_fake((2, 10, 3, 64), (10 * 3 * 72 + 4, 3 * 72, 72, 1)), "q", 64)
        assert len(seen) == n, "maps TMA cannot read are refused before the driver is called"
    finally:
        tma._cache.clear()


def test_encode_args_are_rank_generic():
    spec = tma.tensor_spec(0x1000, 2, (64, 10, 3, 2), (384, 128, 3840), (64, 64, 1, 1))
    args = tma.encode_args(spec)
    assert args[:2] == (tma.DTYPE_BF16, 4) and args[6] == (1, 1, 1, 1) and args[8] == tma.SWIZZLE_128B


@pytest.fixture
def device(monkeypatch):
    state = {"cc": 90}
    monkeypatch.setattr(sdpa, "_compute_capability", lambda: state["cc"])
    monkeypatch.setattr(sdpa, "smem_optin", lambda: 227 * 1024)
    monkeypatch.delenv("BLUTRAIN_SDPA_KERNEL", raising=False)
    bt.policy.reset_defaults()
    return state


def test_pick_variant_and_the_kernel_setting(device, monkeypatch):
    u16 = np.dtype(np.uint16)
    assert sdpa.pick_variant(u16, 64) == "bf16_wgmma" and sdpa.pick_variant(u16, 128) == "bf16_wgmma"
    assert sdpa.pick_variant(u16, 32) is None
    with bt.policy.scope(attention="mma"):
        assert sdpa.pick_variant(u16, 64) == "bf16"
    monkeypatch.setenv("BLUTRAIN_SDPA_KERNEL", "Wgmma")
    bt.policy.reset_defaults()  # the variable is read once, at first use
    assert bt.policy.current().attention == "wgmma"
    assert sdpa.pick_variant(u16, 64) == "bf16_wgmma"
    device["cc"] = 80
    with pytest.raises(ValueError, match=r"attention='wgmma' \(BLUTRAIN_SDPA_KERNEL=wgmma\) needs an sm_90"):
        sdpa.pick_variant(u16, 64)
    with bt.policy.scope(attention="auto"):
        assert sdpa.pick_variant(u16, 64) == "bf16"  # sm_80: mma.sync
    with pytest.raises(ValueError, match=r"BLUTRAIN_SDPA_KERNEL must be one of \('auto', 'wgmma', 'mma'\)"):
        bt.ExecutionPolicy.from_env({"BLUTRAIN_SDPA_KERNEL": "fast"})
    with pytest.raises(ValueError, match=r"ExecutionPolicy.attention must be one of \('auto', 'wgmma', 'mma'\)"):
        bt.policy.scope(attention="fast")


def test_forward_schedule_picks_its_entry(monkeypatch):
    """Policy ``attention_schedule`` (BLUTRAIN_SDPA_SCHEDULE): 'pingpong' (the default) launches the turn-taking
    ``*_fwd_pp`` entry, 'free' the plain one with the same arguments; a bad value is refused by name."""
    cp = fake_cuda.install(monkeypatch)
    calls = []
    monkeypatch.setattr(wg, "launch", lambda file, name, grid, block, args, shared_mem=0: calls.append((name, args)))
    monkeypatch.setattr(wg, "tmap", lambda a, name, rows, kind="wgmma": a)
    monkeypatch.setattr(wg, "num_sms", lambda: 132)
    monkeypatch.delenv("BLUTRAIN_SDPA_SCHEDULE", raising=False)
    bt.policy.reset_defaults()
    q, k, v, o = (cp.zeros((2, 70, 64), dtype=cp.uint16) for _ in range(4))
    lse = cp.zeros((2, 70), dtype=cp.float32)
    wg.forward(q, k, v, o, lse, True, None)
    with bt.policy.scope(attention_schedule="free"):
        wg.forward(q, k, v, o, lse, True, None)
    assert [c[0] for c in calls] == ["blu_sdpa_wgmma_bf16_hd64_fwd_pp", "blu_sdpa_wgmma_bf16_hd64_fwd"]
    assert len(calls[0][1]) == len(calls[1][1])
    assert bt.ExecutionPolicy.from_env({"BLUTRAIN_SDPA_SCHEDULE": "free"}).attention_schedule == "free"
    with pytest.raises(ValueError, match=r"ExecutionPolicy.attention_schedule must be one of \('free', 'pingpong'\)"):
        bt.policy.scope(attention_schedule="turns")


# ---------------------------------------------------------------------------------------------------- GPU
def _sm90() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0 and int(cupy.cuda.Device().compute_capability) == 90
    except Exception:
        return False


def _reference(q, k, v, do, causal, sc):
    """float64 (o, lse, dq, dk, dv): attention_reference.sdpa_reference as a tuple."""
    return tuple(sdpa_reference(q, k, v, do, causal, sc).values())



TOL = {"o": 2e-2, "lse": 1e-2, "dq": 5e-2, "dk": 5e-2, "dv": 5e-2}  # bf16 storage of O(1) values


@pytest.mark.cuda
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("BH, L, S, hd, causal", [(6, 1000, 1000, 64, True), (5, 77, 77, 128, False),
                                                  (7, 333, 333, 128, True), (3, 200, 300, 64, False),
                                                  (1, 77, 77, 64, True)])
def test_cuda_wgmma_matches_float64(BH, L, S, hd, causal):
    import cupy as cp

    rng = np.random.default_rng(BH * L + hd)
    (qb, q), (kb, k), (vb, v), (db, do) = (_bf16(rng.standard_normal((BH, n, hd))) for n in (L, S, S, L))
    sc = 1.0 / math.sqrt(hd)
    gq, gk, gv, gdo = (cp.asarray(a) for a in (qb, kb, vb, db))
    o, lse = sdpa.flash_attention_forward(gq, gk, gv, causal, sc, "bf16_wgmma")
    with bt.policy.scope(deterministic=True):  # the split pair (the fused kernel: test_sdpa_wgmma_fused.py)
        g1 = sdpa.flash_attention_backward(gq, gk, gv, o, lse, gdo, causal, sc, "bf16_wgmma")
        g2 = sdpa.flash_attention_backward(gq, gk, gv, o, lse, gdo, causal, sc, "bf16_wgmma")
    want = _reference(q, k, v, do, causal, sc)
    got = (_f64(o.get()), lse.get().astype(np.float64)) + tuple(_f64(g.get()) for g in g1)
    for name, a, b in zip(TOL, got, want):
        assert np.abs(a - b).max() <= TOL[name] * max(1.0, np.abs(b).max()), name
    for a, b in zip(g1, g2):
        assert (a == b).all()  # deterministic: no atomics


@pytest.mark.cuda
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("scale", [-0.3, 0.0, 0.9])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_wgmma_forward_any_scale_matches_float64(scale, causal):
    """The forward's unmasked tiles take the row extreme of the raw scores (the minimum for a negative scale) and
    one FFMA an exponent; a negative, a zero (uniform attention) and a large scale match float64 over several key
    tiles, masked last tile included."""
    import cupy as cp

    BH, L, S, hd = 3, 300, 300, 64
    rng = np.random.default_rng(7)
    (qb, q), (kb, k), (vb, v), (_, do) = (_bf16(rng.standard_normal((BH, n, hd))) for n in (L, S, S, L))
    o, lse = sdpa.flash_attention_forward(*(cp.asarray(a) for a in (qb, kb, vb)), causal, scale, "bf16_wgmma")
    want = _reference(q, k, v, do, causal, scale)
    assert np.abs(_f64(o.get()) - want[0]).max() <= TOL["o"] * max(1.0, np.abs(want[0]).max())
    assert np.abs(lse.get().astype(np.float64) - want[1]).max() <= TOL["lse"] * max(1.0, np.abs(want[1]).max())


@pytest.mark.cuda
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("BH, L, S, hd, causal", [(6, 1000, 1000, 64, True), (5, 77, 200, 128, False),
                                                  (3, 333, 333, 128, True), (200, 130, 130, 64, False)])
def test_cuda_pingpong_forward_equals_the_free_one_bitwise(BH, L, S, hd, causal):
    """The 'pingpong' schedule only orders when the two consumer warpgroups issue their products: o and lse are
    bit for bit the free schedule's (more work tiles than multiprocessors in the last case: the turns carry over
    from tile to tile)."""
    import cupy as cp

    rng = np.random.default_rng(BH + L + hd)
    gq, gk, gv = (cp.asarray(_bf16(rng.standard_normal((BH, n, hd)))[0]) for n in (L, S, S))
    sc = 1.0 / math.sqrt(hd)
    with bt.policy.scope(attention_schedule="free"):
        o1, lse1 = sdpa.flash_attention_forward(gq, gk, gv, causal, sc, "bf16_wgmma")
    with bt.policy.scope(attention_schedule="pingpong"):
        o2, lse2 = sdpa.flash_attention_forward(gq, gk, gv, causal, sc, "bf16_wgmma")
    assert bool((o1 == o2).all()) and bool((lse1 == lse2).all())


@pytest.mark.cuda
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 (Hopper) GPU")
@pytest.mark.parametrize("B, T, H, hd, causal", [(2, 1000, 3, 64, True), (3, 77, 2, 128, False)])
def test_cuda_wgmma_fused_qkv_matches_float64(B, T, H, hd, causal):
    import cupy as cp

    rng = np.random.default_rng(T)
    qkvb, qkv = _bf16(rng.standard_normal((B, T, 3, H, hd)))
    dob, do = _bf16(rng.standard_normal((B, T, H, hd)))
    sc = 1.0 / math.sqrt(hd)
    g = cp.asarray(qkvb)
    o, lse = sdpa.qkv_attention_forward(g, causal, sc, "bf16_wgmma")
    dqkv = sdpa.qkv_attention_backward(g, o, lse, cp.asarray(dob), causal, sc, "bf16_wgmma")

    def heads(a):
        return a.transpose(0, 2, 1, 3).reshape(B * H, T, hd)

    want = _reference(heads(qkv[:, :, 0]), heads(qkv[:, :, 1]), heads(qkv[:, :, 2]), heads(do), causal, sc)
    d = _f64(dqkv.get())
    got = (heads(_f64(o.get())), lse.get().astype(np.float64)) + tuple(heads(d[:, :, j]) for j in range(3))
    for name, a, b in zip(TOL, got, want):
        assert np.abs(a - b).max() <= TOL[name] * max(1.0, np.abs(b).max()), name


def test_loader_compiles_marked_files_to_an_sm90a_cubin(monkeypatch, tmp_path):
    """On an sm_90 device a file marked 'blu-nvrtc-archs: 90a' is compiled for sm_90a (CuPy's own RawModule
    compile would add -arch=sm_90) and loaded from a cubin cached by source hash."""
    from blutensor.backends.cupy import _loader

    built = []
    cp = fake_cuda.make_cupy(compute_capability=90)  # the shared fake device records every RawModule
    monkeypatch.setattr(_loader, "cupy", lambda: cp)
    monkeypatch.setattr(_loader, "_cubin", lambda code, file, arch: built.append((file, arch)) or b"cubin")
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_loader, "_modules", {})
    monkeypatch.setattr(_loader, "_cache_checked", {})
    _loader.module("sdpa_wgmma.cu")
    _loader.module("sdpa_wgmma.cu")  # cached: built once
    assert built == [("sdpa_wgmma.cu", "90a")]
    (path,) = [m.path for m in cp.device.modules]
    assert Path(path).parent == tmp_path and "sm90a" in Path(path).name and Path(path).read_bytes() == b"cubin"
    _loader.module("sdpa.cu")  # unmarked: CuPy compiles it from source for sm_90
    last = cp.device.modules[-1]
    assert last.path is None and "blu_" in last.code and last.options == ("-std=c++17", "-arch=sm_90")
    assert built == [("sdpa_wgmma.cu", "90a")]
