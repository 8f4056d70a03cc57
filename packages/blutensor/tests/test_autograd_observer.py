"""engine.add_backward_observer: wraps every node's backward formula, in order, and costs nothing when empty."""

from __future__ import annotations

import blutensor as bt
import numpy as np
import pytest
from blutensor.autograd import engine
from blutensor.autograd.node import Node


@pytest.fixture(autouse=True)
def _clean():
    before = list(engine.backward_observers)
    yield
    engine.backward_observers[:] = before


def _graph():
    x = bt.tensor(np.array([[0.5, -1.0], [2.0, 0.25]]), requires_grad=True)
    w = bt.tensor(np.array([[1.0, 2.0], [-0.5, 3.0]]), requires_grad=True)
    return x, w, bt.sum(bt.exp(bt.matmul(x, w)))


def _reference(x, w):
    xv, wv = x.numpy().astype(np.float64), w.numpy().astype(np.float64)
    e = np.exp(xv @ wv)
    return e @ wv.T, xv.T @ e


def test_observer_sees_every_node_in_backward_order_and_keeps_gradients():
    seen = []

    def obs(node, grad, run):
        assert isinstance(node, Node)
        shape = tuple(grad.shape)
        out = run()
        seen.append((node.op, shape, len(out)))
        return out

    engine.add_backward_observer(obs)
    x, w, loss = _graph()
    loss.backward()
    engine.remove_backward_observer(obs)
    assert seen == [("sum", (), 1), ("exp", (2, 2), 1), ("matmul", (2, 2), 2)]
    gx, gw = _reference(x, w)
    np.testing.assert_allclose(x.grad.numpy(), gx, rtol=1e-5)
    np.testing.assert_allclose(w.grad.numpy(), gw, rtol=1e-5)


def test_observers_nest_first_added_outermost_and_may_replace_gradients():
    order = []

    def outer(node, grad, run):
        order.append(("outer-in", node.op))
        r = run()
        order.append(("outer-out", node.op))
        return r

    def inner(node, grad, run):
        order.append(("inner-in", node.op))
        r = run()
        order.append(("inner-out", node.op))
        return tuple(None if g is None else g * 2 for g in r) if node.op == "sum" else r

    engine.add_backward_observer(outer)
    engine.add_backward_observer(inner)
    x, w, loss = _graph()
    loss.backward()
    engine.remove_backward_observer(inner)
    engine.remove_backward_observer(outer)
    assert order[:4] == [("outer-in", "sum"), ("inner-in", "sum"), ("inner-out", "sum"), ("outer-out", "sum")]
    gx, gw = _reference(x, w)
    np.testing.assert_allclose(x.grad.numpy(), 2 * gx, rtol=1e-5)  # the observer's doubled gradient flowed on
    np.testing.assert_allclose(w.grad.numpy(), 2 * gw, rtol=1e-5)


def test_removed_observer_is_not_called_and_remove_is_idempotent():
    calls = []

    def obs(node, grad, run):
        calls.append(node.op)
        return run()

    engine.add_backward_observer(obs)
    engine.remove_backward_observer(obs)
    engine.remove_backward_observer(obs)
    _, _, loss = _graph()
    loss.backward()
    assert calls == [] and engine.backward_observers == []


def test_observer_exception_propagates_and_errors_of_the_formula_reach_the_caller():
    def boom(node, grad, run):
        raise RuntimeError(f"observer failed at {node.op}")

    engine.add_backward_observer(boom)
    _, _, loss = _graph()
    with pytest.raises(RuntimeError, match="observer failed at sum"):
        loss.backward()
    engine.remove_backward_observer(boom)

    def passthrough(node, grad, run):
        return run()

    engine.add_backward_observer(passthrough)
    _, _, loss = _graph()
    loss.backward()
    with pytest.raises(bt.errors.AutogradError, match="second time"):
        loss.backward()  # the freed-graph error comes from Node.apply, through the observer
    engine.remove_backward_observer(passthrough)


def test_no_observer_means_node_apply_is_called_directly(monkeypatch):
    """Zero cost when empty: the engine calls Node.apply itself, never the observer chain."""
    called = []
    monkeypatch.setattr(engine, "_observed", lambda *a: called.append(a))
    x, w, loss = _graph()
    loss.backward()
    assert called == [] and x.grad is not None
