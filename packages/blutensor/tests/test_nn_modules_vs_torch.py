"""nn modules against PyTorch CPU (float64): activations, losses (values and input gradients for every
reduction), shape modules, containers, Embedding(padding_idx), conv/pool modules, nn.init statistics and
fans, and the Module API (load_state_dict's NamedTuple, get_submodule, requires_grad_, keep_vars)."""

from __future__ import annotations

import math

import blutensor as bt
import blutensor.nn as nn
import blutensor.nn.functional as F
import numpy as np
import pytest
import torch
from conftest import host

RNG = np.random.default_rng(7)


def _pair(a):
    return bt.tensor(a, requires_grad=True), torch.tensor(a, requires_grad=True)


def _needs(name: str) -> None:
    if not hasattr(F, name):
        pytest.skip(f"nn.functional.{name} is not in this build")


ACTIVATIONS = [
    ("ReLU", {}, "relu"), ("GELU", {"approximate": "tanh"}, "gelu"), ("GELU", {}, "gelu"), ("Tanh", {}, "tanh"),
    ("Sigmoid", {}, "sigmoid"), ("SiLU", {}, "silu"), ("Mish", {}, "mish"), ("SELU", {}, "selu"),
    ("ReLU6", {}, "relu6"), ("Hardswish", {}, "hardswish"), ("Hardsigmoid", {}, "hardsigmoid"),
    ("LogSigmoid", {}, "logsigmoid"), ("Softsign", {}, "softsign"), ("Tanhshrink", {}, "tanhshrink"),
    ("ELU", {"alpha": 0.7}, "elu"), ("CELU", {"alpha": 1.3}, "celu"), ("LeakyReLU", {"negative_slope": 0.2},
                                                                        "leaky_relu"),
    ("Softplus", {"beta": 2.0, "threshold": 5.0}, "softplus"), ("Hardtanh", {"min_val": -0.5, "max_val": 2.0},
                                                                 "hardtanh"),
    ("GLU", {"dim": 1}, "glu"), ("Softmax", {"dim": 1}, "softmax"), ("LogSoftmax", {"dim": -1}, "log_softmax"),
    ("Softmin", {"dim": 0}, "softmax"),
]


@pytest.mark.parametrize("name,kw,fn", ACTIVATIONS, ids=[f"{a[0]}{a[1]}" for a in ACTIVATIONS])
def test_activation_modules_match_torch(name, kw, fn):
    _needs(fn)
    x = RNG.standard_normal((3, 6)) * 3
    a, ta = _pair(x)
    y, ty = getattr(nn, name)(**kw)(a), getattr(torch.nn, name)(**kw)(ta)
    np.testing.assert_allclose(host(y), ty.detach().numpy(), rtol=1e-10, atol=1e-12)
    g = RNG.standard_normal(ty.shape)
    (y * bt.tensor(g)).sum().backward()
    (ty * torch.tensor(g)).sum().backward()
    # PyTorch's float64 Hardsigmoid and CELU backward carry a constant rounded to float32 (blutensor's equal the
    # float64 formula exactly): 3e-7 covers that
    np.testing.assert_allclose(host(a.grad), ta.grad.numpy(), rtol=3e-7, atol=1e-12)


def test_activation_arguments_checked():
    with pytest.raises(bt.ArgumentError, match="Hardtanh: max_val"):
        nn.Hardtanh(1.0, -1.0)
    with pytest.raises(bt.ArgumentError, match="ELU: alpha must be a number"):
        nn.ELU(alpha="1")
    with pytest.raises(bt.DTypeError, match="SiLU: inplace must be a bool"):
        nn.SiLU(inplace=1)
    with pytest.warns(UserWarning, match="Implicit dimension choice"):
        out = nn.Softmax()(bt.ones(2, 3))
    np.testing.assert_allclose(host(out), np.full((2, 3), 1 / 3), rtol=1e-6)


