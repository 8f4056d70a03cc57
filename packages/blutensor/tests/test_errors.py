"""Bad input fails early with an error naming the op and the shapes, dtypes or devices involved."""

from __future__ import annotations

import blutensor as bt
import blutensor.nn.functional as F
import pytest
from conftest import HAS_CUDA


def test_broadcast_mismatch_names_op_and_shapes(device):
    a, b = bt.zeros(2, 3, device=device), bt.zeros(4, device=device)
    with pytest.raises(bt.ShapeError, match=r"add failed on Tensor\(shape=\(2, 3\).*Tensor\(shape=\(4,\)"):
        a + b
    with pytest.raises(bt.ShapeError, match=r"mul.*\(2, 3\).*\(4,\)"):
        a * b


def test_matmul_shape_mismatch(device):
    with pytest.raises(bt.ShapeError, match=r"matmul: inner dimensions differ: \(2, 3\) @ \(4, 5\)"):
        bt.zeros(2, 3, device=device) @ bt.zeros(4, 5, device=device)
    with pytest.raises(bt.ShapeError, match=r"batch dims"):
        bt.zeros(2, 2, 3, device=device) @ bt.zeros(3, 3, 4, device=device)
    with pytest.raises(bt.ShapeError, match=r"bmm: expected \(B,N,K\) @ \(B,K,M\)"):
        bt.bmm(bt.zeros(2, 2, 3, device=device), bt.zeros(3, 3, 4, device=device))


def test_dtype_mismatch_names_dtypes(device):
    """Elementwise ops promote mixed dtypes (PyTorch's result_type); matmul refuses them by name."""
    a = bt.zeros(2, device=device)
    b = bt.zeros(2, dtype=bt.float64, device=device)
    assert (a + b).dtype is bt.float64
    with pytest.raises(bt.DTypeError, match=r"matmul.*float32.*float64"):
        a @ b


def test_device_mismatch_names_devices():
    a = bt.zeros(2)
    b = bt.zeros(2)
    b.device = bt.device("cuda:0")  # a fake placement: the check runs before any kernel
    with pytest.raises(bt.DeviceError, match=r"add: expected all tensors on one device.*device=cpu.*device=cuda:0"):
        a + b


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CuPy and a CUDA GPU")
def test_device_mismatch_real_cuda():
    with pytest.raises(bt.DeviceError, match=r"mul.*cpu.*cuda:0"):
        bt.zeros(2) * bt.zeros(2, device="cuda")


def test_backward_twice_and_without_grad(device):
    x = bt.ones(2, device=device, requires_grad=True)
    y = (x * x).sum()
    y.backward()
    with pytest.raises(bt.AutogradError, match=r"second time \(op 'sum'\).*retain_graph=True"):
        y.backward()
    with pytest.raises(bt.AutogradError, match=r"Tensor\(shape=\(2,\), dtype=float32.*does not require grad"):
        bt.ones(2, device=device).backward(bt.ones(2, device=device))


def test_backward_gradient_shape_mismatch(device):
    x = bt.ones(2, 3, device=device, requires_grad=True)
    with pytest.raises(bt.ShapeError, match=r"gradient Tensor\(shape=\(3,\).*shape=\(2, 3\)"):
        (x * 2).backward(bt.ones(3, device=device))


def test_view_and_reshape_errors(device):
    x = bt.zeros(2, 3, device=device)
    with pytest.raises(bt.ShapeError, match=r"view: shape \(4, 2\) is invalid for input of shape \(2, 3\)"):
        x.view(4, 2)
    with pytest.raises(bt.ShapeError, match=r"only one dimension can be -1"):
        x.reshape(-1, -1)
    with pytest.raises(bt.ShapeError, match=r"permute: dims"):
        x.permute(0, 0)
    with pytest.raises(bt.ShapeError, match=r"dim 2 out of range"):
        x.sum(dim=2)
    with pytest.raises(bt.ShapeError, match=r"indexing a tensor of shape \(2, 3\)"):
        x[5]
    with pytest.raises(bt.ShapeError, match=r"expand: cannot expand shape \(2, 3\)"):
        x.expand(4, 3)
    with pytest.raises(bt.ShapeError, match=r"cat: tensor 1 has shape \(2, 4\)"):
        bt.cat([x, bt.zeros(2, 4, device=device)], 0)


@pytest.mark.parametrize("dtype", [bt.float32, bt.float64])
def test_index_range_errors(dtype, device, monkeypatch):
    """Out-of-range class targets and embedding indices (float32 on CUDA runs the fused kernels, whose default
    check is lazy -- raised by index_check.raise_pending, see test_cuda_kernels -- so here raise at the call)."""
    bt.policy.update(validate_indices="sync")  # conftest resets the policy after the test
    with pytest.raises(bt.ShapeError, match=r"cross_entropy: target index 7 out of range for 5 classes"):
        F.cross_entropy(bt.zeros(3, 5, dtype=dtype, device=device), bt.tensor([0, 7, 1], device=device))
    with pytest.raises(bt.ShapeError, match=r"embedding: index (4 )?out of range \[0, 4\)"):
        F.embedding(bt.tensor([1, 4], device=device), bt.zeros(4, 2, dtype=dtype, device=device))


def test_nn_op_errors(device):
    with pytest.raises(bt.ShapeError, match=r"cross_entropy: logits \(3, 5\).*target.*got \(4,\)"):
        F.cross_entropy(bt.zeros(3, 5, device=device), bt.tensor([0, 1, 1, 2], device=device))
    with pytest.raises(bt.ShapeError, match="class probabilities.*class indices must be an integer Tensor"):
        F.cross_entropy(bt.zeros(3, 5, device=device), bt.zeros(3, device=device))
    with pytest.raises(bt.ShapeError, match=r"layer_norm: input shape \(2, 3\) does not end with"):
        F.layer_norm(bt.zeros(2, 3, device=device), (4,))
    with pytest.raises(bt.ShapeError, match=r"linear: input features 3.*weight shape \(4, 5\)"):
        F.linear(bt.zeros(2, 3, device=device), bt.zeros(4, 5, device=device))


def test_inplace_errors(device):
    w = bt.ones(2, device=device, requires_grad=True)
    with pytest.raises(bt.AutogradError, match=r"leaf tensor that requires grad.*'add_'"):
        w.add_(1)
    with pytest.raises(bt.AutogradError, match="fill_"):
        w.fill_(0)
    with pytest.raises(bt.ShapeError, match="copy_"):
        bt.zeros(2, device=device).copy_(bt.zeros(3, device=device))


def test_unknown_dtype():
    with pytest.raises(TypeError, match="unknown dtype 'float8'"):
        bt.zeros(2, dtype="float8")


def test_mean_var_need_floating_point(device):
    with pytest.raises(bt.DTypeError,
                       match=r"mean: needs a floating-point tensor, got Tensor\(shape=\(3,\), dtype=int64"):
        bt.arange(3, device=device).mean()
    with pytest.raises(bt.DTypeError, match="var"):
        bt.arange(3, device=device).var()
    assert bt.where(bt.arange(3, device=device) > 0, 1.0, 0.0).dtype is bt.float32
