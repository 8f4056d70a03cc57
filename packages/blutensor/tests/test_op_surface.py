"""The public surface generated from op-table rows: signatures, names, docstrings, and an op added with one row
(``blutensor.ext.define_op``) plus a forward/backward pair, checked by finite differences and against PyTorch."""

from __future__ import annotations

import inspect

import blutensor as bt
import blutensor.functional as F
import numpy as np
import pytest
import torch
from blutensor import ext
from conftest import gradcheck


def test_generated_functions_have_real_signatures_and_names():
    assert str(inspect.signature(F.add)) == "(a: 'Tensor', b: 'Tensor | float', alpha: 'int' = 1) -> 'Tensor'"
    assert list(inspect.signature(F.index_add).parameters) == ["input", "dim", "index", "source", "alpha"]
    assert inspect.signature(F.index_add).parameters["alpha"].kind is inspect.Parameter.KEYWORD_ONLY
    assert list(inspect.signature(bt.Tensor.isclose).parameters) == ["self", "b", "rtol", "atol", "equal_nan"]
    assert inspect.signature(bt.Tensor.isclose).parameters["rtol"].default == 1e-05
    for fn, name, qual in ((F.exp, "exp", "exp"), (bt.Tensor.exp, "exp", "Tensor.exp"),
                           (bt.Tensor.exp_, "exp_", "Tensor.exp_"), (bt.Tensor.__add__, "__add__", "Tensor.__add__")):
        assert (fn.__name__, fn.__qualname__) == (name, qual)
        assert fn.__doc__
    assert F.exp.__module__ == "blutensor.functional" and bt.Tensor.exp.__module__ == "blutensor._tensor"
    assert bt.exp is F.exp and bt.nn.functional.linear is F.linear


def test_generated_functions_match_torch():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    ta, tb = bt.tensor(a), bt.tensor(b)
    pa, pb = torch.tensor(a), torch.tensor(b)
    np.testing.assert_allclose(F.add(ta, tb, alpha=2.5).numpy(), torch.add(pa, pb, alpha=2.5).numpy(), rtol=1e-12)
    np.testing.assert_allclose((2.0 ** ta).numpy(), (2.0 ** pa).numpy(), rtol=1e-12)
    np.testing.assert_allclose((3.0 % ta).numpy(), (3.0 % pa).numpy(), rtol=1e-12)
    np.testing.assert_allclose(ta.logsumexp(1, keepdim=True).numpy(), pa.logsumexp(1, keepdim=True).numpy(),
                               rtol=1e-12)
    idx = np.array([[0, 2], [1, 1], [3, 0]])
    np.testing.assert_allclose(ta.gather(1, bt.tensor(idx)).numpy(), pa.gather(1, torch.tensor(idx)).numpy())
    x = ta.clone()
    assert x.add_(tb, alpha=-1) is x
    np.testing.assert_allclose(x.numpy(), (pa - pb).numpy(), rtol=1e-12)
    y = ta.clone()  # an activation row's inplace=True flag writes into the input, as torch.nn.functional's
    assert F.leaky_relu(y, 0.2, inplace=True) is y
    np.testing.assert_allclose(y.numpy(), torch.nn.functional.leaky_relu(pa, 0.2).numpy(), rtol=1e-12)


def test_generated_checks_name_the_argument():
    with pytest.raises(bt.DTypeError, match="sigmoid: needs a floating-point tensor"):
        F.sigmoid(bt.tensor([1, 2]))
    with pytest.raises(bt.DTypeError, match="gather: index must be an integer Tensor"):
        F.gather(bt.zeros(2, 2), 0, bt.zeros(2, 2))
    with pytest.raises(bt.DTypeError, match="index_select: dim must be an int, got float"):
        bt.zeros(2, 2).index_select(0.0, bt.tensor([0]))
    with pytest.raises(bt.DTypeError, match="scatter_add: src must be a Tensor, got int"):
        F.scatter_add(bt.zeros(2), 0, bt.tensor([0]), 1)
    with pytest.raises(bt.DTypeError, match="add_: result type float32 cannot be cast"):  # as in PyTorch
        bt.zeros(3, dtype=bt.int64).add_(0.5)
    with pytest.raises(bt.DTypeError, match="div_: result type float32 cannot be cast"):
        bt.tensor([5, 7]).div_(2)