REGRESSION = [("MSELoss", {}), ("L1Loss", {}), ("SmoothL1Loss", {"beta": 0.5}), ("SmoothL1Loss", {"beta": 0.0}),
              ("HuberLoss", {"delta": 0.7})]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name,kw", REGRESSION, ids=[f"{a}{b}" for a, b in REGRESSION])
def test_regression_losses_match_torch(name, kw, reduction):
    x, t = RNG.standard_normal((4, 5)), RNG.standard_normal((4, 5))
    a, ta = _pair(x)
    y = getattr(nn, name)(reduction=reduction, **kw)(a, bt.tensor(t))
    ty = getattr(torch.nn, name)(reduction=reduction, **kw)(ta, torch.tensor(t))
    np.testing.assert_allclose(host(y), ty.detach().numpy(), rtol=1e-12, atol=1e-14)
    y.sum().backward()
    ty.sum().backward()
    np.testing.assert_allclose(host(a.grad), ta.grad.numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_binary_losses_match_torch(reduction):
    x = RNG.standard_normal((4, 5)) * 8  # large logits: the stable formula must not overflow
    t = (RNG.random((4, 5)) > 0.5).astype(np.float64)
    w, pw = RNG.random(5) + 0.5, RNG.random(5) + 0.5
    a, ta = _pair(x)
    y = nn.BCEWithLogitsLoss(weight=bt.tensor(w), reduction=reduction, pos_weight=bt.tensor(pw))(a, bt.tensor(t))
    ty = torch.nn.BCEWithLogitsLoss(weight=torch.tensor(w), reduction=reduction, pos_weight=torch.tensor(pw))(
        ta, torch.tensor(t))
    y.sum().backward()
    ty.sum().backward()
    np.testing.assert_allclose(host(y), ty.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(host(a.grad), ta.grad.numpy(), rtol=1e-9, atol=1e-12)
    p = 1 / (1 + np.exp(-x / 4))
    p[0, 0], p[0, 1] = 0.0, 1.0  # log clamped at -100, as PyTorch
    b, tb = _pair(p)
    y, ty = nn.BCELoss(reduction=reduction)(b, bt.tensor(t)), torch.nn.BCELoss(reduction=reduction)(tb, torch.tensor(t))
    np.testing.assert_allclose(host(y), ty.detach().numpy(), rtol=1e-10)
    with pytest.raises(bt.ArgumentError, match="between 0 and 1"):
        nn.BCELoss()(bt.tensor(x), bt.tensor(t))


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_weighted_cross_entropy_and_nll_match_torch(reduction, label_smoothing):
    x = RNG.standard_normal((3, 4, 2))  # (N, C, d): classes in dim 1
    tgt = np.array([[0, 1], [3, -100], [2, 2]])
    w = RNG.random(4) + 0.1
    a, ta = _pair(x)
    y = nn.CrossEntropyLoss(weight=bt.tensor(w), reduction=reduction, label_smoothing=label_smoothing)(
        a, bt.tensor(tgt))
    ty = torch.nn.CrossEntropyLoss(weight=torch.tensor(w), reduction=reduction, label_smoothing=label_smoothing)(
        ta, torch.tensor(tgt))
    y.sum().backward()
    ty.sum().backward()
    np.testing.assert_allclose(host(y), ty.detach().numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(host(a.grad), ta.grad.numpy(), rtol=1e-10, atol=1e-14)
    probs = RNG.dirichlet(np.ones(4), (3, 2)).transpose(0, 2, 1)  # probability targets, same layout
    b, tb = _pair(x)
    y = nn.CrossEntropyLoss(weight=bt.tensor(w), reduction=reduction, label_smoothing=label_smoothing)(
        b, bt.tensor(probs))
    ty = torch.nn.CrossEntropyLoss(weight=torch.tensor(w), reduction=reduction, label_smoothing=label_smoothing)(
        tb, torch.tensor(probs))
    np.testing.assert_allclose(host(y), ty.detach().numpy(), rtol=1e-12, atol=1e-14)
    c, tc = _pair(np.log(RNG.dirichlet(np.ones(4), 5)))
    y = nn.NLLLoss(weight=bt.tensor(w), ignore_index=2, reduction=reduction)(c, bt.tensor([0, 2, 1, 3, 3]))
    ty = torch.nn.NLLLoss(weight=torch.tensor(w), ignore_index=2, reduction=reduction)(
        tc, torch.tensor([0, 2, 1, 3, 3]))
    y.sum().backward()
    ty.sum().backward()
    np.testing.assert_allclose(host(y), ty.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(host(c.grad), tc.grad.numpy(), rtol=1e-12)


def test_cross_entropy_module_without_weight_is_the_functional():
    x, t = RNG.standard_normal((6, 5)), np.array([0, 4, 1, -1, 2, 2])
    a, ta = _pair(x)
    y = nn.CrossEntropyLoss(ignore_index=-1, label_smoothing=0.1)(a, bt.tensor(t))
    ty = torch.nn.CrossEntropyLoss(ignore_index=-1, label_smoothing=0.1)(ta, torch.tensor(t))
    y.backward()
    ty.backward()
    assert y.item() == pytest.approx(ty.item(), rel=1e-10)
    np.testing.assert_allclose(host(a.grad), ta.grad.numpy(), rtol=1e-9, atol=1e-14)


@pytest.mark.parametrize("reduction", ["batchmean", "mean", "sum", "none"])
@pytest.mark.parametrize("log_target", [False, True])
def test_kl_div_matches_torch(reduction, log_target):
    lp = np.log(RNG.dirichlet(np.ones(5), 4))
    tp = RNG.dirichlet(np.ones(5), 4)
    tp[0, 1] = 0.0  # a zero target contributes 0, not NaN
    tgt = np.log(tp + 1e-3) if log_target else tp
    a, ta = _pair(lp)
    y = nn.KLDivLoss(reduction=reduction, log_target=log_target)(a, bt.tensor(tgt))
    with pytest.warns(UserWarning) if reduction == "mean" else _nullcontext():
        ty = torch.nn.KLDivLoss(reduction=reduction, log_target=log_target)(ta, torch.tensor(tgt))
    y.sum().backward()
    ty.sum().backward()
    np.testing.assert_allclose(host(y), ty.detach().numpy(), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(host(a.grad), ta.grad.numpy(), rtol=1e-12, atol=1e-15)


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


def test_loss_input_errors():
    with pytest.raises(bt.ArgumentError, match="MSELoss: reduction must be one of"):
        nn.MSELoss(reduction="avg")
    with pytest.raises(bt.ShapeError, match=r"nll_loss: expected target of shape \(3,\)"):
        F.nll_loss(bt.zeros(3, 4), bt.tensor([[0], [1], [2]]))
    with pytest.raises(bt.ArgumentError, match=r"class index outside \[0, 4\)"):
        F.nll_loss(bt.zeros(3, 4), bt.tensor([0, 4, 1]))
    with pytest.raises(bt.ShapeError, match="weight must have one entry per class"):
        nn.NLLLoss(weight=bt.ones(3))(bt.zeros(2, 4), bt.tensor([0, 1]))
    with pytest.warns(UserWarning, match="different to the input size"):
        F.mse_loss(bt.zeros(3, 1), bt.zeros(3))


def test_shape_modules_and_containers():
    x = bt.randn(2, 3, 4, 5)
    assert nn.Identity(7, k=1)(x) is x
    assert nn.Flatten()(x).shape == (2, 60) and nn.Flatten(0, 2)(x).shape == (24, 5)
    assert nn.Unflatten(1, (3, 2, 2))(bt.randn(2, 12)).shape == (2, 3, 2, 2)
    assert nn.Unflatten(-1, (-1, 5))(bt.randn(2, 10)).shape == (2, 2, 5)
    from collections import OrderedDict

    seq = nn.Sequential(OrderedDict(fc=nn.Linear(4, 3), act=nn.ReLU()))
    assert [n for n, _ in seq.named_parameters()] == ["fc.weight", "fc.bias"]
    assert isinstance(seq[:1], nn.Sequential) and len(seq[:1]) == 1 and list(seq)[1] is seq.act
    seq.append(nn.Identity())
    assert len(seq) == 3
    ml = nn.ModuleList([nn.ReLU()])
    ml.extend([nn.Tanh()])
    ml.insert(0, nn.Identity())
    assert [type(m).__name__ for m in ml] == ["Identity", "ReLU", "Tanh"]
    del ml[1]
    assert [type(m).__name__ for m in ml] == ["Identity", "Tanh"]
    md = nn.ModuleDict({"a": nn.ReLU()})
    md.update({"b": nn.Tanh()})
    assert "b" in md and len(md) == 2 and list(md) == ["a", "b"]
    pl = nn.ParameterList([bt.zeros(2), nn.Parameter(bt.ones(3))])
    pd = nn.ParameterDict({"w": bt.zeros(2, 2)})
    holder = nn.Module()
    holder.pl, holder.pd = pl, pd
    assert [n for n, _ in holder.named_parameters()] == ["pl.0", "pl.1", "pd.w"]
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in holder.parameters())


def test_embedding_padding_idx_matches_torch():
    w = RNG.standard_normal((6, 3))
    e = nn.Embedding(6, 3, padding_idx=1)
    te = torch.nn.Embedding(6, 3, padding_idx=1)
    np.testing.assert_array_equal(host(e.weight)[1], 0.0)
    with bt.no_grad():
        e.weight.copy_(bt.tensor(w, dtype=bt.float32))
    with torch.no_grad():
        te.weight.copy_(torch.tensor(w, dtype=torch.float32))
    idx = [[1, 2, 1], [0, 5, 2]]
    e(bt.tensor(idx)).sum().backward()
    te(torch.tensor(idx)).sum().backward()
    np.testing.assert_allclose(host(e.weight.grad), te.weight.grad.numpy())
    f = nn.Embedding.from_pretrained(bt.tensor(w))
    assert not f.weight.requires_grad and f.weight.shape == (6, 3)


CONVS = [("Conv1d", (2, 3, 9), dict(in_channels=3, out_channels=4, kernel_size=3, stride=2, padding=1)),
         ("Conv2d", (2, 4, 7, 6), dict(in_channels=4, out_channels=6, kernel_size=(3, 2), padding=(1, 0),
                                       dilation=(1, 2), groups=2))]


@pytest.mark.parametrize("name,shape,kw", CONVS, ids=[c[0] for c in CONVS])
def test_conv_modules_match_torch(name, shape, kw):
    _needs(name.lower())
    m, tm = getattr(nn, name)(**kw).double(), getattr(torch.nn, name)(**kw).double()
    assert m.weight.shape == tuple(tm.weight.shape)
    tm.load_state_dict({k: torch.tensor(v.numpy().copy()) for k, v in m.state_dict().items()})
    x = RNG.standard_normal(shape)
    a, ta = _pair(x)
    y, ty = m(a), tm(ta)
    np.testing.assert_allclose(host(y), ty.detach().numpy(), rtol=1e-10, atol=1e-12)
    y.sum().backward()
    ty.sum().backward()
    np.testing.assert_allclose(host(a.grad), ta.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(host(m.weight.grad), tm.weight.grad.numpy(), rtol=1e-10, atol=1e-12)


POOLS = [("MaxPool1d", (2, 3, 9), dict(kernel_size=3, stride=2, padding=1)),
         ("MaxPool2d", (2, 3, 7, 6), dict(kernel_size=2)),
         ("AvgPool1d", (2, 3, 9), dict(kernel_size=3, stride=2, padding=1, count_include_pad=False)),
         ("AvgPool2d", (2, 3, 7, 6), dict(kernel_size=(3, 2), stride=1, ceil_mode=True))]


@pytest.mark.parametrize("name,shape,kw", POOLS, ids=[p[0] for p in POOLS])
def test_pool_modules_match_torch(name, shape, kw):
    _needs(name[:-2].lower().replace("pool", "_pool") + name[-2:])
    x = RNG.standard_normal(shape)
    a, ta = _pair(x)
    y, ty = getattr(nn, name)(**kw)(a), getattr(torch.nn, name)(**kw)(ta)
    np.testing.assert_allclose(host(y), ty.detach().numpy(), rtol=1e-12)
    y.sum().backward()
    ty.sum().backward()
    np.testing.assert_allclose(host(a.grad), ta.grad.numpy(), rtol=1e-12)


def test_conv_arguments_checked_before_allocation():
    with pytest.raises(bt.ArgumentError, match="divisible by groups"):
        nn.Conv2d(3, 4, 3, groups=2)
    with pytest.raises(bt.ArgumentError, match="kernel_size must be an int >= 1"):
        nn.Conv1d(3, 4, 0)
    with pytest.raises(bt.ArgumentError, match="padding='same' is not supported for strided"):
        nn.Conv2d(3, 4, 3, stride=2, padding="same")


def test_init_fans_gains_and_statistics():
    w = bt.empty(200, 300)
    for nl, param, ref in [("relu", None, math.sqrt(2)), ("tanh", None, 5 / 3), ("leaky_relu", 0.2, 0.2 ** 0),
                           ("selu", None, 0.75), ("conv2d", None, 1.0)]:
        assert nn.init.calculate_gain(nl, param) == pytest.approx(torch.nn.init.calculate_gain(nl, param))
        if nl != "leaky_relu":
            assert nn.init.calculate_gain(nl, param) == pytest.approx(ref)
    conv = bt.empty(16, 8, 3, 3)
    assert nn.init._calculate_fan_in_and_fan_out(conv) == torch.nn.init._calculate_fan_in_and_fan_out(
        torch.empty(16, 8, 3, 3))
    cases = [(nn.init.kaiming_normal_, dict(mode="fan_out", nonlinearity="relu"), math.sqrt(2 / 200)),
             (nn.init.xavier_normal_, dict(gain=2.0), 2 * math.sqrt(2 / 500)),
             (nn.init.kaiming_uniform_, dict(a=math.sqrt(5)), math.sqrt(2 / 6) * math.sqrt(3 / 300) / math.sqrt(3)),
             (nn.init.xavier_uniform_, {}, math.sqrt(6 / 500) / math.sqrt(3))]
    for fn, kw, std in cases:
        fn(w, **kw)
        assert host(w).std() == pytest.approx(std, rel=0.03), fn.__name__
    nn.init.trunc_normal_(w, mean=0.5, std=1.0, a=0.0, b=1.5)
    h = host(w)
    assert h.min() >= 0.0 and h.max() <= 1.5 and abs(h.mean() - 0.7) < 0.05  # truncated-normal mean ~0.71
    q = bt.empty(5, 8, dtype=bt.float64)
    nn.init.orthogonal_(q, gain=2.0)
    np.testing.assert_allclose(host(q) @ host(q).T, 4 * np.eye(5), atol=1e-12)
    nn.init.eye_(q)
    np.testing.assert_array_equal(host(q), np.eye(5, 8))
    with pytest.raises(bt.ShapeError, match="fewer than 2 dimensions"):
        nn.init.xavier_uniform_(bt.empty(3))
    with pytest.raises(bt.ArgumentError, match="mode 'fan_avg' not supported"):
        nn.init.kaiming_uniform_(w, mode="fan_avg")
    with pytest.raises(bt.ArgumentError, match="too far in the tail"):
        nn.init.trunc_normal_(w, a=10.0, b=11.0)


def test_module_api_gaps():
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    sd = net.state_dict()
    sd.pop("2.bias")
    res = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).load_state_dict(sd, strict=False)
    assert res.missing_keys == ["2.bias"] and res.unexpected_keys == []
    assert net.get_submodule("2") is net[2] and net.get_parameter("0.weight") is net[0].weight
    with pytest.raises(AttributeError, match="no submodule '5'"):
        net.get_submodule("5.weight")
    net.requires_grad_(False)
    assert not any(p.requires_grad for p in net.parameters())
    assert net.state_dict(keep_vars=True)["0.weight"] is net[0].weight
    bad = net.state_dict()
    before = host(net[0].weight).copy()
    bad["0.weight"] = bt.ones(4, 3)
    bad["2.weight"] = bt.ones(9, 9)  # a later bad entry: nothing is copied
    with pytest.raises(bt.ShapeError, match="'2.weight' has shape"):
        net.load_state_dict(bad)
    np.testing.assert_array_equal(host(net[0].weight), before)


def _torch_backed(name: str):
    """A forward-only stand-in for ``F.<name>`` computed by PyTorch (for a build that lacks the op)."""
    tf = getattr(torch.nn.functional, name)

    def f(x, *args, **kwargs):
        args = [torch.tensor(host(a)) if isinstance(a, bt.Tensor) else a for a in args]
        return bt.tensor(tf(torch.tensor(host(x)), *args, **kwargs).numpy())

    return f


ROUTED = [("Conv2d", (2, 4, 7, 6), dict(in_channels=4, out_channels=6, kernel_size=(3, 2), padding=(1, 0),
                                         dilation=(1, 2), groups=2)),
          ("Conv2d", (2, 4, 7, 6), dict(in_channels=4, out_channels=2, kernel_size=3, padding="same")),
          ("Conv2d", (2, 4, 7, 6), dict(in_channels=4, out_channels=2, kernel_size=3, padding=(1, 2),
                                         padding_mode="reflect")),
          ("Conv1d", (2, 4, 7), dict(in_channels=4, out_channels=2, kernel_size=3, padding=2, padding_mode="circular")),
          ("MaxPool2d", (2, 3, 7, 6), dict(kernel_size=2, ceil_mode=True)),
          ("AvgPool1d", (2, 3, 9), dict(kernel_size=3, stride=2, padding=1, count_include_pad=False)),
          ("AvgPool2d", (2, 3, 7, 6), dict(kernel_size=(3, 2), stride=1, ceil_mode=True, divisor_override=2))] + [
    (name, (3, 6), kw) for name, kw, _ in ACTIVATIONS]


@pytest.mark.parametrize("name,shape,kw", ROUTED, ids=[f"{n}{i}" for i, (n, _, _) in enumerate(ROUTED)])
def test_modules_pass_pytorch_arguments(name, shape, kw, monkeypatch):
    """Each module calls its functional with PyTorch's positional/keyword layout: checked with PyTorch-backed
    stand-ins for the functionals this build lacks (the real ones where present)."""
    for fn in ("conv1d", "conv2d", "pad", "max_pool1d", "max_pool2d", "avg_pool1d", "avg_pool2d",
               *(a[2] for a in ACTIVATIONS)):
        if not hasattr(F, fn):
            monkeypatch.setattr(F, fn, _torch_backed(fn), raising=False)
    m, tm = getattr(nn, name)(**kw), getattr(torch.nn, name)(**kw)
    if m.state_dict():
        m.double()
        tm.double().load_state_dict({k: torch.tensor(host(v)) for k, v in m.state_dict().items()})
    x = RNG.standard_normal(shape) * 3
    np.testing.assert_allclose(host(m(bt.tensor(x))), tm(torch.tensor(x)).detach().numpy(), rtol=1e-10, atol=1e-12)
