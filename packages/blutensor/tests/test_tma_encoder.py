"""The one TMA tensor-map encoder (backends/cupy/tma.py, public as blutensor.ext.tma) on the CPU: what it passes to
cuTensorMapEncodeTiled and the 128 descriptor bytes it returns, through the fake CUDA device's driver entry point
(testing/fake_cuda: records its arguments and writes a descriptor made of them); the same for a blublas GEMM
operand's rank-3 spec."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import blutensor as bt
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "testing"))
import fake_cuda  # noqa: E402

tma = bt.ext.tma


@pytest.fixture
def driver(monkeypatch):
    fake = fake_cuda.TensorMapDriver()  # the fake CUDA device's cuTensorMapEncodeTiled: records, packs its arguments
    monkeypatch.setattr(tma, "_CUDA", fake)
    tma.clear_cache()
    yield fake
    tma.clear_cache()


def test_descriptor_bytes_and_driver_arguments_of_a_rank4_map(driver):
    spec = tma.tensor_spec(0x10000, 2, (64, 77, 3, 2), (384 * 2, 128, 77 * 384 * 2), (64, 128, 1, 1))
    v = tma.encode(spec, "q")
    (c,) = driver.calls
    assert c["out"] % 64 == 0  # CUtensorMap must be 64-byte aligned
    assert (c["dtype"], c["rank"], c["addr"]) == (tma.DTYPE_BF16, 4, 0x10000)
    assert (c["dims"], c["strides"], c["box"], c["estr"]) == ((64, 77, 3, 2), (768, 128, 59136), (64, 128, 1, 1),
                                                              (1, 1, 1, 1))
    assert c["flags"] == (tma.INTERLEAVE_NONE, tma.SWIZZLE_128B, tma.L2_PROMOTION_256B, tma.OOB_FILL_ZERO)
    want = struct.pack("<4Q", tma.DTYPE_BF16, 4, 0x10000, 64 + 77 + 3 + 2) + bytes(range(96))
    assert v.dtype == tma.TMAP_DTYPE and v.shape == (1,) and v.tobytes() == want
    assert tma.encode(spec, "q") is v and len(driver.calls) == 1  # cached per spec


def test_a_blublas_gemm_operand_is_encoded_by_the_same_encoder(driver):
    blublas_tma = pytest.importorskip("blublas.tma")
    blublas_tma.use_encoder(tma)
    spec = blublas_tma.operand_spec(1 << 20, 300, 136, 136, 0, 0, 4, 128)  # fp32, 300 x 136, boxes 32 x 128
    v = blublas_tma.encode(spec, "a")
    (c,) = driver.calls
    assert (c["dtype"], c["rank"], c["dims"], c["strides"], c["box"]) == (
        tma.DTYPE_F32, 3, (136, 300, 1), (544, 544 * 300), (32, 128, 1))
    assert v.tobytes()[:32] == struct.pack("<4Q", tma.DTYPE_F32, 3, 1 << 20, 437)


def test_driver_failure_and_bad_specs_are_errors_naming_the_tensor(driver):
    driver.result = 1  # CUDA_ERROR_INVALID_VALUE
    spec = tma.tensor_spec(0x10000, 4, (32, 10), (128,), (32, 10))
    with pytest.raises(tma.TmaError, match="CUresult 1"):
        tma.encode(spec, "k")
    with pytest.raises(tma.TmaError, match="v: cannot be read by TMA .*16-byte aligned"):
        tma.encode(tma.tensor_spec(0x10008, 4, (32, 10), (128,), (32, 10)), "v")
    with pytest.raises(tma.TmaError, match="out: cannot be read by TMA .*128-byte inner extent"):
        tma.encode(tma.tensor_spec(0x10000, 4, (16, 10), (64,), (16, 10)), "out")
    with pytest.raises(tma.TmaError, match="rank 6"):
        tma.encode(tma.tensor_spec(0x10000, 4, (32,) * 6, (128,) * 5, (32,) + (1,) * 5), "x")
    assert isinstance(tma.TmaError("x"), ValueError)
    assert np.dtype(tma.TMAP_DTYPE).itemsize == 128
