"""nn: Module (parameters, named_parameters, buffers, state_dict/load_state_dict strict key and shape
checks, train/eval, to(device), apply), Parameter, layers, init functions."""

from __future__ import annotations

import math

import blutensor as bt
import blutensor.nn as nn
import numpy as np
import pytest
import torch
from conftest import host


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.ln = nn.LayerNorm(8)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.5)
        self.register_buffer("mask", bt.ones(8))
        self.register_buffer("scratch", bt.zeros(2), persistent=False)

    def forward(self, x):
        return self.drop(self.act(self.ln(self.fc(x)))) * self.mask


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 10, bias=False)
        self.seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU())


def test_parameters_buffers_names():
    net = Net()
    names = [n for n, _ in net.named_parameters()]
    assert names == ["emb.weight", "blocks.0.fc.weight", "blocks.0.fc.bias", "blocks.0.ln.weight",
                     "blocks.0.ln.bias", "blocks.1.fc.weight", "blocks.1.fc.bias", "blocks.1.ln.weight",
                     "blocks.1.ln.bias", "head.weight", "seq.0.weight", "seq.0.bias"]
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in net.parameters())
    assert [n for n, _ in net.named_buffers()] == ["blocks.0.mask", "blocks.0.scratch", "blocks.1.mask",
                                                     "blocks.1.scratch"]
    sd = net.state_dict()
    assert "blocks.0.mask" in sd and "blocks.0.scratch" not in sd
    assert net.num_parameters() == sum(p.numel() for p in net.parameters())


def test_tied_parameters_listed_once():
    net = Net()
    net.head.weight = net.seq[0].weight
    ps = list(net.parameters())
    assert len(ps) == len({id(p) for p in ps})
    assert "head.weight" in net.state_dict() and "seq.0.weight" in net.state_dict()


def test_state_dict_roundtrip_and_strict_checks():
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_array_equal(host(p), host(q), err_msg=n)
    sd = a.state_dict()
    sd.pop("head.weight")
    sd["extra"] = bt.zeros(1)
    with pytest.raises(KeyError, match=r"missing keys \['head.weight'\].*unexpected keys \['extra'\]"):
        b.load_state_dict(sd)
    missing, unexpected = b.load_state_dict(sd, strict=False)
    assert missing == ["head.weight"] and unexpected == ["extra"]
    bad = a.state_dict()
    bad["emb.weight"] = bt.zeros(3, 4)
    with pytest.raises(bt.ShapeError, match=r"'emb.weight' has shape \(3, 4\).*\(10, 4\)"):
        b.load_state_dict(bad)


def test_train_eval_and_dropout():
    net = Net()
    assert all(m.training for m in net.modules())
    net.eval()
    assert not any(m.training for m in net.modules())
    x = bt.randn(3, 4)
    blk = net.blocks[0]
    np.testing.assert_array_equal(host(blk(x)), host(blk(x)))
    net.train()
    assert blk.drop.training


def test_apply_and_init():
    net = Net()
    net.apply(lambda m: nn.init.zeros_(m.bias) if isinstance(m, nn.Linear) and m.bias is not None else None)
    assert float(host(net.blocks[0].fc.bias).sum()) == 0
    w = bt.empty(200, 300)
    nn.init.xavier_uniform_(w)
    bound = math.sqrt(6 / 500)
    assert host(w).max() <= bound and host(w).min() >= -bound and host(w).std() > bound / 2
    nn.init.normal_(w, 1.0, 0.02)
    assert abs(host(w).mean() - 1.0) < 1e-3 and abs(host(w).std() - 0.02) < 1e-3
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    assert host(w).max() <= 1 / math.sqrt(300)
    nn.init.constant_(w, 0.5)
    assert (host(w) == 0.5).all()


def test_module_to_device_and_dtype(device):
    net = Net()
    p = net.head.weight
    net.to(device)
    assert net.head.weight is p and p.device == bt.device(device)
    assert all(b.device == bt.device(device) for b in net.buffers())
    net.to(bt.float64)
    assert p.dtype is bt.float64 and p.requires_grad
    x = bt.randint(0, 10, (2, 3), device=device)
    h = net.emb(x)
    assert h.dtype is bt.float64 and h.device == bt.device(device)


def test_layers_match_torch(device):
    torch.manual_seed(0)
    tl, tn, te = torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Embedding(6, 4)
    bl, bn, be = nn.Linear(4, 3), nn.LayerNorm(3), nn.Embedding(6, 4)
    for b, t in ((bl, tl), (bn, tn), (be, te)):
        b.load_state_dict({k: bt.tensor(v.detach().numpy()) for k, v in t.state_dict().items()})
        b.to(device)
    idx = np.array([[0, 5, 2]])
    out = bn(nn.GELU("tanh")(bl(be(bt.tensor(idx, device=device)))))
    ref = tn(torch.nn.GELU("tanh")(tl(te(torch.tensor(idx)))))
    np.testing.assert_allclose(host(out), ref.detach().numpy(), rtol=1e-5, atol=1e-6)
    out.sum().backward()
    ref.sum().backward()
    np.testing.assert_allclose(host(bl.weight.grad), tl.weight.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(host(be.weight.grad), te.weight.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_linear_default_init_bounds():
    lin = nn.Linear(64, 32)
    bound = 1 / math.sqrt(64)
    assert np.abs(host(lin.weight)).max() <= bound and np.abs(host(lin.bias)).max() <= bound
    assert repr(lin) == "Linear(in_features=64, out_features=32, bias=True)"


def test_zero_grad_and_sequential():
    seq = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    assert len(seq) == 3 and isinstance(seq[-1], nn.Linear)
    seq(bt.randn(2, 3)).sum().backward()
    assert all(p.grad is not None for p in seq.parameters())
    seq.zero_grad()
    assert all(p.grad is None for p in seq.parameters())


def test_module_attribute_errors():
    class Bad(nn.Module):
        def __init__(self):
            self.x = 1

    with pytest.raises(bt.BluTensorError, match="super"):
        Bad()
    with pytest.raises(AttributeError, match="nope"):
        nn.Linear(2, 2).nope
