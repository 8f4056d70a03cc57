"""The Hopper flash attention (kernels/sdpa_wgmma.cu) beside the mma.sync one (kernels/sdpa_mma.cu) on the same
bfloat16 data, each against a float64 NumPy reference, on odd shapes (L != S, lengths that are no tile multiple),
causal and not, head dims 64 and 128.

GPU (cuda-marked, sm_90): per shape, o, lse, dq, dk, dv of both kernels within TOL of float64 (max abs error
relative to max(1, max |ref|)); wgmma's error at most twice mma.sync's + 2e-3 for every tensor (the Hopper kernel
may not be less accurate than the kernel it replaces); wgmma's
deterministic backward (``deterministic=True``) bitwise repeatable; the Hopper kernels are
built with an mbarrier watchdog (BLU_MBAR_SPIN_LIMIT: a deadlock traps instead of hanging). Dense (BH, n, HD)
inputs through ``bt.ext.flash_attention_forward/backward``, and the fused-qkv path as GPT-2 calls it
(``bt.ext.sdpa_qkv`` through autograd on a (B, T, 3C) bf16 tensor, the policy's ``attention = 'wgmma'`` / ``'mma'``).

CPU twins: the same assertions for the CPU's compiled attention (``blutensor.cpu.sdpa`` behind
``F.scaled_dot_product_attention``; fused qkv: ``bt.ext.sdpa_qkv``) beside the NumPy reference kernels
(``bt.ext.reference_kernels()``) in the place of mma.sync, on the same bf16-rounded data and shapes (float32
math). The CPU op returns no log-sum-exp, so lse is checked on the GPU only. Grouped-query attention has no wgmma
entry (it runs the mma.sync kernel, tests/test_sdpa_gqa.py).
"""

from __future__ import annotations

import math

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
import pytest
from attention_reference import bf16_round as _bf16
from attention_reference import bf16_to_f64 as _f64
from attention_reference import sdpa_reference as _reference

#: bf16 storage of O(1) values: max |got - ref| / max(1, max |ref|)
TOL = {"o": 2e-2, "lse": 1e-2, "dq": 5e-2, "dk": 5e-2, "dv": 5e-2}
#: (BH, L, S, HD, causal): dense inputs; L != S (causal: key j <= query i), lengths that are no tile multiple
DENSE = [(6, 1000, 1000, 64, True), (6, 1000, 1000, 64, False), (5, 77, 77, 128, False), (5, 77, 77, 128, True),
         (7, 333, 333, 128, True), (3, 200, 300, 64, False), (2, 300, 200, 128, True)]
#: (B, T, H, HD, causal): fused qkv projections
QKV = [(2, 1000, 3, 64, True), (3, 77, 2, 128, True), (1, 300, 5, 64, False)]


def _dense_inputs(BH, L, S, hd):
    rng = np.random.default_rng(BH * L + 7 * S + hd)
    return [_bf16(rng.standard_normal((BH, n, hd))) for n in (L, S, S, L)]  # q, k, v, dO


def _qkv_inputs(B, T, H, hd):
    rng = np.random.default_rng(B * T + H + hd)
    return _bf16(rng.standard_normal((B, T, 3, H, hd))), _bf16(rng.standard_normal((B, T, H, hd)))


def _heads(a, B, T, H, hd):
    """(B, T, H, HD) -> (B*H, T, HD)."""
    return a.reshape(B, T, H, hd).transpose(0, 2, 1, 3).reshape(B * H, T, hd)


def _qkv_reference(qkv, do, B, T, H, hd, causal):
    q, k, v = (_heads(qkv[:, :, j], B, T, H, hd) for j in range(3))
    return _reference(q, k, v, _heads(do, B, T, H, hd), causal, 1.0 / math.sqrt(hd))


def _errors(got: dict, want: dict) -> dict:
    return {n: float(np.abs(got[n] - want[n]).max() / max(1.0, np.abs(want[n]).max())) for n in got}


