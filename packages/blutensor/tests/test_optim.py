"""optim: SGD and AdamW against PyTorch step by step, clip_grad_norm_, LR schedules, state_dict."""

from __future__ import annotations

import math

import blutensor as bt
import numpy as np
import pytest
import torch
from blutensor import optim
from conftest import host, rng


def _pair(device, shapes=((4, 3), (3,)), dtype=np.float32):
    r = rng(7)
    init = [r.standard_normal(s).astype(dtype) for s in shapes]
    ours = [bt.nn.Parameter(bt.tensor(a, device=device)) for a in init]
    theirs = [torch.nn.Parameter(torch.tensor(a)) for a in init]
    return ours, theirs


def _grads(step, shapes=((4, 3), (3,)), dtype=np.float32):
    r = rng(100 + step)
    return [r.standard_normal(s).astype(dtype) for s in shapes]


def _run(make_ours, make_theirs, device, steps=10, exact=False):
    ours, theirs = _pair(device)
    o, t = make_ours(ours), make_theirs(theirs)
    for s in range(steps):
        for p, q, g in zip(ours, theirs, _grads(s)):
            p.grad = bt.tensor(g, device=device)
            q.grad = torch.tensor(g)
        o.step()
        t.step()
        for p, q in zip(ours, theirs):
            if exact:
                np.testing.assert_array_equal(host(p), q.detach().numpy().astype(np.float64),
                                              err_msg=f"step {s}")
            else:
                np.testing.assert_allclose(host(p), q.detach().numpy(), rtol=1e-6, atol=1e-7, err_msg=f"step {s}")
    return o, ours


@pytest.mark.parametrize("kw", [dict(lr=0.1), dict(lr=0.1, momentum=0.9), dict(lr=0.05, momentum=0.9, nesterov=True),
                                dict(lr=0.1, momentum=0.5, dampening=0.1, weight_decay=0.01)], ids=str)
def test_sgd_matches_torch(kw, device):
    _run(lambda ps: optim.SGD(ps, **kw), lambda ps: torch.optim.SGD(ps, **kw), device)


@pytest.mark.parametrize("kw", [dict(lr=1e-2), dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)],
                         ids=str)
def test_adamw_matches_torch(kw, device):
    """PyTorch's AdamW update order (decoupled decay, lerp, bias corrections, addcdiv) gives the same
    float32 parameters up to an ulp or two (PyTorch's CPU kernels fuse some multiply-adds)."""
    _run(lambda ps: optim.AdamW(ps, **kw), lambda ps: torch.optim.AdamW(ps, foreach=False, **kw), device)


def test_adamw_param_groups_and_state_dict(device):
    ours, _ = _pair(device)
    o = optim.AdamW([{"params": [ours[0]], "weight_decay": 0.1}, {"params": [ours[1]], "weight_decay": 0.0}],
                    lr=1e-2)
    for s in range(3):
        for p, g in zip(ours, _grads(s)):
            p.grad = bt.tensor(g, device=device)
        o.step()
    sd = o.state_dict()
    assert sd["state"][0]["step"] == 3 and sd["param_groups"][1]["weight_decay"] == 0.0
    ours2, _ = _pair(device)
    for p, q in zip(ours2, ours):
        with bt.no_grad():
            p.copy_(q)
    o2 = optim.AdamW([{"params": [ours2[0]], "weight_decay": 0.1}, {"params": [ours2[1]], "weight_decay": 0.0}],
                     lr=1e-2)
    o2.load_state_dict(sd)
    for p, p2, g in zip(ours, ours2, _grads(9)):
        p.grad = bt.tensor(g, device=device)
        p2.grad = bt.tensor(g, device=device)
    o.step()
    o2.step()
    for p, p2 in zip(ours, ours2):
        np.testing.assert_array_equal(host(p), host(p2))
    assert ours[0]._version.v > 0  # optimizer updates bump the version counter


def test_adamw_bfloat16_params_keep_fp32_state(device):
    p = bt.nn.Parameter(bt.tensor([1.0, -2.0], dtype=bt.bfloat16, device=device))
    o = optim.AdamW([p], lr=0.1)
    p.grad = bt.tensor([0.5, 0.5], dtype=bt.bfloat16, device=device)
    o.step()
    assert p.dtype is bt.bfloat16 and o.state[p]["exp_avg"].dtype is bt.float32
    np.testing.assert_allclose(host(p), [1.0 * (1 - 0.1 * 0.01) - 0.1, -2.0 * (1 - 0.1 * 0.01) - 0.1], rtol=1e-2)


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clip_grad_norm_matches_torch(max_norm, device):
    ours, theirs = _pair(device)
    for p, q, g in zip(ours, theirs, _grads(0)):
        p.grad = bt.tensor(g, device=device)
        q.grad = torch.tensor(g)
    n1 = optim.clip_grad_norm_(ours, max_norm)
    n2 = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert abs(n1.item() - n2.item()) <= 1e-6 * n2.item()
    for p, q in zip(ours, theirs):
        np.testing.assert_allclose(host(p.grad), q.grad.numpy(), rtol=1e-6, atol=1e-7)


def test_warmup_cosine_schedule():
    w = optim.lr_scheduler.warmup_cosine
    assert w(0, 1.0, 0.1, 10, 100) == pytest.approx(0.1)
    assert w(9, 1.0, 0.1, 10, 100) == pytest.approx(1.0)
    assert w(10, 1.0, 0.1, 10, 100) == pytest.approx(1.0)
    assert w(55, 1.0, 0.1, 10, 100) == pytest.approx(0.1 + 0.5 * (1 + math.cos(math.pi * 0.5)) * 0.9)
    assert w(100, 1.0, 0.1, 10, 100) == pytest.approx(0.1) and w(500, 1.0, 0.1, 10, 100) == 0.1
    p = bt.nn.Parameter(bt.zeros(1))
    o = optim.SGD([p], lr=1.0)
    s = optim.lr_scheduler.WarmupCosineLR(o, warmup_steps=10, total_steps=100, min_lr=0.1)
    lrs = [o.param_groups[0]["lr"]]
    for _ in range(99):
        s.step()
        lrs.append(s.get_last_lr()[0])
    assert lrs == pytest.approx([w(i, 1.0, 0.1, 10, 100) for i in range(100)])
    s2 = optim.lr_scheduler.WarmupCosineLR(optim.SGD([p], lr=1.0), 10, 100, 0.1)
    s2.load_state_dict(s.state_dict())
    assert s2.get_last_lr() == s.get_last_lr()


def test_lambda_lr_matches_torch():
    p = bt.nn.Parameter(bt.zeros(1))
    q = torch.nn.Parameter(torch.zeros(1))
    f = lambda s: 0.9 ** s  # noqa: E731
    o, to = optim.SGD([p], lr=0.5), torch.optim.SGD([q], lr=0.5)
    s, ts = optim.lr_scheduler.LambdaLR(o, f), torch.optim.lr_scheduler.LambdaLR(to, f)
    for _ in range(5):
        assert s.get_last_lr() == pytest.approx(ts.get_last_lr())
        o.step()
        to.step()
        s.step()
        ts.step()


def test_optimizer_input_errors():
    with pytest.raises(bt.BluTensorError, match="empty parameter list"):
        optim.SGD([], lr=0.1)
    p = bt.nn.Parameter(bt.zeros(1))
    with pytest.raises(bt.BluTensorError, match="more than one group"):
        optim.SGD([{"params": [p]}, {"params": [p]}], lr=0.1)
    with pytest.raises(bt.BluTensorError, match="invalid hyperparameters"):
        optim.AdamW([p], lr=-1)
