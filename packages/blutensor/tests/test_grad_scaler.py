"""GradScaler against torch.amp.GradScaler (CPU): scale, unscale_ before clipping, skipped steps on
overflow, backoff and growth of the scale, state round trip, the disabled pass-through, misuse errors."""

from __future__ import annotations

import blutensor as bt
import numpy as np
import pytest
import torch
from conftest import host


def _setup(device="cpu"):
    w = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    p = bt.nn.Parameter(bt.tensor(w, device=device))
    q = torch.nn.Parameter(torch.tensor(w))
    return p, q, bt.optim.SGD([p], lr=0.1, momentum=0.9), torch.optim.SGD([q], lr=0.1, momentum=0.9)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the overflowing step is inf by design
def test_matches_torch_through_overflow_backoff_and_growth(device):
    p, q, o, to = _setup(device)
    kw = dict(init_scale=1024.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2)
    s, ts = bt.amp.GradScaler(**kw), torch.amp.GradScaler("cpu", **kw)
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    for i in range(7):
        loss = (bt.tensor(x, device=device) @ p).square().sum()
        tloss = (torch.tensor(x) @ q).square().sum()
        if i == 2:  # an overflowing step: skipped by both, the scale backs off
            loss, tloss = loss * float("inf"), tloss * float("inf")
        o.zero_grad()
        to.zero_grad()
        s.scale(loss).backward()
        ts.scale(tloss).backward()
        s.unscale_(o)
        ts.unscale_(to)
        if i != 2:
            np.testing.assert_allclose(host(p.grad), q.grad.numpy(), rtol=1e-5)
        bt.nn.utils.clip_grad_norm_([p], 5.0)
        torch.nn.utils.clip_grad_norm_([q], 5.0)
        s.step(o)
        ts.step(to)
        s.update()
        ts.update()
        assert s.get_scale() == ts.get_scale(), i
        np.testing.assert_allclose(host(p), q.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert s.get_scale() == 1024.0 * 2 * 0.25 * 2 * 2  # grow, back off, grow, grow
    s2 = bt.cuda.amp.GradScaler()
    s2.load_state_dict(bt.load(_roundtrip(s.state_dict())))
    assert s2.get_scale() == s.get_scale() and s2.state_dict() == s.state_dict()


def _roundtrip(obj):
    import io

    buf = io.BytesIO()
    bt.save(obj, buf)
    buf.seek(0)
    return buf


def test_disabled_is_a_pass_through_and_misuse_is_named():
    p, _, o, _ = _setup()
    off = bt.amp.GradScaler(enabled=False)
    loss = (p * 2).sum()
    assert off.scale(loss) is loss and off.get_scale() == 1.0 and off.state_dict() == {}
    loss.backward()
    before = host(p).copy()
    off.unscale_(o)
    off.step(o)
    off.update()
    assert not np.array_equal(host(p), before)
    on = bt.amp.GradScaler(init_scale=8.0)
    on.scale((p * 2).sum()).backward()
    on.unscale_(o)
    with pytest.raises(RuntimeError, match="already been called"):
        on.unscale_(o)
    on.step(o)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        on.step(o)
    on.update()
    with pytest.raises(bt.ArgumentError, match="invalid backoff_factor"):
        bt.amp.GradScaler(backoff_factor=2.0)
