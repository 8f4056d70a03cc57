"""Adam / AdamW options, the PyTorch LR schedulers, optimizer and scheduler state round trips,
add_param_group, clip_grad_value_ and parameters_to_vector, each against PyTorch CPU."""

from __future__ import annotations

import blutensor as bt
import numpy as np
import pytest
import torch
from blutensor import optim
from conftest import host

RNG = np.random.default_rng(3)


def _params(n: int = 2):
    arrs = [RNG.standard_normal((3, 4)), RNG.standard_normal(4)][:n]
    return [bt.nn.Parameter(bt.tensor(a)) for a in arrs], [torch.nn.Parameter(torch.tensor(a)) for a in arrs]


def _run(ours, theirs, ps, qs, steps: int = 6):
    for _ in range(steps):
        gs = [RNG.standard_normal(tuple(p.shape)) for p in ps]
        for p, q, g in zip(ps, qs, gs):
            p.grad, q.grad = bt.tensor(g), torch.tensor(g)
        ours.step()
        theirs.step()
    for p, q in zip(ps, qs):
        np.testing.assert_allclose(host(p), q.detach().numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kw", [dict(), dict(weight_decay=0.1), dict(amsgrad=True, weight_decay=0.05),
                                dict(maximize=True), dict(betas=(0.8, 0.9), eps=1e-6, amsgrad=True)])
@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_adam_variants_match_torch(name, kw):
    ps, qs = _params()
    _run(getattr(optim, name)(ps, lr=0.01, foreach=False, **kw), getattr(torch.optim, name)(qs, lr=0.01, **kw), ps, qs)


@pytest.mark.parametrize("kw", [dict(momentum=0.9, nesterov=True, weight_decay=0.01),
                                dict(momentum=0.5, dampening=0.1, maximize=True, weight_decay=0.1)])
def test_sgd_options_match_torch(kw):
    ps, qs = _params()
    _run(optim.SGD(ps, lr=0.05, foreach=False, **kw), torch.optim.SGD(qs, lr=0.05, foreach=False, **kw), ps, qs)


def test_add_param_group_and_state_dict_round_trip():
    ps, qs = _params()
    o, to = optim.Adam([ps[0]], lr=0.01, amsgrad=True), torch.optim.Adam([qs[0]], lr=0.01, amsgrad=True)
    o.add_param_group({"params": [ps[1]], "lr": 0.1})
    to.add_param_group({"params": [qs[1]], "lr": 0.1})
    assert o.param_groups[1]["lr"] == 0.1 and o.param_groups[1]["betas"] == (0.9, 0.999)
    _run(o, to, ps, qs, 3)
    o2 = optim.Adam(ps[:1], lr=0.01, amsgrad=True)
    o2.add_param_group({"params": [ps[1]]})
    o2.load_state_dict(bt.load(_roundtrip(o.state_dict())))
    _run(o2, to, ps, qs, 3)  # continues exactly where o stopped
    with pytest.raises(bt.BluTensorError, match="more than one group"):
        o.add_param_group({"params": [ps[0]]})


def _roundtrip(obj):
    import io

    buf = io.BytesIO()
    bt.save(obj, buf)
    buf.seek(0)
    return buf


SCHEDULERS = [
    ("StepLR", dict(step_size=3, gamma=0.5)),
    ("MultiStepLR", dict(milestones=[2, 5, 6], gamma=0.3)),
    ("ExponentialLR", dict(gamma=0.9)),
    ("CosineAnnealingLR", dict(T_max=7, eta_min=0.01)),
    ("LinearLR", dict(start_factor=0.25, end_factor=0.9, total_iters=4)),
    ("ConstantLR", dict(factor=0.5, total_iters=3)),
    ("PolynomialLR", dict(total_iters=6, power=2.0)),
    ("CosineAnnealingWarmRestarts", dict(T_0=3, T_mult=2, eta_min=0.01)),
    ("CosineAnnealingWarmRestarts", dict(T_0=4)),
    ("OneCycleLR", dict(max_lr=0.5, total_steps=12)),
    ("OneCycleLR", dict(max_lr=[0.5, 0.2], epochs=3, steps_per_epoch=4, anneal_strategy="linear", three_phase=True)),
]


