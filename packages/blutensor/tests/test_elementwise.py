"""Elementwise ops: forward vs NumPy float64, gradients vs finite differences and PyTorch, on every device."""

from __future__ import annotations

import math

import blutensor as bt
import numpy as np
import pytest
import torch
from conftest import check_forward, check_vs_torch, gradcheck, host, rng

r = rng(0)
POS = lambda *s: r.uniform(0.5, 2.0, s)  # noqa: E731
ANY = lambda *s: r.standard_normal(s)  # noqa: E731

# name: (blutensor fn, NumPy reference, torch fn, inputs)
BINARY = {
    "add": (lambda a, b: a + b, np.add, lambda a, b: a + b),
    "sub": (lambda a, b: a - b, np.subtract, lambda a, b: a - b),
    "mul": (lambda a, b: a * b, np.multiply, lambda a, b: a * b),
    "div": (lambda a, b: a / b, np.divide, lambda a, b: a / b),
    "pow": (lambda a, b: a ** b, np.power, lambda a, b: a ** b),
    "maximum": (bt.maximum, np.maximum, torch.maximum),
    "minimum": (bt.minimum, np.minimum, torch.minimum),
    "add_alpha": (lambda a, b: bt.add(a, b, alpha=0.5), lambda a, b: a + 0.5 * b,
                  lambda a, b: torch.add(a, b, alpha=0.5)),
}
# broadcasting shape pairs
SHAPES = [((3, 4), (3, 4)), ((2, 3, 4), (4,)), ((3, 1), (1, 4)), ((2, 1, 4), (3, 1))]

UNARY = {
    "neg": (lambda a: -a, np.negative, torch.neg, ANY),
    "exp": (bt.exp, np.exp, torch.exp, ANY),
    "log": (bt.log, np.log, torch.log, POS),
    "tanh": (bt.tanh, np.tanh, torch.tanh, ANY),
    "sqrt": (bt.sqrt, np.sqrt, torch.sqrt, POS),
    "rsqrt": (bt.rsqrt, lambda a: 1 / np.sqrt(a), torch.rsqrt, POS),
    "sin": (bt.sin, np.sin, torch.sin, ANY),
    "cos": (bt.cos, np.cos, torch.cos, ANY),
    "abs": (bt.abs, np.abs, torch.abs, ANY),
    "sigmoid": (bt.sigmoid, lambda a: 1 / (1 + np.exp(-a)), torch.sigmoid, ANY),
    "relu": (bt.relu, lambda a: np.maximum(a, 0), torch.relu, ANY),
    "clamp": (lambda a: bt.clamp(a, -0.5, 0.7), lambda a: np.clip(a, -0.5, 0.7), lambda a: torch.clamp(a, -0.5, 0.7),
              ANY),
    "square": (lambda a: a.square(), np.square, torch.square, ANY),
    "pow_scalar": (lambda a: a ** 3.0, lambda a: a ** 3, lambda a: a ** 3.0, ANY),
    "pow_frac": (lambda a: a ** 0.5, np.sqrt, lambda a: a ** 0.5, POS),
    "rsub": (lambda a: 2.0 - a, lambda a: 2.0 - a, lambda a: 2.0 - a, ANY),
    "rdiv": (lambda a: 2.0 / a, lambda a: 2.0 / a, lambda a: 2.0 / a, POS),
    "rpow": (lambda a: 2.0 ** a, lambda a: 2.0 ** a, lambda a: 2.0 ** a, ANY),
    "scalar_mix": (lambda a: (a * 3 + 1) / 2 - 0.25, lambda a: (a * 3 + 1) / 2 - 0.25,
                   lambda a: (a * 3 + 1) / 2 - 0.25, ANY),
}


def _binary_inputs(name, sa, sb):
    a = POS(*sa) if name == "pow" else ANY(*sa)
    b = POS(*sb) if name in ("div", "pow") else ANY(*sb)
    if name in ("maximum", "minimum"):
        b = b + 0.3  # keep operands apart: max/min are not differentiable at ties
    return [a, b]


@pytest.mark.parametrize("shapes", SHAPES, ids=str)
@pytest.mark.parametrize("name", list(BINARY))
def test_binary(name, shapes, device):
    fn, ref, tfn = BINARY[name]
    arrays = _binary_inputs(name, *shapes)
    check_forward(fn, ref, arrays, device)
    check_vs_torch(fn, tfn, arrays, device)
    gradcheck(fn, arrays, device)


