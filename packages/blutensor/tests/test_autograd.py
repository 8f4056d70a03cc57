"""Autograd: dynamic graph, topological order, accumulation, backward(gradient), retain_graph,
no_grad/enable_grad, detach, requires_grad_, hooks, "gradient ready" hooks, version checks,
graph release."""

from __future__ import annotations

import gc
import weakref

import blutensor as bt
import numpy as np
import pytest
import torch
from conftest import host


def test_reused_tensor_accumulates(device):
    x = bt.tensor([1.0, 2.0, 3.0], device=device, requires_grad=True)
    y = x * x + x * 3 + x.exp()  # x used four times
    y.sum().backward()
    np.testing.assert_allclose(host(x.grad), 2 * host(x) + 3 + np.exp(host(x)), rtol=1e-6)
    # a second backward accumulates into .grad
    (x * 2).sum().backward()
    np.testing.assert_allclose(host(x.grad), 2 * host(x) + 5 + np.exp(host(x)), rtol=1e-6)


def test_diamond_graph_topological_order(device):
    """a -> (b, c) -> d: a's node must run once, after both branches delivered their gradient."""
    x = bt.tensor([0.5, -1.0], dtype=bt.float64, device=device, requires_grad=True)
    tx = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    for t in (x, tx):
        a = t.tanh()
        b = a * 2
        c = a.exp()
        d = (b * c + a).sum()
        d.backward()
    np.testing.assert_allclose(host(x.grad), tx.grad.numpy(), rtol=1e-12)


def test_backward_with_gradient_for_non_scalar(device):
    x = bt.tensor([[1.0, 2.0], [3.0, 4.0]], device=device, requires_grad=True)
    y = x * x
    g = bt.tensor([[1.0, 0.5], [0.0, -1.0]], device=device)
    y.backward(g)
    np.testing.assert_allclose(host(x.grad), 2 * host(x) * host(g))
    with pytest.raises(bt.AutogradError, match="scalar"):
        (x * 2).backward()


def test_retain_graph(device):
    x = bt.tensor([1.0, 2.0], device=device, requires_grad=True)
    y = (x.exp() * x).sum()
    y.backward(retain_graph=True)
    g1 = host(x.grad).copy()
    y.backward()
    np.testing.assert_allclose(host(x.grad), 2 * g1)
    with pytest.raises(bt.AutogradError, match="second time.*retain_graph"):
        y.backward()


def test_graph_freed_after_backward(device):
    x = bt.tensor(np.ones((64, 64)), device=device, requires_grad=True)
    y = x.exp()
    z = (y * 2).sum()
    node = z.grad_fn
    exp_node = y.grad_fn
    z.backward()
    assert node.ctx is None and exp_node.ctx is None, "saved tensors must be released after backward"
    # the saved output of exp is no longer referenced by the graph
    ref = weakref.ref(y)
    del y, z, node, exp_node
    gc.collect()
    assert ref() is None


def test_no_grad_enable_grad_set_grad_enabled(device):
    x = bt.ones(3, device=device, requires_grad=True)
    with bt.no_grad():
        y = x * 2
        assert not bt.is_grad_enabled()
        with bt.enable_grad():
            z = x * 2
    assert not y.requires_grad and y.grad_fn is None
    assert z.requires_grad and z.grad_fn is not None

    @bt.no_grad()
    def f(t):
        return t * 3

    assert not f(x).requires_grad and bt.is_grad_enabled()
    with bt.set_grad_enabled(False):
        assert not (x + 1).requires_grad
    assert bt.is_grad_enabled()


def test_detach_and_requires_grad_(device):
    x = bt.ones(3, device=device, requires_grad=True)
    d = (x * 2).detach()
    assert not d.requires_grad and d.grad_fn is None
    d2 = x.detach()
    d2.add_(1)  # detach shares storage and version counter
    assert x._version.v == 1 and host(x)[0] == 2
    y = bt.zeros(2, device=device)
    assert y.requires_grad_() is y and y.requires_grad
    with pytest.raises(bt.AutogradError, match="floating"):
        bt.arange(3, device=device).requires_grad_()


def test_tensor_hooks(device):
    x = bt.tensor([1.0, 2.0], device=device, requires_grad=True)
    seen = []
    h = x.register_hook(lambda g: seen.append(host(g).copy()) or g * 10)
    y = x * 3
    y.register_hook(lambda g: g + 1)  # non-leaf hook changes the gradient flowing on
    y.sum().backward()
    np.testing.assert_allclose(seen[0], [6.0, 6.0])
    np.testing.assert_allclose(host(x.grad), [60.0, 60.0])
    h.remove()
    x.grad = None
    (x * 3).sum().backward()
    np.testing.assert_allclose(host(x.grad), [3.0, 3.0])