def test_inplace_div_and_clamp_take_their_functions_arguments():
    v = np.array([5.0, -7.0, 3.5])
    for mode in (None, "trunc", "floor"):
        x = bt.tensor(v)
        assert x.div_(2, rounding_mode=mode) is x
        np.testing.assert_array_equal(x.numpy(), torch.tensor(v).div_(2, rounding_mode=mode).numpy())
    x = bt.tensor(v)
    x.clamp_(min=bt.tensor([6.0, 0.0, 0.0]), max=4.0)
    np.testing.assert_array_equal(x.numpy(), np.minimum(np.maximum(v, [6.0, 0.0, 0.0]), 4.0))
    with pytest.raises(bt.DTypeError, match="clamp: min must be a number"):
        bt.tensor(v).clamp_("a")


def _cube_forward(ctx, a, scale=1.0):
    ctx.saved = (a, scale)
    return scale * a * a * a


def _cube_backward(ctx, g):
    a, scale = ctx.saved
    return (g * 3.0 * scale * a * a,)


@pytest.fixture
def cube():
    """The op 'scaled_cube' defined by one row and a formula pair; removed after the test."""
    row = ext.define_op("scaled_cube", _cube_forward, _cube_backward, saves=(0,), dtypes=("float32", "float64"),
                        api=ext.op_api("a, scale:f=1.0", "scale * a**3 elementwise.", method="cube",
                                       inplace=True, floating=True))
    yield row
    ext.remove_op("scaled_cube")


def test_define_op_gives_functional_method_and_gradient(cube, device):
    x = bt.tensor(np.linspace(-1.5, 2.0, 7), device=device)
    assert "scaled_cube" in ext.op_names() and ext.op_rule("scaled_cube") is cube
    assert str(inspect.signature(F.scaled_cube)) == "(a: 'Tensor', scale: 'float' = 1.0) -> 'Tensor'"
    assert F.scaled_cube.__doc__ == "scale * a**3 elementwise." and bt.Tensor.cube.__qualname__ == "Tensor.cube"
    want = 2.0 * np.linspace(-1.5, 2.0, 7) ** 3
    np.testing.assert_allclose(F.scaled_cube(x, 2.0).numpy(), want, rtol=1e-12)
    np.testing.assert_allclose(x.cube(scale=2.0).numpy(), want, rtol=1e-12)
    gradcheck(lambda t: F.scaled_cube(t, scale=0.5).sum() + (t.cube() * t).sum(), [np.linspace(-1.0, 1.2, 6)],
              device=device)
    y = x.clone()
    assert y.cube_(2) is y
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-12)
    with pytest.raises(bt.DTypeError, match="scaled_cube: needs a floating-point tensor"):
        F.scaled_cube(bt.tensor([1, 2], device=device))
    with pytest.raises(bt.DTypeError, match="scaled_cube: scale must be a number, got str"):
        F.scaled_cube(x, "2")


def test_define_op_kernel_is_a_plugin_choice(cube):
    """The row's kernel sits in the plugin host's registry like a built-in's: a plugin kernel for the op wins by
    priority."""

    class Faster(ext.Kernel):
        PLUGIN_NAME = "test.scaled_cube_fast"
        OP = "scaled_cube"
        BACKEND = "cpu"
        PRIORITY = 10

        @staticmethod
        def forward(ctx, a, scale=1.0):
            return np.full_like(a, 7.0)

    assert ext.resolve_kernel("scaled_cube", "cpu", "float32") is cube
    reg = ext.get_host().registry("kernel")
    reg.register(Faster, "test", "0")
    ext.clear_kernel_cache()
    try:
        np.testing.assert_array_equal(F.scaled_cube(bt.ones(2)).numpy(), [7.0, 7.0])
    finally:
        reg.unregister("test.scaled_cube_fast")
        ext.clear_kernel_cache()
    np.testing.assert_array_equal(F.scaled_cube(bt.ones(2)).numpy(), [1.0, 1.0])


def test_define_op_refuses_clashes_and_bad_rows(cube):
    with pytest.raises(bt.ArgumentError, match="op 'scaled_cube' already exists"):
        ext.define_op("scaled_cube", _cube_forward)
    with pytest.raises(bt.ArgumentError, match="Tensor already has an attribute 'exp'"):
        ext.define_op("other_cube", _cube_forward, api=ext.op_api("a", functional=False, method="exp"))
    assert "other_cube" not in ext.op_names()  # nothing installed
    with pytest.raises(bt.ArgumentError, match="unknown flag"):
        ext.define_op("third_cube", _cube_forward, save=(0,))
    with pytest.raises(bt.ArgumentError, match="unknown kind 'q'"):
        ext.op_api("a, b:q")
    with pytest.raises(bt.ArgumentError, match="at most one parameter may be marked"):
        ext.op_api("a, b?=1, c?=2")
    with pytest.raises(bt.ArgumentError, match="was not added by define_op \\(a built-in op\\)"):
        ext.remove_op("exp")
