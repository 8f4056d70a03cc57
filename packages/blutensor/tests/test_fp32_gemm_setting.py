"""bt.set_fp32_gemm / BLUTRAIN_FP32_GEMM: the fp32 GEMM algorithm (strict SGEMM or fp32-accurate 3xTF32)."""

from __future__ import annotations

import blutensor as bt
import numpy as np
import pytest
from blutensor import gemm


@pytest.fixture(autouse=True)
def _restore(monkeypatch):
    monkeypatch.delenv("BLUTRAIN_FP32_GEMM", raising=False)
    yield
    monkeypatch.delenv("BLUTRAIN_FP32_GEMM", raising=False)
    gemm.set_fp32_gemm(None)


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
    assert bt.get_fp32_gemm() == "3xtf32"


def test_bad_values_name_the_setting(monkeypatch):
    with pytest.raises(ValueError, match="fp32"):
        bt.set_fp32_gemm("fast")
    bt.set_fp32_gemm(None)
    monkeypatch.setenv("BLUTRAIN_FP32_GEMM", "tf32")
    with pytest.raises(ValueError, match="BLUTRAIN_FP32_GEMM"):
        bt.get_fp32_gemm()


def test_cpu_matmul_unchanged_by_3xtf32():
    """On CPU (NumPy provider) the fp32 result is the plain product whichever algorithm is chosen."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((17, 9)).astype(np.float32), rng.standard_normal((9, 5)).astype(np.float32)
    bt.set_fp32_gemm("3xtf32")
    got = (bt.tensor(a) @ bt.tensor(b)).numpy()
    np.testing.assert_allclose(got, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-5)