def test_gradient_ready_hook_fires_once_with_complete_grad(device):
    w = bt.tensor([1.0, 2.0], device=device, requires_grad=True)
    events = []
    w.register_post_accumulate_grad_hook(lambda p: events.append(host(p.grad).copy()))
    loss = (w * 2).sum() + (w * w).sum() + w.sum()  # three uses: one "ready" event after all of them
    loss.backward()
    assert len(events) == 1
    np.testing.assert_allclose(events[0], 2 + 2 * host(w) + 1)
    with pytest.raises(bt.AutogradError, match="leaf"):
        (w * 2).register_post_accumulate_grad_hook(lambda p: None)


def test_saved_tensor_modified_in_place_is_an_error(device):
    x = bt.tensor([1.0, 2.0], device=device, requires_grad=True)
    a = x * 1  # non-leaf
    y = a * a  # saves a
    a.add_(1)
    with pytest.raises(bt.AutogradError, match=r"'mul'.*modified in place.*version is 1, expected 0"):
        y.sum().backward()
    b = x * 1
    z = b + 2  # add saves no tensor: modifying b afterwards is fine
    with bt.no_grad():
        b.mul_(3)
    z.sum().backward()
    np.testing.assert_allclose(host(x.grad), [1.0, 1.0])


def test_saved_output_modified_in_place_is_an_error(device):
    x = bt.tensor([1.0, 2.0], device=device, requires_grad=True)
    e = x.exp()  # saves its output
    with bt.no_grad():
        e.mul_(3)
    with pytest.raises(bt.AutogradError, match="'exp'.*its output"):
        e.sum().backward()


def test_view_modification_bumps_base_version(device):
    x = bt.tensor([1.0, 2.0, 3.0], device=device, requires_grad=True)
    a = x * 1
    y = a * a  # saves a
    v = a[1:]
    with bt.no_grad():
        v.mul_(2)  # changes a through its view
    assert a._version.v == 1
    with pytest.raises(bt.AutogradError, match="modified in place"):
        y.sum().backward()


def test_inplace_on_non_leaf_is_differentiable(device):
    x = bt.tensor([1.0, 2.0], dtype=bt.float64, device=device, requires_grad=True)
    tx = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    for t in (x, tx):
        y = t * 2
        y.add_(t)
        y.mul_(t)
        y.sum().backward()
    np.testing.assert_allclose(host(x.grad), tx.grad.numpy())
    with pytest.raises(bt.AutogradError, match="leaf"):
        x.add_(1)


def test_backward_without_grad_is_an_error(device):
    x = bt.ones(2, device=device)
    with pytest.raises(bt.AutogradError,
                       match=r"backward\(\) called on Tensor\(shape=\(\), dtype=float32.*does not require grad"):
        x.sum().backward()


def test_autograd_grad_function(device):
    x = bt.tensor([1.0, 2.0], device=device, requires_grad=True)
    w = bt.tensor([3.0, 4.0], device=device, requires_grad=True)
    h = x * w  # an intermediate input
    loss = (h * h).sum()
    gx, gh, gu = bt.grad(loss, [x, h, bt.ones(2, device=device, requires_grad=True)])
    np.testing.assert_allclose(host(gx), 2 * host(h) * host(w))
    np.testing.assert_allclose(host(gh), 2 * host(h))
    assert gu is None
    assert x.grad is None and w.grad is None, "grad() must not accumulate into any leaf"


def test_retain_grad_non_leaf(device):
    x = bt.tensor([1.0, 2.0], device=device, requires_grad=True)
    y = x * 3
    y.retain_grad()
    (y * y).sum().backward()
    np.testing.assert_allclose(host(y.grad), 2 * host(y))


def test_cross_device_move_is_differentiable(device):
    x = bt.tensor([1.0, 2.0], device=device, requires_grad=True)
    y = x.to("cpu") * 2
    y.sum().backward()
    assert x.grad.device == bt.device(device)
    np.testing.assert_allclose(host(x.grad), [2.0, 2.0])


def test_no_graph_for_non_float_outputs(device):
    x = bt.tensor([1.5, -2.0], device=device, requires_grad=True)
    assert not (x > 0).requires_grad
    assert not x.argmax().requires_grad
    assert not x.long().requires_grad