def _check(fast: dict, other: dict, names: str = "fast") -> None:
    """Both within TOL of float64; ``fast``'s error at most twice ``other``'s + 2e-3, per tensor."""
    for n, e in fast.items():
        assert e <= TOL[n], f"{names} {n}: {e:.3g} > {TOL[n]}"
        assert other[n] <= TOL[n], f"other {n}: {other[n]:.3g} > {TOL[n]}"
        assert e <= 2 * other[n] + 2e-3, f"{names} {n}: {e:.3g} vs the other kernel's {other[n]:.3g}"


# ------------------------------------------------------------------------------------------------------- GPU
def _sm90() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0 and int(cupy.cuda.Device().compute_capability) == 90
    except Exception:  # noqa: BLE001 - no CuPy, no driver
        return False


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 (Hopper) GPU")
#: polls after which an mbarrier wait of the Hopper kernels traps (kernels/hopper.cuh): a deadlock fails the test
MBAR_SPIN_LIMIT = "(1u << 24)"


@pytest.fixture(scope="module")
def mbarrier_watchdog():
    """sdpa_wgmma.cu built with BLU_MBAR_SPIN_LIMIT for this module's tests (fresh module, function and shared-memory
    opt-in caches, the earlier ones restored after)."""
    from blutensor.backends.cupy import _loader

    plain = _loader.source

    def watched(file: str) -> str:
        text = plain(file)
        return f"#define BLU_MBAR_SPIN_LIMIT {MBAR_SPIN_LIMIT}\n" + text if file == "sdpa_wgmma.cu" else text

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_loader, "source", watched)
        mp.setattr(_loader, "_modules", {})
        mp.setattr(_loader, "_functions", {})
        mp.setattr(_loader, "_smem_set", {})  # the new functions' shared-memory opt-in is set again
        yield


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("BH, L, S, hd, causal", DENSE)
def test_cuda_wgmma_matches_float64_and_mma_sync(BH, L, S, hd, causal, mbarrier_watchdog):
    import cupy as cp

    (qb, q), (kb, k), (vb, v), (db, do) = _dense_inputs(BH, L, S, hd)
    sc = 1.0 / math.sqrt(hd)
    want = _reference(q, k, v, do, causal, sc)
    gq, gk, gv, gdo = (cp.asarray(a) for a in (qb, kb, vb, db))
    errs, grads = {}, {}
    for variant in ("bf16_wgmma", "bf16"):
        o, lse = bt.ext.flash_attention_forward(gq, gk, gv, causal, sc, variant)
        g = bt.ext.flash_attention_backward(gq, gk, gv, o, lse, gdo, causal, sc, variant)
        grads[variant] = g
        got = {"o": _f64(o.get()), "lse": lse.get().astype(np.float64)}
        got.update(zip(("dq", "dk", "dv"), (_f64(x.get()) for x in g)))
        errs[variant] = _errors(got, want)
    _check(errs["bf16_wgmma"], errs["bf16"], "wgmma")
    o, lse = bt.ext.flash_attention_forward(gq, gk, gv, causal, sc, "bf16_wgmma")
    with bt.policy.scope(deterministic=True):  # the split pair: no float atomics
        first = bt.ext.flash_attention_backward(gq, gk, gv, o, lse, gdo, causal, sc, "bf16_wgmma")
        again = bt.ext.flash_attention_backward(gq, gk, gv, o, lse, gdo, causal, sc, "bf16_wgmma")
    for a, b in zip(first, again):
        assert bool((a == b).all())


