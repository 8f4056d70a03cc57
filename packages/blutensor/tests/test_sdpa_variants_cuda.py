"""Every flash-attention variant on the GPU against float64 (kernels/sdpa.cu, kernels/sdpa_mma.cu), beyond the
dense short-sequence checks of tests/kernel_checks.py: the strided fused-qkv entries (the layout GPT-2 calls) of
every variant, sequences spanning many tiles, both backward kernels (fused with atomic dQ, and split) of the
variants that have a fused one, tf32x3's error against the SIMT fp32 kernel's on the same data, and bitwise
repeatable backward passes under ``bt.use_deterministic_algorithms(True)``.

Error: max |out - ref| / max |ref| per tensor (o, lse; dq, dk, dv). CPU twins: the emulated kernels
(tests/test_cuda_kernels.py ``test_cpu_emulated_*``, tests/test_sdpa_mma.py) and the CPU fused-qkv path
(tests/test_sdpa_qkv.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import blutensor as bt
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dev"))
import kernel_reference as ref  # noqa: E402

pytestmark = pytest.mark.cuda

#: max abs error / max |ref|, forward (o, lse) and backward (dq, dk, dv)
TOL = {
    "f32": {"fwd": 1e-5, "bwd": 5e-5},
    "tf32x3": {"fwd": 2e-5, "bwd": 5e-5},
    "tf32": {"fwd": 4e-3, "bwd": 1e-2},
    "bf16": {"fwd": 2e-2, "bwd": 4e-2},
}
#: tf32x3's error stays within this multiple of the SIMT fp32 kernel's (above a 1e-6 floor), per head dim: HD 64
#: stages its long sums; HD 128 does not (registers), so its truncation bias grows with the number of keys
X3_VS_F32 = {64: 3.0, 128: 12.0}
FUSED = ("tf32", "tf32x3")  # variants with a fused backward kernel
VARIANT_MODES = [(v, m) for v in ("f32", "tf32", "tf32x3", "bf16") for m in (("fused", "split") if v in FUSED
                                                                                 else ("split",))]


def _cupy():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
        return cupy
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"needs CuPy and a CUDA GPU: {exc}")


def _dev(cp, x64: np.ndarray, variant: str):
    """(device array in the variant's storage: fp32, or bf16 bits; the float64 values it holds)."""
    if variant == "bf16":
        bits = ref.f32_to_bf16_bits(np.asarray(x64, np.float32))
        return cp.asarray(bits), ref.bf16_bits_to_f64(bits)
    h = np.asarray(x64, np.float32)
    return cp.asarray(h), h.astype(np.float64)


def _host(cp, a) -> np.ndarray:
    h = cp.asnumpy(a)
    return ref.bf16_bits_to_f64(h) if h.dtype == np.uint16 else h.astype(np.float64)


def _dense(cp, variant: str, n: int, L: int, S: int, hd: int, causal: bool, seed: int):
    """Errors of (o, lse, dq, dk, dv) of the dense (BH, L, HD) entries against float64."""
    from blutensor.backends.cupy.sdpa import flash_attention_backward, flash_attention_forward

    rng = np.random.default_rng(seed)
    (q, q64), (k, k64), (v, v64), (do, do64) = (_dev(cp, rng.standard_normal((n, m, hd)), variant)
                                                for m in (L, S, S, L))
    o, lse = flash_attention_forward(q, k, v, causal, None, variant)
    grads = flash_attention_backward(q, k, v, o, lse, do, causal, None, variant)
    eo, else_ = ref.sdpa(q64, k64, v64, causal)
    want = [eo, else_, *ref.sdpa_backward(q64, k64, v64, do64, causal)]
    got = [_host(cp, a) for a in (o, lse, *grads)]
    return dict(zip(("o", "lse", "dq", "dk", "dv"), (ref.rel_err(a, e) for a, e in zip(got, want))))


def _assert_within(errs: dict, variant: str, what: str) -> None:
    fwd, bwd = max(errs["o"], errs["lse"]), max(errs["dq"], errs["dk"], errs["dv"])
    assert fwd <= TOL[variant]["fwd"] and bwd <= TOL[variant]["bwd"], (what, errs)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("variant,mode", VARIANT_MODES)
def test_cuda_strided_qkv_entries_match_float64(variant, mode, hd, causal, monkeypatch):
    """The fused-qkv entries read q, k, v in place from (B, T, 3, H, HD) and write o as (B, T, H, HD)."""
    cp = _cupy()
    from blutensor.backends.cupy.sdpa import qkv_attention_backward, qkv_attention_forward

    bt.policy.update(attention_backward=mode)  # reset by conftest
    B, H, T = 2, 3, 150
    rng = np.random.default_rng([T, hd, int(causal)])
    qkv, qkv64 = _dev(cp, rng.standard_normal((B, T, 3, H, hd)), variant)
    do, do64 = _dev(cp, rng.standard_normal((B, T, H, hd)), variant)
    o, lse = qkv_attention_forward(qkv, causal, None, variant)
    dqkv = _host(cp, qkv_attention_backward(qkv, o, lse, do, causal, None, variant))

    def heads(x):  # (B, T, H, HD) -> (B*H, T, HD)
        return x.transpose(0, 2, 1, 3).reshape(B * H, T, hd)

    q64, k64, v64 = (heads(qkv64[:, :, i]) for i in range(3))
    eo, else_ = ref.sdpa(q64, k64, v64, causal)
    want = [eo, else_, *ref.sdpa_backward(q64, k64, v64, heads(do64), causal)]
    got = [heads(_host(cp, o)), _host(cp, lse).reshape(B * H, T), *(heads(dqkv[:, :, i]) for i in range(3))]
    errs = dict(zip(("o", "lse", "dq", "dk", "dv"), (ref.rel_err(a, e) for a, e in zip(got, want))))
    _assert_within(errs, variant, f"{variant}/{mode} strided T={T} hd={hd} causal={causal}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("variant,mode", VARIANT_MODES)
def test_cuda_dense_entries_over_many_tiles_match_float64(variant, mode, hd, causal, monkeypatch):
    """1000 queries and keys: many query and key tiles, the causal diagonal crossing tile edges."""
    cp = _cupy()
    bt.policy.update(attention_backward=mode)  # reset by conftest
    errs = _dense(cp, variant, 2, 1000, 1000, hd, causal, seed=1000 + hd + int(causal))
    _assert_within(errs, variant, f"{variant}/{mode} dense 1000 hd={hd} causal={causal}")


@pytest.mark.parametrize("mode", ["fused", "split"])
@pytest.mark.parametrize("hd", [64, 128])
def test_cuda_tf32x3_error_tracks_the_simt_fp32_kernel(hd, mode, monkeypatch):
    """fp32 on the matrix units: on the same inputs tf32x3's error is a small multiple of the SIMT kernel's."""
    cp = _cupy()
    bt.policy.update(attention_backward=mode)  # reset by conftest
    for L, S, causal in ((77, 77, True), (100, 130, False), (1000, 1000, True)):
        seed = L * 7 + S + hd + int(causal)
        e32 = max(_dense(cp, "f32", 3, L, S, hd, causal, seed).values())
        ex3 = max(_dense(cp, "tf32x3", 3, L, S, hd, causal, seed).values())
        assert ex3 <= X3_VS_F32[hd] * max(e32, 1e-6), (L, S, causal, ex3, e32)


@pytest.mark.parametrize("variant", ["f32", "tf32", "tf32x3", "bf16"])
def test_cuda_deterministic_backward_is_bitwise_repeatable(variant, monkeypatch):
    """Under bt.use_deterministic_algorithms(True) the default backward ('auto') runs the split kernels: two runs
    give the same bits. The fused kernel (atomic dQ) may differ run to run, but only within the tolerance."""
    cp = _cupy()
    from blutensor.backends.cupy.sdpa import qkv_attention_backward, qkv_attention_forward

    bt.policy.update(attention_backward="auto")
    rng = np.random.default_rng(3)
    qkv, _ = _dev(cp, rng.standard_normal((2, 512, 3, 4, 64)), variant)
    do, _ = _dev(cp, rng.standard_normal((2, 512, 4, 64)), variant)
    o, lse = qkv_attention_forward(qkv, True, None, variant)
    bt.use_deterministic_algorithms(True)
    try:
        g1 = qkv_attention_backward(qkv, o, lse, do, True, None, variant)
        g2 = qkv_attention_backward(qkv, o, lse, do, True, None, variant)
    finally:
        bt.use_deterministic_algorithms(False)
    assert bool(cp.array_equal(g1, g2))
    if variant in FUSED:
        bt.policy.update(attention_backward="fused")  # reset by conftest
        f1, f2 = (_host(cp, qkv_attention_backward(qkv, o, lse, do, True, None, variant)) for _ in range(2))
        split = _host(cp, g1)
        assert ref.rel_err(f1, f2) <= TOL[variant]["bwd"]
        assert ref.rel_err(f1, split) <= TOL[variant]["bwd"]
