"""Memory-bound kernels (layer_norm, gelu, cross_entropy, grad_norm): NVRTC builds of every entry the launchers
name, and NumPy twins of the index maps and reduction orders the CUDA code uses (no GPU needed)."""

from __future__ import annotations

import re

import numpy as np
import pytest

FILES = ("layer_norm.cu", "gelu.cu", "cross_entropy.cu", "grad_norm.cu")


def test_gelu_launch_variants_have_entries():
    """Every (PLAIN) name the GELU launcher can build exists in gelu.cu."""
    have = _entries(_ptx("gelu.cu", 90))
    want = {f"blu_gelu_{k}_{p}{s}" for k in ("forward", "backward") for p in ("", "plain_") for s in ("f32", "bf16")}
    assert want <= have, want - have


def _ptx(file: str, arch: int) -> str:
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    from blutensor.backends.cupy._loader import source

    err, prog = nvrtc.nvrtcCreateProgram(source(file).encode(), file.encode(), 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    opts = [b"-std=c++17", f"-arch=compute_{arch}".encode()]
    (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, n = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * n
    nvrtc.nvrtcGetProgramLog(prog, log)
    assert res == nvrtc.nvrtcResult.NVRTC_SUCCESS, f"{file} sm_{arch}: {log.decode(errors='replace')}"
    _, n = nvrtc.nvrtcGetPTXSize(prog)
    ptx = b" " * n
    nvrtc.nvrtcGetPTX(prog, ptx)
    nvrtc.nvrtcDestroyProgram(prog)
    return ptx.decode(errors="replace")


def _entries(ptx: str) -> set[str]:
    return set(re.findall(r"\.entry (blu_\w+)\(", ptx))


@pytest.mark.parametrize("arch", (80, 90))
@pytest.mark.parametrize("file", FILES)
def test_memkern_files_compile_with_nvrtc(file, arch):
    assert _entries(_ptx(file, arch))


def test_layer_norm_register_entries_match_the_launcher():
    """Every register-resident width the launcher may pick has its entry in layer_norm.cu."""
    from blutensor.backends.cupy import layer_norm as ln

    have = _entries(_ptx("layer_norm.cu", 90))
    want = {f"blu_layer_norm_forward_r{nv}_{s}" for nv in ln._FWD_NV for s in ("f32", "bf16")}
    want |= {f"blu_layer_norm_backward_{k}{nv}_{s}" for s, nvs in ln._BWD_NV.items() for nv in nvs for k in "rs"}
    want |= {f"blu_layer_norm_{k}_{s}" for k in ("forward", "backward", "backward_reduce") for s in ("f32", "bf16")}
    assert want <= have, want - have


# ============================================================== NumPy twins of the index maps and numerics
def _lane_columns(C: int, V: int, NV: int) -> list[np.ndarray]:
    """Columns lane l holds in the register-resident LayerNorm: vectors j*32 + l (j < NV) below C/V."""
    cv = C // V
    out = []
    for lane in range(32):
        vis = [j * 32 + lane for j in range(NV) if j * 32 + lane < cv]
        out.append(np.array([vi * V + e for vi in vis for e in range(V)], dtype=np.int64))
    return out


@pytest.mark.parametrize("C", [4, 8, 36, 128, 768, 1000, 1024, 1600, 2048])
@pytest.mark.parametrize("itemsize", [4, 2])
def test_layer_norm_register_rows_cover_each_column_once(C, itemsize):
    from blutensor.backends.cupy import layer_norm as ln

    V = 16 // itemsize
    if C % V:
        pytest.skip("odd width: generic kernel")
    nv = ln.reg_nv(C, itemsize, ln._FWD_NV)
    if nv is None:
        assert C > 32 * 8 * V
        return
    need = -(-C // (32 * V))
    assert nv >= need and all(n < need or n >= nv for n in ln._FWD_NV)  # the smallest that fits
    cols = np.concatenate(_lane_columns(C, V, nv))
    assert np.array_equal(np.sort(cols), np.arange(C))  # every column exactly once, by one lane


def _warp_sum_f32(per_lane: np.ndarray) -> np.float32:
    """The xor-butterfly warp sum in fp32 (all lanes end with the same value; lane 0's shown)."""
    v = per_lane.astype(np.float32).copy()
    for off in (16, 8, 4, 2, 1):
        v = (v + v[np.arange(32) ^ off]).astype(np.float32)
    assert np.all(v == v[0])
    return v[0]


@pytest.mark.parametrize("C,offset", [(768, 0.0), (768, 1000.0), (1024, 300.0), (36, 50.0)])
def test_layer_norm_two_pass_register_stats_meet_fp32_tolerance(C, offset):
    """The fast kernel's statistics (fp32 per-lane sums, butterfly, exact two-pass variance) vs float64, on rows
    with a large mean (where a one-pass E[x^2] - E[x]^2 in fp32 would lose the variance)."""
    rng = np.random.default_rng(C)
    V = 4
    nv = -(-C // (32 * V))
    lanes = _lane_columns(C, V, nv)
    for _ in range(20):
        x = (rng.standard_normal(C) * 2 + offset).astype(np.float32)
        s = _warp_sum_f32(np.array([np.sum(x[c], dtype=np.float32) for c in lanes], dtype=np.float32))
        mu = np.float32(s * np.float32(1.0 / C))
        q = _warp_sum_f32(np.array([np.sum((x[c] - mu) ** 2, dtype=np.float32) for c in lanes], dtype=np.float32))
        rs = np.float32(1.0) / np.sqrt(np.float32(q * np.float32(1.0 / C) + np.float32(1e-5)))
        x64 = x.astype(np.float64)
        e_mu = x64.mean()
        e_rs = 1.0 / np.sqrt(x64.var() + 1e-5)
        assert abs(mu - e_mu) / max(abs(e_mu), 1.0) <= 2e-6
        assert abs(rs - e_rs) / e_rs <= 2e-6
        naive = np.float32(np.sum(x * x, dtype=np.float32) / C) - np.float32(e_mu) ** 2
        if offset >= 1000:  # the failure mode the two-pass form avoids
            assert abs(naive - x64.var()) / x64.var() > 1e-4


def test_layer_norm_reduce_slices_visit_every_partial_once():
    """blu_layer_norm_backward_reduce_*: slice s of S sums partial rows s, s+S, ...: each row once per column."""
    for nblocks in (1, 3, 7, 264, 1056):
        S = max(1, min(32, nblocks // 4))
        rows = np.concatenate([np.arange(s, nblocks, S) for s in range(S)])
        assert np.array_equal(np.sort(rows), np.arange(nblocks))


def _gelu_tanh_f32(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """kernels/gelu.cu half1p_tanh + gelu_f/gelu_grad_f (fp32 storage: accurate expf) in NumPy fp32."""
    f = np.float32
    x = x.astype(f)
    u = f(0.7978845608028654) * (x + f(0.044715) * x * x * x)
    e = np.exp(f(-2.0) * np.abs(u)).astype(f)
    r = (f(1.0) / (f(1.0) + e)).astype(f)
    s = np.where(u >= 0, r, e * r).astype(f)
    s2 = (f(4.0) * e * r * r).astype(f)
    y = x * s
    dy = s + f(0.5) * x * s2 * f(0.7978845608028654) * (f(1.0) + f(3.0 * 0.044715) * x * x)
    return y, dy


def test_gelu_fast_tanh_form_meets_fp32_tolerance():
    """(1 + tanh u)/2 = r or E*r with E = exp(-2|u|), r = 1/(1 + E), sech^2 = 4 E r^2: fp32 error vs float64
    within the kernel check tolerances over [-12, 12], and ~1e-7 pointwise, also in the negative tail where the
    textbook 0.5 * x * (1 + tanh u) cancels (> 1e-6 there, shown too)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dev"))
    import kernel_reference as ref

    x = np.linspace(-12, 12, 400_001).astype(np.float32)
    x64 = x.astype(np.float64)
    y, dy = _gelu_tanh_f32(x)
    ey, edy = ref.gelu(x64, "tanh"), ref.gelu_backward(np.ones_like(x64), x64, "tanh")
    assert ref.rel_err(y, ey) <= ref.TOL["gelu.fwd"]["f32"]
    assert ref.rel_err(dy, edy) <= ref.TOL["gelu.bwd"]["f32"]
    # pointwise against x * sigmoid(2u) in float64 (the float64 textbook form itself cancels below x ~ -6)
    u64 = 0.7978845608028654 * (x64 + 0.044715 * x64**3)
    ey = x64 / (1.0 + np.exp(-2.0 * u64))
    # x >= -2: below, the conditioning of exp(-2u) on the fp32 rounding of u (error ~ |2u| ulp) sets the error
    ok = (x64 >= -2.0) & (np.abs(ey) > 0)
    assert (np.abs(y[ok] - ey[ok]) / np.abs(ey[ok])).max() < 1e-6
    f = np.float32
    t = np.tanh(f(0.7978845608028654) * (x + f(0.044715) * x * x * x)).astype(f)
    textbook = f(0.5) * x * (f(1.0) + t)
    assert (np.abs(textbook[ok] - ey[ok]) / np.abs(ey[ok])).max() > 1e-6


@pytest.mark.parametrize("n", [1, 7, 16384, 16391, 3 * 16384 + 5])
@pytest.mark.parametrize("per", [4, 8])
def test_grad_norm_vector_steps_cover_the_chunk_once(n, per):
    """blu_grad_norm_partial: 16-byte vectors j0 + k*blockDim (k < 8) per step, then the scalar tail from
    start + nvec*per: every element of every chunk exactly once."""
    from blutensor.backends.cupy.multi_tensor import CHUNK, build_chunk_table

    bd, U = 512, 8
    _, starts = build_chunk_table([n])
    seen = np.zeros(n, dtype=np.int64)
    for start in starts:
        end = min(start + CHUNK, n)
        nvec = (end - start) // per
        for t in range(bd):
            for j0 in range(t, nvec, U * bd):
                for k in range(U):
                    j = j0 + k * bd
                    if j < nvec:
                        seen[start + j * per : start + (j + 1) * per] += 1
        first = start + nvec * per
        seen[first:end] += 1
    assert np.all(seen == 1)


def test_cross_entropy_persistent_rows_and_slots_are_owned_once():
    """ce_forward_smem: block b handles rows b, b+G, ...; thread t owns 16-byte slots t, t+blockDim, ...
    (the slots it loads, reads and refills): each row once, each slot by one thread."""
    for N, G in ((1, 1), (531, 264), (16384, 264), (77, 132)):
        rows = np.concatenate([np.arange(b, N, G) for b in range(min(G, N))])
        assert np.array_equal(np.sort(rows), np.arange(N))
    for nv, bd in ((6288, 512), (12576, 1024), (1, 1024)):
        slots = np.concatenate([np.arange(t, nv, bd) for t in range(bd)])
        assert np.array_equal(np.sort(slots), np.arange(nv))


def test_occupancy_query_reaches_the_driver_with_the_function_handle(monkeypatch):
    """full_grid asks the driver (through the RawKernel's Function handle) and sizes one wave from the answer;
    the fallback guess is used only when the query raises."""
    from types import SimpleNamespace

    from blutensor.backends.cupy import occupancy as occ

    asked = []

    def query(ptr, block, smem):
        asked.append((ptr, block, smem))
        return 5

    fake_cp = SimpleNamespace(
        cuda=SimpleNamespace(
            runtime=SimpleNamespace(getDevice=lambda: 0),
            driver=SimpleNamespace(occupancyMaxActiveBlocksPerMultiprocessor=query),
        )
    )
    raw_kernel = SimpleNamespace(kernel=SimpleNamespace(ptr=1234))  # no .ptr of its own, like cupy.RawKernel
    monkeypatch.setattr(occ, "cupy", lambda: fake_cp)
    monkeypatch.setattr(occ, "function", lambda file, name: raw_kernel)
    monkeypatch.setattr(occ, "num_sms", lambda: 132)
    monkeypatch.setattr(occ, "_cache", {})
    assert occ.full_grid("gelu.cu", "blu_gelu_forward_f32", 256, 10**6) == 132 * 5
    assert asked == [(1234, 256, 0)]
    assert occ.full_grid("gelu.cu", "blu_gelu_forward_f32", 256, 100) == 100  # small work: fewer blocks

    def broken(ptr, block, smem):
        raise RuntimeError("no occupancy API")

    fake_cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor = broken
    monkeypatch.setattr(occ, "_cache", {})
    assert occ.full_grid("cross_entropy.cu", "k", 1024, 10**6, default=1) == 132


@pytest.mark.parametrize("C,V", [(768, 4), (768, 8), (36, 4), (1024, 8), (8, 8)])
def test_layer_norm_smem_acc_layout_round_trips(C, V):
    """ln_backward_reg<SACC>: element e of vector vi accumulates at e*cv + vi (lanes of a warp on consecutive
    words); the block sum reads column c at (c % V)*cv + c // V: a bijection onto [0, C) that finds c again."""
    cv = C // V
    slot = {(vi * V + e): e * cv + vi for vi in range(cv) for e in range(V)}
    assert sorted(slot.values()) == list(range(C))
    assert all((c % V) * cv + c // V == s for c, s in slot.items())
    for j in range(-(-cv // 32)):  # one warp step: lanes 0..31 at fixed (j, e) hit 32 consecutive words
        for e in range(V):
            words = [e * cv + j * 32 + lane for lane in range(32) if j * 32 + lane < cv]
            assert words == list(range(words[0], words[0] + len(words)))