@pytest.mark.parametrize("opt", ["SGD", "AdamW"])
@pytest.mark.parametrize("name,kw", SCHEDULERS, ids=[f"{n}{i}" for i, (n, _) in enumerate(SCHEDULERS)])
def test_schedulers_match_torch(name, kw, opt):
    ps, qs = _params()
    okw = dict(momentum=0.9) if opt == "SGD" else {}
    o = getattr(optim, opt)([{"params": [ps[0]]}, {"params": [ps[1]], "lr": 0.3}], lr=0.1, **okw)
    to = getattr(torch.optim, opt)([{"params": [qs[0]]}, {"params": [qs[1]], "lr": 0.3}], lr=0.1, **okw)
    s, ts = getattr(optim.lr_scheduler, name)(o, **kw), getattr(torch.optim.lr_scheduler, name)(to, **kw)
    for i in range(11):
        assert s.get_last_lr() == pytest.approx(ts.get_last_lr(), rel=1e-12, abs=1e-15), i
        for g, tg in zip(o.param_groups, to.param_groups):
            for k in ("momentum", "betas"):
                if k in tg:
                    assert g[k] == pytest.approx(tg[k], rel=1e-12), (i, k)
        o.step()
        to.step()
        s.step()
        ts.step()
    s2 = getattr(optim.lr_scheduler, name)(getattr(optim, opt)([{"params": [ps[0]]}, {"params": [ps[1]]}], lr=0.1,
                                                               **okw), **kw)
    s2.load_state_dict(bt.load(_roundtrip(s.state_dict())))
    assert s2.last_epoch == s.last_epoch and s2.get_last_lr() == s.get_last_lr()


def test_sequential_lr_warmup_then_cosine_matches_torch():
    ps, qs = _params(1)
    o, to = optim.AdamW(ps, lr=0.2), torch.optim.AdamW(qs, lr=0.2)
    s = optim.lr_scheduler.SequentialLR(o, [optim.lr_scheduler.LinearLR(o, 0.1, 1.0, 3),
                                            optim.lr_scheduler.CosineAnnealingLR(o, T_max=6, eta_min=0.02)], [3])
    ts = torch.optim.lr_scheduler.SequentialLR(to, [torch.optim.lr_scheduler.LinearLR(to, 0.1, 1.0, 3),
                                                    torch.optim.lr_scheduler.CosineAnnealingLR(to, 6, 0.02)], [3])
    for i in range(10):
        assert s.get_last_lr() == pytest.approx(ts.get_last_lr(), rel=1e-12), i
        o.step()
        to.step()
        s.step()
        ts.step()


@pytest.mark.parametrize("kw", [dict(patience=1, factor=0.5, cooldown=1, min_lr=[0.0, 0.05]),
                                dict(mode="max", threshold=0.1, threshold_mode="abs", patience=0)])
def test_reduce_lr_on_plateau_matches_torch(kw):
    ps, qs = _params()
    o = optim.SGD([{"params": [ps[0]]}, {"params": [ps[1]], "lr": 0.3}], lr=0.1)
    to = torch.optim.SGD([{"params": [qs[0]]}, {"params": [qs[1]], "lr": 0.3}], lr=0.1)
    s = optim.lr_scheduler.ReduceLROnPlateau(o, **kw)
    ts = torch.optim.lr_scheduler.ReduceLROnPlateau(to, **kw)
    for m in [1.0, 0.9, 0.95, 0.96, 0.97, 0.5, 0.51, 0.52, 0.53, 0.54, 0.55, 0.56]:
        s.step(m)
        ts.step(m)
        assert s.get_last_lr() == pytest.approx(ts.get_last_lr(), rel=1e-12), m
    s2 = optim.lr_scheduler.ReduceLROnPlateau(o, **kw)
    s2.load_state_dict(bt.load(_roundtrip(s.state_dict())))
    assert s2.best == s.best and s2.num_bad_epochs == s.num_bad_epochs