def test_bfloat16_gradients_accumulate(device):
    """A reused bfloat16 tensor sums its gradients in float32 (raw bf16 bits on CUDA are not added)."""
    x = bt.tensor([1.0, 2.0, -3.0], dtype=bt.bfloat16, device=device, requires_grad=True)
    h = x * 1.0
    y = h * 2.0 + h * 3.0 + h  # three uses of the non-leaf h
    y.sum().backward()
    (x * 4.0).sum().backward()  # a second backward accumulates into the bf16 leaf grad
    assert x.grad.dtype is bt.bfloat16
    np.testing.assert_array_equal(host(x.grad), [10.0, 10.0, 10.0])


def test_bfloat16_sgd(device):
    p = bt.nn.Parameter(bt.tensor([1.0, -2.0], dtype=bt.bfloat16, device=device))
    opt = bt.optim.SGD([p], lr=0.5, momentum=0.9)
    for _ in range(2):
        p.grad = bt.tensor([1.0, 1.0], dtype=bt.bfloat16, device=device)
        opt.step()
    np.testing.assert_allclose(host(p), [1.0 - 0.5 - 0.5 * 1.9, -2.0 - 0.5 - 0.5 * 1.9], rtol=4e-3)
    assert p.dtype is bt.bfloat16 and opt.state[p]["momentum_buffer"].dtype is bt.float32


def test_inplace_with_grad_on_view_is_refused(device):
    base = bt.zeros(2, 3, device=device)
    v = bt.ones(3, device=device, requires_grad=True)
    row = base[0]
    with pytest.raises(bt.AutogradError, match=r"in-place op 'setitem'.*view"):
        row[1] = v[0] * 2
    base[0] = v * 2  # writing into the base records the graph
    base.sum().backward()
    np.testing.assert_allclose(host(v.grad), [2.0, 2.0, 2.0])


@pytest.mark.cuda
@pytest.mark.skipif(bt.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_second_gpu_forward_and_backward():
    x = bt.tensor([1.0, 2.0], device="cuda:1", requires_grad=True)
    y = (x.exp() * x).sum()
    assert y._data.device.id == 1
    y.backward()
    assert x.grad.device == bt.device("cuda:1") and x.grad._data.device.id == 1
    np.testing.assert_allclose(host(x.grad), np.exp([1.0, 2.0]) * (1 + np.array([1.0, 2.0])), rtol=1e-6)


def _event_order(ws, x, steps=3):
    """(per backward) the order in which op nodes ran and each weight's gradient became ready."""
    from blutensor.autograd.engine import add_backward_observer, remove_backward_observer

    events: list = []

    def observe(node, grad, run):
        events.append(("node", node.op))
        return run()

    for i, w in enumerate(ws):
        w.register_post_accumulate_grad_hook(lambda p, i=i: events.append(("ready", i)))
    add_backward_observer(observe)
    per_step = []
    try:
        for _ in range(steps):
            events.clear()
            h = x
            for w in ws:
                h = (h @ w).tanh()
            h.sum().backward()
            per_step.append(list(events))
    finally:
        remove_backward_observer(observe)
    return per_step


def test_gradient_ready_hooks_interleave_with_backward_at_every_step(device):
    """A leaf's "gradient ready" hook fires as soon as its gradient is complete, at EVERY backward: the last
    layer's weight is ready before the first layer's nodes run (DDP launches buckets during backward from
    it). A leaf's accumulator is created at its first use, so ordering by creation deferred every leaf, from
    the second backward on, past all op nodes."""
    rng = np.random.default_rng(0)
    ws = [bt.tensor(rng.standard_normal((8, 8)) * 0.3, dtype=bt.float32, device=device, requires_grad=True)
          for _ in range(4)]
    x = bt.tensor(rng.standard_normal((2, 8)), dtype=bt.float32, device=device)
    for k, ev in enumerate(_event_order(ws, x)):
        ready = [e[1] for e in ev if e[0] == "ready"]
        assert ready == [3, 2, 1, 0], (k, ev)  # reverse topological order
        nodes = [i for i, e in enumerate(ev) if e[0] == "node"]
        first_ready = ev.index(("ready", 3))
        assert first_ready < nodes[-1], f"backward {k}: every gradient became ready after the last node: {ev}"
        # each weight is ready right after its matmul's backward, before the earlier layers' nodes
        for i in range(3, 0, -1):
            assert ev.index(("ready", i)) < max(j for j, e in enumerate(ev) if e == ("node", "matmul")), (k, ev)
