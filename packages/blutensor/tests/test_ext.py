"""blutensor.ext: every documented name resolves to the object blutensor itself uses; the array-provider,
op-rule and observer hooks behave as documented (checked against NumPy float64 and eager results)."""

from __future__ import annotations

import blutensor as bt
import numpy as np
import pytest
from blutensor import ext


def test_every_name_in_all_resolves_and_is_documented():
    doc = ext.__doc__
    for name in ext.__all__:
        obj = getattr(ext, name)
        assert obj is not None, name
        assert f"``{name}" in doc, f"blutensor.ext.{name} is not described in the module docstring"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ext.nope  # noqa: B018


def test_names_are_blutensors_own_objects():
    from blutensor.autograd.node import Node
    from blutensor.ops import dispatch, linalg

    assert ext.Node is Node and ext.apply is dispatch.apply and ext.gemm is linalg.gemm
    assert ext.op_rule("add").OP == "add" and "cross_entropy" in ext.op_names()
    with pytest.raises(KeyError, match="no op 'frobnicate'"):
        ext.op_rule("frobnicate")
    assert ext.op_rule("frobnicate", missing_ok=True) is None


class _Boxed:
    """A foreign array type: wraps a NumPy array; its provider records which of its functions ran."""

    def __init__(self, a):
        self.a = np.asarray(a)

    @property
    def shape(self):
        return self.a.shape


class _Provider:
    def __init__(self):
        self.calls = []

    def module(self, a):
        self.calls.append("module")
        return np

    def gemm(self, a, b):
        self.calls.append("gemm")
        return _Boxed(np.matmul(getattr(a, "a", a), getattr(b, "a", b)))

    def scatter_add(self, out, index, values):
        self.calls.append("scatter_add")
        np.add.at(out.a, index, getattr(values, "a", values))

    def erf(self, x):
        self.calls.append("erf")
        import math

        return _Boxed(np.vectorize(math.erf)(x.a))


def test_array_provider_routes_module_gemm_scatter_add_and_erf():
    prov = _Provider()
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((4, 2))
    ext.register_array_provider(_Boxed, prov)
    try:
        assert ext.array_module(_Boxed(a)) is np
        np.testing.assert_allclose(ext.gemm(_Boxed(a), b).a, a.astype(np.float64) @ b, rtol=1e-12)
        out = _Boxed(np.zeros(3))
        ext.scatter_add(out, np.array([0, 2, 0]), np.array([1.0, 2.0, 3.0]))
        np.testing.assert_array_equal(out.a, [4.0, 0.0, 2.0])
        np.testing.assert_allclose(ext.erf(_Boxed([0.5]), np).a, [0.5204998778130465], rtol=1e-12)
        # NumPy arrays never reach the provider
        np.testing.assert_allclose(ext.gemm(a, b), a @ b, rtol=1e-12)
        assert ext.array_module(a) is np
    finally:
        ext.unregister_array_provider(_Boxed, prov)
    assert prov.calls == ["module", "gemm", "scatter_add", "erf"]
    from blutensor.backends import array_providers

    assert array_providers == []


def test_array_provider_refuses_an_incomplete_provider():
    with pytest.raises(TypeError, match="lacks gemm, scatter_add, erf"):
        ext.register_array_provider(_Boxed, type("P", (), {"module": lambda self, a: np})())
    with pytest.raises(TypeError, match="must be a class"):
        ext.register_array_provider("Boxed", _Provider())


def test_override_op_rule_runs_the_given_formula_and_restores_it():
    x = bt.tensor([1.0, -2.0, 3.0], requires_grad=True)
    rule = ext.op_rule("neg")
    orig = rule.forward
    seen = []

    def fwd(ctx, a):
        seen.append("fwd")
        return orig(ctx, a)

    with ext.override_op_rule("neg", forward=fwd):
        y = -x
    (y * bt.tensor([1.0, 2.0, 3.0])).sum().backward()
    np.testing.assert_array_equal(y.numpy(), [-1.0, 2.0, -3.0])
    np.testing.assert_array_equal(x.grad.numpy(), [-1.0, -2.0, -3.0])
    assert seen == ["fwd"]
    assert ext.op_rule("neg").forward is orig
    -x  # noqa: B018 - after the block: the built-in again
    assert seen == ["fwd"]


def test_op_observers_first_is_outermost_and_copies_are_returned():
    order = []

    def outer(op, inputs, attrs, run):
        order.append(("outer", op))
        return run()

    def inner(op, inputs, attrs, run):
        order.append(("inner", op))
        return run()

    ext.add_op_observer(inner)
    ext.add_op_observer(outer, first=True)
    try:
        assert ext.op_observers()[:2] == (outer, inner)
        bt.tensor([1.0]) + 1.0  # noqa: B018
    finally:
        ext.remove_op_observer(outer)
        ext.remove_op_observer(inner)
    assert order == [("outer", "add"), ("inner", "add")]
    assert outer not in ext.op_observers() and isinstance(ext.backward_observers(), tuple)


def test_cross_entropy_backward_takes_a_device_side_count():
    """The rule's backward with the count of valid targets as an array equals the one with a Python int."""
    rule = ext.op_rule("cross_entropy")
    rng = np.random.default_rng(1)
    z = rng.standard_normal((5, 7)).astype(np.float32)
    t = np.array([1, -100, 3, 6, 0])

    class C:
        saved = None
        needs = (True, False)

    c = C()
    rule.forward(c, z, t)
    host = rule.backward(c, np.float32(1.0))[0]
    saved = list(c.saved)
    saved[4] = np.asarray(saved[4])  # the count as a 0-d array
    c.saved = tuple(saved)
    dev = rule.backward(c, np.float32(1.0))[0]
    np.testing.assert_allclose(dev, host, rtol=1e-7)
    assert dev.dtype == np.float32
    # against float64 softmax - onehot over the 4 valid rows
    p = np.exp(z - z.max(1, keepdims=True)).astype(np.float64)
    p /= p.sum(1, keepdims=True)
    p[np.arange(5), np.where(t < 0, 0, t)] -= 1
    p[t < 0] = 0
    np.testing.assert_allclose(dev, p / 4, atol=1e-6)


def test_gemm_provider_lists_declare_capture_safety():
    provs = ext.gemm_providers()
    assert ext.XpGemm in provs and ext.XpGemm.CAPTURE_SAFE is False
    assert all(getattr(p, "CAPTURE_SAFE", False) for p in ext.capture_safe_gemm_providers())
    assert ext.XpGemm not in ext.capture_safe_gemm_providers()
