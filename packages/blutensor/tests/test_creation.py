"""Tensor creation, dtypes, devices and metadata: tensor/zeros/ones/empty/full/arange/randn/rand/*_like,
.to(), .numpy(), .item(), .shape, .stride(), .dtype, .device, .is_contiguous(), version counter."""

from __future__ import annotations

import blutensor as bt
import ml_dtypes
import numpy as np
import pytest
from conftest import host

DTYPES = [bt.float32, bt.float64, bt.bfloat16, bt.int32, bt.int64, bt.uint16]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_factories_all_dtypes(dtype, device):
    for t, ref in [(bt.zeros(2, 3, dtype=dtype, device=device), np.zeros((2, 3))),
                   (bt.ones((2, 3), dtype=dtype, device=device), np.ones((2, 3))),
                   (bt.full((2, 3), 7, dtype=dtype, device=device), np.full((2, 3), 7)),
                   (bt.arange(6, dtype=dtype, device=device), np.arange(6)),
                   (bt.tensor([[1, 2], [3, 4]], dtype=dtype, device=device), np.array([[1, 2], [3, 4]]))]:
        assert t.dtype is dtype and t.device == bt.device(device)
        assert tuple(t.shape) == ref.shape
        np.testing.assert_array_equal(host(t), ref)
    e = bt.empty(4, 5, dtype=dtype, device=device)
    assert tuple(e.shape) == (4, 5) and e.dtype is dtype
    assert e.element_size() == {"float32": 4, "float64": 8, "bfloat16": 2, "int32": 4, "int64": 8,
                                "uint16": 2}[dtype.name]


def test_default_dtypes(device):
    assert bt.tensor([1.0, 2.0], device=device).dtype is bt.float32
    assert bt.tensor([1, 2], device=device).dtype is bt.int64
    assert bt.tensor([True], device=device).dtype is bt.bool
    assert bt.zeros(2, device=device).dtype is bt.float32
    assert bt.full((2,), 3, device=device).dtype is bt.int64
    assert bt.full((2,), 3.5, device=device).dtype is bt.float32
    assert bt.arange(3, device=device).dtype is bt.int64
    assert bt.arange(0, 1, 0.25, device=device).dtype is bt.float32
    assert bt.tensor(np.zeros(2, np.float64), device=device).dtype is bt.float64


def test_like_factories(device):
    x = bt.tensor([[1.0, 2.0]], dtype=bt.float64, device=device)
    for t in (bt.zeros_like(x), bt.ones_like(x), bt.empty_like(x), bt.full_like(x, 3.0), bt.randn_like(x),
              bt.rand_like(x)):
        assert t.dtype is bt.float64 and t.device == x.device and tuple(t.shape) == (1, 2)
    assert bt.zeros_like(x, dtype=bt.int32).dtype is bt.int32
    np.testing.assert_array_equal(host(bt.full_like(x, 3.0)), [[3.0, 3.0]])


def test_rand_randn_statistics(device):
    r = bt.rand(10000, device=device)
    n = bt.randn(10000, device=device)
    assert 0 <= host(r).min() and host(r).max() < 1 and abs(host(r).mean() - 0.5) < 0.02
    assert abs(host(n).mean()) < 0.05 and abs(host(n).std() - 1) < 0.05
    i = bt.randint(3, 9, (1000,), device=device)
    assert i.dtype is bt.int64 and host(i).min() == 3 and host(i).max() == 8


def test_metadata(device):
    t = bt.zeros(2, 3, 4, device=device)
    assert t.shape == (2, 3, 4) and t.size() == (2, 3, 4) and t.size(1) == 3 and t.ndim == 3 and t.dim() == 3
    assert t.numel() == 24 and len(t) == 2
    assert t.stride() == (12, 4, 1) and t.stride(0) == 12 and t.is_contiguous()
    assert t.device.type == device and (t.device.index == 0 if device == "cuda" else t.device.index is None)
    assert t.is_cuda == (device == "cuda")
    assert bt.tensor(3.5, device=device).item() == 3.5
    assert bt.tensor([7], device=device).item() == 7
    assert bt.tensor([[1, 2]], device=device).tolist() == [[1, 2]]
    with pytest.raises(bt.ShapeError, match="one-element"):
        t.item()


