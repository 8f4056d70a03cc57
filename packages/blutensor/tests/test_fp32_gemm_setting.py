"""bt.set_fp32_gemm / BLUTRAIN_FP32_GEMM: the fp32 GEMM algorithm (strict SGEMM or fp32-accurate 3xTF32), the
execution policy's ``fp32_gemm`` (the variable is read once: ``bt.policy.reset_defaults()`` reads it again)."""

from __future__ import annotations

import blutensor as bt
import numpy as np
import pytest


@pytest.fixture(autouse=True)
def _restore(monkeypatch):
    monkeypatch.delenv("BLUTRAIN_FP32_GEMM", raising=False)
    bt.policy.reset_defaults()
    yield
    monkeypatch.delenv("BLUTRAIN_FP32_GEMM", raising=False)
    bt.policy.reset_defaults()


def test_default_is_strict_and_setting_round_trips():
    bt.set_fp32_gemm(None)
    assert bt.get_fp32_gemm() == "strict"
    bt.set_fp32_gemm("3xtf32")
    assert bt.get_fp32_gemm() == "3xtf32"
    bt.set_fp32_gemm("strict")
    assert bt.get_fp32_gemm() == "strict"


def test_env_var_chooses_when_not_set(monkeypatch):
    bt.set_fp32_gemm(None)
    monkeypatch.setenv("BLUTRAIN_FP32_GEMM", "3xtf32")
    assert bt.get_fp32_gemm() == "strict"  # read once: a later change of the environment changes nothing
    bt.policy.reset_defaults()
    assert bt.get_fp32_gemm() == "3xtf32"
    bt.set_fp32_gemm("strict")
    bt.set_fp32_gemm(None)  # back to what the environment asked for
    assert bt.get_fp32_gemm() == "3xtf32"


def test_bad_values_name_the_setting(monkeypatch):
    with pytest.raises(ValueError, match="fp32"):
        bt.set_fp32_gemm("fast")
    monkeypatch.setenv("BLUTRAIN_FP32_GEMM", "tf32")
    bt.policy.reset_defaults()
    with pytest.raises(ValueError, match=r"BLUTRAIN_FP32_GEMM must be one of \('strict', '3xtf32'\), got 'tf32'"):
        bt.get_fp32_gemm()


def test_cpu_matmul_unchanged_by_3xtf32():
    """On CPU (NumPy provider) the fp32 result is the plain product whichever algorithm is chosen."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((17, 9)).astype(np.float32), rng.standard_normal((9, 5)).astype(np.float32)
    bt.set_fp32_gemm("3xtf32")
    got = (bt.tensor(a) @ bt.tensor(b)).numpy()
    np.testing.assert_allclose(got, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-5)


class _Recorder:
    """A fake GEMM provider that records the precision and the operands' shapes of each call."""

    PLUGIN_NAME = "recorder"
    PRECISIONS = ("fp32", "tf32", "bf16", "3xtf32")
    calls: list = []

    @classmethod
    def matmul(cls, a, b, *, trans_a=False, trans_b=False, precision="fp32", bias=None):
        cls.calls.append((a.shape, trans_a, precision))
        return (a.T if trans_a else a) @ (b.T if trans_b else b)


def test_3xtf32_keeps_long_reductions_strict(monkeypatch):
    """Under '3xtf32' a GEMM whose reduction (K) exceeds BLUTRAIN_3XTF32_MAX_K (default 4096) runs strict
    ('fp32'): weight gradients sum over all tokens; shorter ones, transposed operands included, stay 3xtf32."""
    from blutensor import gemm

    monkeypatch.delenv("BLUTRAIN_3XTF32_MAX_K", raising=False)
    bt.policy.reset_defaults()
    bt.set_fp32_gemm("3xtf32")
    _Recorder.calls.clear()
    rng = np.random.default_rng(1)
    short = rng.standard_normal((8, 4096)).astype(np.float32)
    long_ = rng.standard_normal((4097, 8)).astype(np.float32)  # used transposed: K = 4097
    gemm._call(_Recorder, short, short.T, "3xtf32", np)
    out = gemm._call(_Recorder, long_.T, long_, "3xtf32", np)
    np.testing.assert_allclose(out, long_.T.astype(np.float64) @ long_, rtol=1e-4, atol=1e-3)
    assert [c[2] for c in _Recorder.calls] == ["3xtf32", "fp32"] and _Recorder.calls[1][1] is True
    with bt.policy.scope(max_3xtf32_k=100000):
        gemm._call(_Recorder, long_.T, long_, "3xtf32", np)
    assert _Recorder.calls[-1][2] == "3xtf32"
    monkeypatch.setenv("BLUTRAIN_3XTF32_MAX_K", "100000")
    bt.policy.reset_defaults()
    bt.set_fp32_gemm("3xtf32")
    gemm._call(_Recorder, long_.T, long_, "3xtf32", np)
    assert _Recorder.calls[-1][2] == "3xtf32"
    gemm._call(_Recorder, long_.T, long_, "tf32", np)  # other precisions are never touched
    assert _Recorder.calls[-1][2] == "tf32"
    monkeypatch.setenv("BLUTRAIN_3XTF32_MAX_K", "lots")
    bt.policy.reset_defaults()
    with pytest.raises(ValueError, match="BLUTRAIN_3XTF32_MAX_K"):
        gemm._call(_Recorder, short, short.T, "3xtf32", np)
