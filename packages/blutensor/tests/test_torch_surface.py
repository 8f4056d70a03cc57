"""PyTorch-named conveniences: inference_mode, set_float32_matmul_precision, Generator basics, randperm,
and ``import blutensor as torch`` attribute access to nn / nn.functional / optim / utils.data."""

from __future__ import annotations

import blutensor as bt
import numpy as np
import pytest


def test_inference_mode_forms():
    x = bt.ones(2, requires_grad=True)
    with bt.inference_mode():
        assert bt.is_inference_mode_enabled() and not bt.is_grad_enabled()
        assert (x * 2).grad_fn is None
    assert not bt.is_inference_mode_enabled() and bt.is_grad_enabled()
    with bt.inference_mode(False):
        assert (x * 2).grad_fn is not None

    @bt.inference_mode
    def bare():
        return (x * 2).grad_fn

    @bt.inference_mode()
    def called():
        return (x * 2).grad_fn

    assert bare() is None and called() is None and bt.is_grad_enabled()
    with bt.no_grad():
        assert not bt.is_inference_mode_enabled()  # no_grad is not inference mode, as in PyTorch
    with pytest.raises(bt.DTypeError, match="inference_mode: mode must be a bool"):
        bt.inference_mode("yes")


def test_float32_matmul_precision_maps_to_blutensor_modes():
    prev = bt.get_matmul_precision()
    try:
        for torch_name, ours in (("high", "tf32"), ("medium", "bf16"), ("highest", "fp32")):
            bt.set_float32_matmul_precision(torch_name)
            assert bt.get_matmul_precision() == ours and bt.get_float32_matmul_precision() == torch_name
        with pytest.raises(ValueError, match="must be 'highest', 'high' or 'medium'"):
            bt.set_float32_matmul_precision("low")
    finally:
        bt.set_matmul_precision(prev)


def test_generator_and_randperm():
    g = bt.Generator(device="cpu").manual_seed(42)
    assert g.initial_seed() == 42 and g.device == bt.device("cpu")
    assert bt.Generator("cpu").initial_seed() == 0
    a = bt.randperm(10, generator=bt.Generator(4)).numpy()
    b = bt.randperm(10, generator=bt.Generator(4)).numpy()
    assert a.dtype == np.int64 and sorted(a.tolist()) == list(range(10)) and (a == b).all()
    assert bt.randperm(10, generator=bt.Generator(5)).tolist() != a.tolist()
    bt.manual_seed(3)
    assert bt.initial_seed() == 3 and bt.randperm(0).shape == (0,)
    with pytest.raises(bt.ArgumentError, match="randperm: n must be a non-negative int"):
        bt.randperm(-1)


def test_import_blutensor_as_torch_attribute_access():
    import blutensor as torch

    assert torch.nn.functional.softmax is bt.nn.functional.softmax
    assert torch.optim.lr_scheduler.CosineAnnealingLR and torch.optim.Adam
    assert torch.utils.data.DataLoader and torch.nn.utils.clip_grad_norm_ is bt.optim.clip_grad_norm_
    assert torch.nn.init.trunc_normal_ and torch.save and torch.load


def test_cuda_is_bf16_supported_never_raises():
    assert isinstance(bt.cuda.is_bf16_supported(), bool)
    if not bt.cuda.is_available():
        assert bt.cuda.is_bf16_supported() is False