@pytest.mark.parametrize("name", list(UNARY))
def test_unary(name, device):
    fn, ref, tfn, gen = UNARY[name]
    x = gen(3, 4)
    if name in ("abs", "relu", "clamp"):
        x = np.where(np.abs(x) < 0.05, 0.3, x)  # away from kinks
        x = np.where(np.abs(np.abs(x) - 0.5) < 0.05, 0.3, x)
        x = np.where(np.abs(x - 0.7) < 0.05, 0.3, x)
    check_forward(fn, ref, [x], device, rtol=1e-7)
    check_vs_torch(fn, tfn, [x], device)
    gradcheck(fn, [x], device)


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
@pytest.mark.parametrize("name", ["exp", "tanh", "sigmoid", "mul", "add", "div"])
def test_low_precision_dtypes(name, dtype, device):
    """float32 and bfloat16 results match the float64 reference within their precision."""
    x, y = POS(4, 5), POS(4, 5)
    fn = UNARY[name][0] if name in UNARY else BINARY[name][0]
    ref = UNARY[name][1](x) if name in UNARY else BINARY[name][1](x, y)
    args = [bt.tensor(x, dtype=dtype, device=device)] + ([] if name in UNARY else [bt.tensor(y, dtype=dtype,
                                                                                                device=device)])
    out = fn(*args)
    assert out.dtype is dtype and out.device == bt.device(device)
    tol = 1e-6 if dtype is bt.float32 else 2e-2
    np.testing.assert_allclose(host(out), ref, rtol=tol, atol=tol)


def test_bfloat16_grad(device):
    x = bt.tensor(POS(3, 4), dtype=bt.bfloat16, device=device, requires_grad=True)
    (x.exp() * 2).sum().backward()
    assert x.grad.dtype is bt.bfloat16
    np.testing.assert_allclose(host(x.grad), 2 * np.exp(host(x)), rtol=2e-2)


@pytest.mark.parametrize("op", ["eq", "ne", "lt", "le", "gt", "ge"])
def test_comparisons(op, device):
    a = np.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    b = np.array([2.0, 2.0, 2.0])
    ta, tb = bt.tensor(a, device=device), bt.tensor(b, device=device)
    out = getattr(ta, op)(tb)
    assert out.dtype is bt.bool and not out.requires_grad
    np.testing.assert_array_equal(host(out), getattr(np, {"eq": "equal", "ne": "not_equal", "lt": "less",
                                                         "le": "less_equal", "gt": "greater",
                                                         "ge": "greater_equal"}[op])(a, b))
    np.testing.assert_array_equal(host(ta > 1.5), a > 1.5)
    np.testing.assert_array_equal(host(~(ta > 1.5)), ~(a > 1.5))


def test_where(device):
    c = ANY(3, 4) > 0
    a, b = ANY(3, 4), ANY(4)
    fn = lambda c_, a_, b_: bt.where(c_, a_, b_)  # noqa: E731
    check_forward(fn, np.where, [c, a, b], device)
    check_vs_torch(fn, torch.where, [c, a, b], device)
    gradcheck(fn, [c, a, b], device)
    x = bt.tensor(a, dtype=bt.float32, device=device)
    out = bt.where(bt.tensor(c, device=device), x, 0.0)
    assert out.dtype is bt.float32
    np.testing.assert_allclose(host(out), np.where(c, a, 0.0), rtol=1e-6)


def test_masked_fill(device):
    a = ANY(2, 3, 4)
    m = ANY(3, 4) > 0
    fn = lambda a_, m_: a_.masked_fill(m_, -7.5)  # noqa: E731
    check_forward(fn, lambda a_, m_: np.where(m_, -7.5, a_), [a, m], device)
    check_vs_torch(fn, lambda a_, m_: a_.masked_fill(m_, -7.5), [a, m], device)
    gradcheck(fn, [a, m], device)


def test_gelu_erf_exact(device):
    x = np.linspace(-4, 4, 17)
    out = bt.nn.functional.gelu(bt.tensor(x, dtype=bt.float64, device=device))
    ref = 0.5 * x * (1 + np.array([math.erf(v / math.sqrt(2)) for v in x]))
    np.testing.assert_allclose(host(out), ref, rtol=1e-12, atol=1e-14)


def test_int_arithmetic_keeps_dtype(device):
    a = bt.arange(6, device=device)
    assert (a + 1).dtype is bt.int64 and (a * a).dtype is bt.int64
    np.testing.assert_array_equal(host(a * 2 + 1), np.arange(6) * 2 + 1)


def test_cast_roundtrip_and_grad(device):
    x = bt.tensor(ANY(3, 4), dtype=bt.float32, device=device, requires_grad=True)
    y = x.to(bt.float64)
    assert y.dtype is bt.float64 and y.requires_grad
    (y * 3).sum().backward()
    assert x.grad.dtype is bt.float32
    np.testing.assert_allclose(host(x.grad), 3.0)
    i = x.long()
    assert i.dtype is bt.int64 and not i.requires_grad


def test_int_tensor_with_float_scalar_gives_default_float(device):
    """PyTorch's promotion: int tensor (op) Python float and int / int give float32, not float64."""
    a = bt.arange(4, device=device)
    for out in (a * 0.5, a + 0.5, a - 0.5, a / 2, a / a.clamp(min=1), 2.0 ** a, a ** 0.5):
        assert out.dtype is bt.float32, out.dtype
    np.testing.assert_allclose(host(a / 2), np.arange(4) / 2)
    assert (bt.arange(4, dtype=bt.float64, device=device) * 0.5).dtype is bt.float64
    assert (a * 2).dtype is bt.int64