def test_version_counter(device):
    t = bt.zeros(3, device=device)
    assert t._version.v == 0
    t.add_(1)
    t.mul_(2)
    t.fill_(4)
    t.zero_()
    t[0] = 1.0
    t.copy_(bt.ones(3, device=device))
    assert t._version.v == 6


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16, bt.int64], ids=lambda d: d.name)
def test_copy_from_a_host_tensor_lands_in_the_destination(dtype, device):
    """copy_ of a CPU tensor into a tensor on ``device`` writes the destination's own memory (on CUDA a contiguous
    destination of the same dtype and shape takes one host-to-device copy), from a contiguous or a strided source,
    into a strided destination, and with a dtype conversion, all equal to NumPy."""
    rng = np.random.default_rng(3)
    ref = np.round(rng.standard_normal((6, 5)) * 10)
    dst = bt.zeros(6, 5, dtype=dtype, device=device)
    storage = dst._data
    dst.copy_(bt.tensor(ref, dtype=dtype))
    assert dst._data is storage and dst._version.v == 1
    np.testing.assert_array_equal(host(dst).astype(np.float64), ref)
    src = bt.tensor(ref.T.copy(), dtype=dtype).t()  # a strided host source
    dst.zero_()
    dst.copy_(src)
    np.testing.assert_array_equal(host(dst).astype(np.float64), ref)
    wide = bt.zeros(6, 10, dtype=dtype, device=device)
    wide[:, ::2].copy_(bt.tensor(ref, dtype=dtype))  # a strided destination
    np.testing.assert_array_equal(host(wide).astype(np.float64)[:, ::2], ref)
    assert not host(wide).astype(np.float64)[:, 1::2].any()
    dst.copy_(bt.tensor(ref + 0.5, dtype=bt.float64))  # converted to the destination's dtype
    want = (ref + 0.5).astype(np.float32) if dtype is bt.float32 else None
    if want is not None:
        np.testing.assert_array_equal(host(dst), want)


def test_to_dtype_and_device(device):
    x = bt.tensor([1.5, -2.25], device="cpu")
    y = x.to(device)
    assert y.device == bt.device(device) and y.dtype is bt.float32
    z = y.to(bt.float64)
    assert z.dtype is bt.float64
    assert y.to(device) is y and y.to(bt.float32) is y
    b = y.to(bt.bfloat16)
    assert b.dtype is bt.bfloat16 and b.numpy().dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(host(b.to("cpu")), [1.5, -2.25])
    w = y.to(device, bt.int32)
    assert w.dtype is bt.int32 and host(w).tolist() == [1, -2]
    assert bt.tensor([1.0], device=device).to(x).device == bt.device("cpu")
    assert x.to("float64").dtype is bt.float64 and x.double().dtype is bt.float64 and x.long().dtype is bt.int64


def test_numpy_shares_memory_on_cpu():
    x = bt.zeros(3)
    x.numpy()[1] = 5
    assert x[1].item() == 5
    a = np.arange(4.0)
    t = bt.from_numpy(a)
    a[0] = 9
    assert t[0].item() == 9 and t.dtype is bt.float64


def test_bfloat16_storage(device):
    x = bt.tensor([1.0, 3.140625, -2.5], dtype=bt.bfloat16, device=device)
    assert x.numpy().dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(host(x), [1.0, 3.140625, -2.5])
    x.fill_(2.0)
    np.testing.assert_array_equal(host(x), [2.0, 2.0, 2.0])
    x[1] = -1.0
    np.testing.assert_array_equal(host(x), [2.0, -1.0, 2.0])
    r = bt.randn(1000, dtype=bt.bfloat16, device=device)
    assert abs(host(r).std() - 1) < 0.1
    if device == "cuda":
        assert x._data.dtype == np.uint16  # raw 16-bit storage on the GPU


def test_devices():
    assert bt.device("cpu").type == "cpu" and bt.device("cuda:1").index == 1 and bt.device("cuda").index == 0
    assert bt.device("cuda:0") == "cuda:0" and str(bt.device("cuda")) == "cuda:0"
    with pytest.raises(ValueError, match="bad device"):
        bt.device("tpu")


def test_cuda_unavailable_error():
    if bt.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(bt.DeviceError, match="cuda"):
        bt.zeros(2, device="cuda")


def test_repr(device):
    s = repr(bt.tensor([1.0, 2.0], device=device, requires_grad=True))
    assert s.startswith("tensor([1., 2.]") and "requires_grad=True" in s


def test_numpy_interop_and_format(device):
    t = bt.tensor([[1.0, 2.0]], device=device)
    np.testing.assert_array_equal(np.asarray(t), [[1.0, 2.0]])
    assert np.asarray(t, dtype=np.float64).dtype == np.float64
    s = bt.stack([bt.tensor(1.5, device=device), bt.tensor(2.5, device=device)])
    np.testing.assert_array_equal(host(s), [1.5, 2.5])
    assert f"{bt.tensor(0.123456, device=device):.3f}" == "0.123"
    out = np.float32(2.0) * t  # NumPy scalars defer to Tensor's operators
    assert isinstance(out, bt.Tensor) and out.dtype is bt.float32