def test_scheduler_errors():
    o = optim.SGD([bt.nn.Parameter(bt.zeros(1))], lr=0.1)
    with pytest.raises(bt.ArgumentError, match="StepLR: step_size must be an int"):
        optim.lr_scheduler.StepLR(o, 0)
    with pytest.raises(bt.ArgumentError, match="anneal_strategy must be one of"):
        optim.lr_scheduler.OneCycleLR(o, 1.0, 5, anneal_strategy="exp")
    s = optim.lr_scheduler.OneCycleLR(o, 1.0, total_steps=2, cycle_momentum=False)
    s.step()
    s.step()
    with pytest.raises(bt.ArgumentError, match="tried to step 3 times"):
        s.step()
    with pytest.raises(KeyError, match="initial_lr"):
        optim.lr_scheduler.StepLR(optim.SGD([bt.nn.Parameter(bt.zeros(1))], lr=0.1), 2, last_epoch=4)
    with pytest.raises(bt.ArgumentError, match="2 milestones for 3 schedulers"):
        optim.lr_scheduler.SequentialLR(o, [optim.lr_scheduler.ConstantLR(o)] * 3, [1])


def test_clip_grad_value_and_parameter_vectors_match_torch():
    ps, qs = _params()
    for p, q in zip(ps, qs):
        g = RNG.standard_normal(tuple(p.shape)) * 3
        p.grad, q.grad = bt.tensor(g), torch.tensor(g)
    bt.nn.utils.clip_grad_value_(ps, 1.5)
    torch.nn.utils.clip_grad_value_(qs, 1.5)
    for p, q in zip(ps, qs):
        np.testing.assert_array_equal(host(p.grad), q.grad.numpy())
    total = bt.nn.utils.clip_grad_norm_(ps, 0.5)
    ttotal = torch.nn.utils.clip_grad_norm_(qs, 0.5)
    assert float(total) == pytest.approx(float(ttotal), rel=1e-12)
    v = bt.nn.utils.parameters_to_vector(ps)
    np.testing.assert_array_equal(host(v), torch.nn.utils.parameters_to_vector(qs).detach().numpy())
    v.sum().backward()  # differentiable: every parameter gets ones
    bt.nn.utils.vector_to_parameters(bt.arange(16, dtype=bt.float64), ps)
    np.testing.assert_array_equal(host(ps[0]).ravel(), np.arange(12))
    with pytest.raises(bt.ShapeError, match="vec has 3 elements, the parameters 16"):
        bt.nn.utils.vector_to_parameters(bt.zeros(3), ps)


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_adam_amsgrad_on_device_matches_torch(name, device):
    arrs = [RNG.standard_normal((3, 4)).astype(np.float32), RNG.standard_normal(4).astype(np.float32)]
    ps = [bt.nn.Parameter(bt.tensor(a, device=device)) for a in arrs]
    qs = [torch.nn.Parameter(torch.tensor(a)) for a in arrs]
    o = getattr(optim, name)(ps, lr=0.01, amsgrad=True, weight_decay=0.1)
    to = getattr(torch.optim, name)(qs, lr=0.01, amsgrad=True, weight_decay=0.1)
    for _ in range(4):
        for p, q in zip(ps, qs):
            g = RNG.standard_normal(tuple(p.shape)).astype(np.float32)
            p.grad, q.grad = bt.tensor(g, device=device), torch.tensor(g)
        o.step()
        to.step()
    for p, q in zip(ps, qs):
        assert p.device == bt.device(device)
        np.testing.assert_allclose(host(p), q.detach().numpy(), rtol=1e-6, atol=1e-7)