def _blu_qkv(qkv64, do64, B, T, H, hd, causal, device, dtype):
    """(o, dq, dk, dv) (B*H, T, HD) float64 from bt.ext.sdpa_qkv through autograd."""
    x = bt.tensor(qkv64.reshape(B, T, 3 * H * hd).astype(np.float32), device=device, dtype=dtype,
                  requires_grad=True)
    g = bt.tensor(do64.reshape(B, T, H * hd).astype(np.float32), device=device, dtype=dtype)
    y = bt.ext.sdpa_qkv(x, H, is_causal=causal)
    y.backward(g)
    o = y.detach().float().cpu().numpy().astype(np.float64)
    d = x.grad.float().cpu().numpy().astype(np.float64).reshape(B, T, 3, H, hd)
    got = {"o": _heads(o, B, T, H, hd)}
    got.update(zip(("dq", "dk", "dv"), (_heads(d[:, :, j], B, T, H, hd) for j in range(3))))
    return got


@pytest.mark.cuda
@needs_sm90
@pytest.mark.parametrize("B, T, H, hd, causal", QKV)
def test_cuda_wgmma_fused_qkv_matches_float64_and_mma_sync(B, T, H, hd, causal, mbarrier_watchdog):
    (_, qkv), (_, do) = _qkv_inputs(B, T, H, hd)
    want = _qkv_reference(qkv, do, B, T, H, hd, causal)
    errs = {}
    for kernel in ("wgmma", "mma"):
        with bt.policy.scope(attention=kernel):  # the execution policy's attention variant
            got = _blu_qkv(qkv, do, B, T, H, hd, causal, "cuda", bt.bfloat16)
        errs[kernel] = _errors(got, {n: want[n] for n in got})
    _check(errs["wgmma"], errs["mma"], "wgmma")


# ---------------------------------------------------------------------------------------------- CPU twins
def _cpu_dense(q, k, v, do, causal, sc):
    """(o, dq, dk, dv) float64 of F.scaled_dot_product_attention on float32 CPU tensors."""
    t = [bt.tensor(a.astype(np.float32), requires_grad=True) for a in (q, k, v)]
    y = F.scaled_dot_product_attention(*t, is_causal=causal, scale=sc)
    y.backward(bt.tensor(do.astype(np.float32)))
    got = {"o": y.detach().numpy().astype(np.float64)}
    got.update(zip(("dq", "dk", "dv"), (a.grad.numpy().astype(np.float64) for a in t)))
    return got


@pytest.mark.parametrize("BH, L, S, hd, causal", DENSE)
def test_cpu_twin_compiled_attention_matches_float64_and_the_reference_kernel(BH, L, S, hd, causal):
    if not bt.ext.cpu_kernels_status()["available"]:
        pytest.skip("the compiled CPU kernels are not built here")
    (_, q), (_, k), (_, v), (_, do) = _dense_inputs(BH, L, S, hd)
    sc = 1.0 / math.sqrt(hd)
    want = _reference(q, k, v, do, causal, sc)
    fast = _cpu_dense(q, k, v, do, causal, sc)
    with bt.ext.reference_kernels():
        other = _cpu_dense(q, k, v, do, causal, sc)
    _check(_errors(fast, want), _errors(other, want), "cpu kernel")
    again = _cpu_dense(q, k, v, do, causal, sc)
    for n in ("dq", "dk", "dv"):
        assert np.array_equal(fast[n], again[n])  # bitwise repeatable


@pytest.mark.parametrize("B, T, H, hd, causal", QKV)
def test_cpu_twin_fused_qkv_matches_float64_and_the_reference_kernel(B, T, H, hd, causal):
    if not bt.ext.cpu_kernels_status()["available"]:
        pytest.skip("the compiled CPU kernels are not built here")
    (_, qkv), (_, do) = _qkv_inputs(B, T, H, hd)
    want = _qkv_reference(qkv, do, B, T, H, hd, causal)
    fast = _blu_qkv(qkv, do, B, T, H, hd, causal, "cpu", bt.float32)
    with bt.ext.reference_kernels():
        other = _blu_qkv(qkv, do, B, T, H, hd, causal, "cpu", bt.float32)
    _check(_errors(fast, {n: want[n] for n in fast}), _errors(other, {n: want[n] for n in other}), "cpu kernel")
