"""PyTorch semantics where blutensor uses PyTorch's names: type promotion, cross_entropy's layouts and options,
gradient dtypes, tie splitting, pow at 0 / negative bases, 0-d tensors, overloads, indexing, return types."""

from __future__ import annotations

import itertools
import warnings

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from _parity import check, close

# ---- type promotion ----

DTYPES = ["bool", "int32", "int64", "float16", "bfloat16", "float32", "float64"]


def _operand(kind, dt, lib):
    """kind: 'dim' (shape (2,)), 'zero' (0-d) or a Python scalar."""
    if kind not in ("dim", "zero"):
        return kind
    shape = (2,) if kind == "dim" else ()
    a = np.ones(shape, dtype=np.float32)
    if lib is torch:
        return torch.tensor(a).to(getattr(torch, dt))
    return bt.tensor(a).to(getattr(bt, dt if dt != "bool" else "bool_"))


@pytest.mark.parametrize("d1, d2", list(itertools.product(DTYPES, DTYPES)))
def test_result_type_matches_torch_for_tensor_pairs(d1, d2):
    for k1, k2 in (("dim", "dim"), ("dim", "zero"), ("zero", "dim"), ("zero", "zero")):
        want = torch.result_type(_operand(k1, d1, torch), _operand(k2, d2, torch))
        got = bt.result_type(_operand(k1, d1, bt), _operand(k2, d2, bt))
        assert f"torch.{got.name}" == str(want), (k1, d1, k2, d2)
        assert bt.promote_types(getattr(bt, d1 if d1 != "bool" else "bool_"),
                                getattr(bt, d2 if d2 != "bool" else "bool_")).name == str(
            torch.promote_types(getattr(torch, d1), getattr(torch, d2)))[6:]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("scalar", [True, 3, 2.5])
def test_result_type_matches_torch_with_python_scalars(dt, scalar):
    for kind in ("dim", "zero"):
        want = torch.result_type(_operand(kind, dt, torch), scalar)
        assert f"torch.{bt.result_type(_operand(kind, dt, bt), scalar).name}" == str(want)


BINARY = [("add", lambda a, b: a + b), ("sub", lambda a, b: a - b), ("mul", lambda a, b: a * b),
          ("div", lambda a, b: a / b),
          ("maximum", lambda a, b: (bt if isinstance(a, bt.Tensor) else torch).maximum(a, b)),
          ("lt", lambda a, b: a < b), ("eq", lambda a, b: a == b), ("pow", lambda a, b: a ** b),
          ("remainder", lambda a, b: a % b), ("floordiv", lambda a, b: a // b)]
PAIRS = [("int64", "float32"), ("int32", "int64"), ("bool", "float64"), ("float32", "float64"), ("bool", "int32"),
         ("int32", "float16")]


@pytest.mark.parametrize("name, fn", BINARY, ids=[b[0] for b in BINARY])
@pytest.mark.parametrize("d1, d2", PAIRS)
def test_mixed_dtype_binary_ops_promote_like_torch(name, fn, d1, d2, device):
    if name in ("remainder", "floordiv", "sub") and "bool" in (d1, d2):
        pytest.skip("PyTorch refuses bool operands here")
    r = np.random.default_rng(0)
    a = np.abs(r.standard_normal((3, 4))) * 3 + 1
    b = np.abs(r.standard_normal((4,))) * 2 + 1

    def mk(x, dt, lib):
        if lib is torch:
            return torch.tensor(x).to(getattr(torch, dt))
        return bt.tensor(x, device=device).to(getattr(bt, dt if dt != "bool" else "bool_"))

    for x, y in (((a, d1), (b, d2)), ((a, d2), (b, d1)), ((a, d1), (np.array(2.0), d2))):
        got = fn(mk(*x, bt), mk(*y, bt))
        want = fn(mk(*x, torch), mk(*y, torch))
        close(got, want, "float32", f"{name} {x[1]} {y[1]}")
    for s in (2, 2.5, True):
        if name in ("remainder", "floordiv", "pow", "sub") and s is True or name == "maximum":
            continue  # PyTorch: no bool scalar here; maximum takes only tensors
        close(fn(mk(a, d1, bt), s), fn(mk(a, d1, torch), s), "float32", f"{name} {d1} scalar {s!r}")


@pytest.mark.parametrize("dt", ["bool", "int32", "int64", "float32", "float64"])
@pytest.mark.parametrize("scalar", [True, 2, 1.5])
def test_where_with_a_python_scalar_promotes_like_torch(dt, scalar, device):
    c = np.array([True, False])
    for swap in (False, True):
        x = _operand("dim", dt, bt)
        tx = _operand("dim", dt, torch)
        got = bt.where(bt.tensor(c, device=device), *((scalar, x.to(device)) if swap else (x.to(device), scalar)))
        want = torch.where(torch.tensor(c), *((scalar, tx) if swap else (tx, scalar)))
        close(got, want, "float32", f"where {dt} {scalar!r}")


def test_clamp_of_integers_with_float_bounds_is_float_like_torch(device):
    for kw in ({"min": 1.5}, {"max": 2.5}, {"min": 0, "max": 2}, {"min": -1}):
        close(bt.tensor([1, 2, 3], device=device).clamp(**kw), torch.tensor([1, 2, 3]).clamp(**kw), "float32",
              f"clamp {kw}")


def test_mixed_dtype_gradients_keep_each_input_dtype(device):
    a = bt.tensor([1.0, 2.0], device=device, requires_grad=True)
    b = bt.tensor([3.0, 4.0], dtype=bt.float64, device=device, requires_grad=True)
    out = a * b + bt.where(a > 1, a, b)
    assert out.dtype is bt.float64
    out.sum().backward()
    assert a.grad.dtype is bt.float32 and b.grad.dtype is bt.float64
    np.testing.assert_allclose(a.grad.cpu().numpy(), [3.0, 5.0])
    np.testing.assert_allclose(b.grad.cpu().numpy(), [2.0, 2.0])


def test_matmul_still_refuses_mixed_dtypes(device):
    with pytest.raises(bt.DTypeError, match=r"matmul: expected tensors of one dtype.*float32.*float64"):
        bt.zeros(2, 2, device=device) @ bt.zeros(2, 2, dtype=bt.float64, device=device)


def test_inplace_keeps_its_dtype_and_refuses_a_higher_category(device):
    x = bt.zeros(3, device=device)
    x += bt.ones(3, dtype=bt.float64, device=device)
    assert x.dtype is bt.float32 and x.tolist() == [1.0, 1.0, 1.0]
    i = bt.zeros(2, dtype=bt.int64, device=device)
    with pytest.raises(bt.DTypeError, match="remainder_: result type float32 cannot be cast"):
        i.remainder_(bt.ones(2, device=device))


# ---- cross_entropy ----

def _ce_case(shape_logits, target, **kw):
    r = np.random.default_rng(3)
    x = r.standard_normal(shape_logits)
    return x, target, kw


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ls", [0.0, 0.2])
@pytest.mark.parametrize("layout", ["NC", "NCd_d_eq_C", "NCdd", "C"])
def test_cross_entropy_layouts_vs_torch(layout, ls, reduction, device):
    r = np.random.default_rng(5)
    shape = {"NC": (5, 4), "NCd_d_eq_C": (2, 3, 3), "NCdd": (2, 4, 3, 2), "C": (4,)}[layout]
    tshape = shape[:1] + shape[2:] if len(shape) > 1 else ()
    t = r.integers(0, shape[1] if len(shape) > 1 else shape[0], tshape).astype(np.int64)
    if t.ndim:
        t.reshape(-1)[0] = -100  # one ignored target
    for dt in ("float64", "float32"):
        check(lambda x, y: F.cross_entropy(x, y, reduction=reduction, label_smoothing=ls),
              lambda x, y: TF.cross_entropy(x, y, reduction=reduction, label_smoothing=ls),
              [r.standard_normal(shape), t], device, dt, what=f"ce {layout} {reduction} ls={ls}")


@pytest.mark.parametrize("ls", [0.0, 0.3])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_weight_and_probability_targets_vs_torch(reduction, ls, device):
    r = np.random.default_rng(6)
    w = r.uniform(0.5, 2.0, 4)
    t = r.integers(0, 4, (3, 2)).astype(np.int64)
    t[0, 0] = 1
    t[1, 1] = -1
    kw = dict(reduction=reduction, label_smoothing=ls)
    check(lambda x, y, ww: F.cross_entropy(x, y, weight=ww.detach(), ignore_index=-1, **kw),
          lambda x, y, ww: TF.cross_entropy(x, y, weight=ww.detach(), ignore_index=-1, **kw),
          [r.standard_normal((3, 4, 2)), t, w], device, what=f"ce weight {reduction} ls={ls}")
    p = r.uniform(0, 1, (3, 4, 2))
    p /= p.sum(1, keepdims=True)
    check(lambda x, y: F.cross_entropy(x, y, **kw), lambda x, y: TF.cross_entropy(x, y, **kw),
          [r.standard_normal((3, 4, 2)), p], device, what=f"ce probs {reduction} ls={ls}")
    q = r.uniform(0, 1, (5, 4))
    check(lambda x, y, ww: F.cross_entropy(x, y.detach(), ww.detach(), **kw),
          lambda x, y, ww: TF.cross_entropy(x, y.detach(), ww.detach(), **kw),
          [r.standard_normal((5, 4)), q / q.sum(1, keepdims=True), w], device,
          what=f"ce probs weight {reduction} ls={ls}")


def test_cross_entropy_bad_shapes_are_named(device):
    x = bt.zeros(2, 3, 4, device=device)
    with pytest.raises(bt.ShapeError, match=r"need a target of shape \(2, 4\) \(N, d...\), got \(2, 3\)"):
        F.cross_entropy(x, bt.zeros(2, 3, dtype=bt.int64, device=device))
    with pytest.raises(bt.ShapeError, match="floating-point target holds class probabilities"):
        F.cross_entropy(x, bt.zeros(2, 4, 3, device=device))
    with pytest.raises(bt.ShapeError, match=r"weight must be a Tensor of shape \(3,\)"):
        F.cross_entropy(x, bt.zeros(2, 4, dtype=bt.int64, device=device), weight=bt.ones(4, device=device))
    with pytest.raises(bt.ShapeError, match="target index 7 out of range for 3 classes"):
        F.cross_entropy(bt.zeros(2, 3, device=device), bt.tensor([0, 7], device=device),
                        weight=bt.ones(3, device=device))


# ---- gradients, ties, pow, 0-d, std/var ----

@pytest.mark.parametrize("fn", [lambda x: x.max(), lambda x: x.min(), lambda x: x.amax(1), lambda x: x.max(1)[0],
                                lambda x: x.min(0).values])
def test_max_min_gradients_keep_float32(fn, device):
    x = bt.tensor([[1.0, 3.0, 3.0], [2.0, 0.0, 2.0]], device=device, requires_grad=True)
    fn(x).sum().backward()
    assert x.grad.dtype is bt.float32


def test_max_min_overloads_and_reductions_vs_torch(device):
    a = np.array([[1.0, 3.0, 3.0], [2.0, 0.0, 2.0]])
    b = np.array([[1.0, 2.0, 5.0], [2.0, 1.0, 0.0]])
    for f in (lambda x, y: (bt if isinstance(x, bt.Tensor) else torch).max(x, y),
              lambda x, y: (bt if isinstance(x, bt.Tensor) else torch).min(x, y),
              lambda x, y: x.max(y), lambda x, y: (bt if isinstance(x, bt.Tensor) else torch).maximum(x, y),
              lambda x, y: (bt if isinstance(x, bt.Tensor) else torch).minimum(x, y)):
        check(f, f, [a, b], device, what="max/min overload with ties")  # ties split the gradient in half
    for f in (lambda x, y: x.max(), lambda x, y: x.amin(1), lambda x, y: x.max(dim=1)):
        check(f, f, [a, b], device, what="max/min reduction with ties")


def test_all_any_return_tensors(device):
    t = bt.tensor([[1, 0], [2, 3]], device=device)
    for r in (t.all(), t.any(), bt.all(t), bt.any(t, dim=1)):
        assert isinstance(r, bt.Tensor) and r.dtype is bt.bool_
    assert bool(t.any()) is True and bool(t.all()) is False and t.all(1).tolist() == [False, True]


def test_pow_at_zero_and_negative_bases_vs_torch(device):
    base = np.array([0.0, 0.0, 0.0, -2.0, -2.0, 2.0, 0.0])
    expo = np.array([0.0, 1.0, 0.5, 2.0, 0.5, -1.5, -1.0])
    check(lambda a, b: a ** b, lambda a, b: a ** b, [base, expo], device, what="pow tensor**tensor")
    for e in (0.0, 1.0, 2.0, 0.5, -1.0, 3):
        check(lambda a, e=e: a ** e, lambda a, e=e: a ** e, [base], device, what=f"pow tensor**{e}")
    for s in (0.0, 2.0, -2.0, 0):
        check(lambda b, s=s: s ** b, lambda b, s=s: s ** b, [expo], device, what=f"pow {s}**tensor")
    with pytest.raises(bt.ArgumentError, match="integers to negative integer powers"):
        bt.tensor([2, 3], device=device) ** -1


def test_std_var_over_one_element_is_nan_with_a_warning(device):
    x = np.array([[1.0], [2.0]])
    with pytest.warns(RuntimeWarning, match="degrees of freedom is <= 0"):
        check(lambda a: a.std(1), lambda a: a.std(1), [x], device, what="std one element")
    with pytest.warns(RuntimeWarning, match="degrees of freedom is <= 0"):
        check(lambda a: a.var(), lambda a: a.var(), [np.array([3.0])], device, what="var one element")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check(lambda a: a.var(1, correction=0), lambda a: a.var(1, correction=0), [x], device, what="var corr=0")


@pytest.mark.parametrize("fn", [lambda x: x.sum(dim=0), lambda x: x.sum(-1, keepdim=True), lambda x: x.squeeze(0),
                                lambda x: x.mean(0), lambda x: x.amax(0), lambda x: x.max(0)[0],
                                lambda x: x.softmax(0), lambda x: x.prod(0), lambda x: x.cumsum(0),
                                lambda x: x.logsumexp(0), lambda x: x.unsqueeze(0).squeeze(0)],
                         ids=["sum", "sum_keep", "squeeze", "mean", "amax", "max_dim", "softmax", "prod", "cumsum",
                              "logsumexp", "unsqueeze"])
def test_zero_dim_reductions_vs_torch(fn, device):
    check(fn, fn, [np.array(1.5)], device, what="0-d")


def test_argmax_of_zero_dim_and_empty(device):
    assert bt.tensor(2.0, device=device).argmax(0).item() == 0
    with pytest.raises(bt.ShapeError, match="argmax: the input is empty"):
        bt.zeros(0, device=device).argmax()


# ---- overloads, indexing, return types ----

def test_fancy_indexing_with_ints_selects_first_like_torch(device):
    a = np.arange(2 * 3 * 4 * 5, dtype=np.float64).reshape(2, 3, 4, 5)
    idx, small = np.array([3, 0]), np.array([1, 0])
    for f in (lambda x: x[0, :, idx], lambda x: x[1, ..., idx], lambda x: x[:, 1, :, idx],
              lambda x: x[0, small, 2], lambda x: x[small, :, 1], lambda x: x[1, None, small]):
        check(lambda x, f=f: f(x), lambda x, f=f: f(x) if not isinstance(x, bt.Tensor) else f(x),
              [a], device, what="int + array index")
    mask = np.array([True, False, True])
    check(lambda x: x[1, mask], lambda x: x[1, torch.tensor(mask)], [a], device, what="int + bool mask")
    tb, tt = bt.tensor(a, device=device), torch.tensor(a)
    val = np.arange(3 * 2, dtype=np.float64).reshape(3, 2)
    tb[0, :, 1, idx[:1].tolist() + [4]] = bt.tensor(val, device=device)
    tt[0, :, 1, idx[:1].tolist() + [4]] = torch.tensor(val)
    np.testing.assert_array_equal(tb.cpu().numpy(), tt.numpy())


def test_randint_overloads(device):
    for args, shape in (((10, (3,)), (3,)), ((5, [2, 2]), (2, 2)), ((2, 5, (4,)), (4,)), ((7,), ())):
        r = bt.randint(*args, device=device)
        assert r.shape == shape and r.dtype is bt.int64
    v = bt.randint(3, 6, (500,), device=device).cpu().numpy()
    assert v.min() == 3 and v.max() == 5
    assert bt.randint(10, (200,), device=device).cpu().numpy().max() <= 9


def test_size_is_a_tuple_subclass_like_torch_size(device):
    x = bt.zeros(2, 3, 4, device=device)
    s = x.size()
    assert isinstance(s, bt.Size) and isinstance(s, tuple) and s == (2, 3, 4) and s.numel() == 24
    assert x.size(1) == 3 and x.size(-1) == 4 and s[1:] == (3, 4)
    with pytest.raises(bt.ShapeError, match="size: dim 3 out of range"):
        x.size(3)


def test_missing_ops_say_they_are_missing():
    with pytest.raises(AttributeError, match="no attribute 'stft'"):
        bt.stft  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'fold'"):
        F.fold  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'lu'"):
        bt.zeros(2).lu  # noqa: B018
    with pytest.raises(bt.ArgumentError, match="einsum: no gradient for an operand with a repeated subscript"):
        bt.einsum("ii->i", bt.zeros(2, 2, requires_grad=True)).sum().backward()


def test_bad_arguments_of_new_ops_are_named(device, monkeypatch):
    bt.policy.update(validate_indices="sync")  # CUDA: raise at the call (CPU always does); reset by conftest
    x = bt.zeros(3, 4, device=device)
    with pytest.raises(bt.ShapeError, match="gather: index 4 is out of range for dim of size 4"):
        bt.gather(x, 1, bt.tensor([[4]], device=device))
    with pytest.raises(bt.ShapeError, match=r"gather: index -1 is out of range .* must be in \[0, 4\)"):
        bt.gather(x, 1, bt.tensor([[-1]], device=device))
    with pytest.raises(bt.ArgumentError, match="floor_divide: integer division by zero"):
        bt.tensor([1, 2], device=device) // 0
    with pytest.raises(bt.DTypeError, match="gather: index must be an integer Tensor"):
        bt.gather(x, 1, bt.zeros(3, 1, device=device))
    with pytest.raises(bt.ArgumentError, match=r"topk: k \(5\) must be in \[0, 4\]"):
        x.topk(5)
    with pytest.raises(bt.ShapeError, match="pad: reflect padding"):
        F.pad(x, (4, 0), mode="reflect")
    with pytest.raises(bt.ArgumentError, match="pad: mode must be one of"):
        F.pad(x, (1, 1), mode="edge")
    with pytest.raises(bt.ShapeError, match="conv2d: input channels 3"):
        F.conv2d(bt.zeros(1, 3, 5, 5, device=device), bt.zeros(2, 2, 3, 3, device=device))
    with pytest.raises(bt.ShapeError, match=r"conv2d: kernel \(span 7\) is larger than the padded input"):
        F.conv2d(bt.zeros(1, 1, 5, 5, device=device), bt.zeros(1, 1, 7, 7, device=device))
    with pytest.raises(bt.ArgumentError, match="div: rounding_mode must be"):
        bt.div(x, 2, rounding_mode="round")
    with pytest.raises(bt.ArgumentError, match="remainder: integer division by zero"):
        bt.tensor([1, 2], device=device) % 0
    with pytest.raises(bt.ShapeError, match="einsum: subscripts 'ij' do not fit"):
        bt.einsum("ij->i", bt.zeros(2, device=device))


@pytest.mark.cuda
@pytest.mark.skipif(not bt.cuda.is_available(), reason="needs CuPy and a CUDA GPU")
def test_gather_index_check_is_lazy_on_cuda(monkeypatch):
    """Default 'lazy' mode on CUDA: no host sync at the call; the bad index is raised by raise_pending."""
    from blutensor.backends.cupy import index_check

    bt.policy.update(validate_indices="lazy")
    index_check.raise_pending()  # nothing left over from earlier tests
    x = bt.zeros(3, 4, device="cuda")
    bt.gather(x, 1, bt.tensor([[1], [9], [0]], device="cuda"))
    with pytest.raises(bt.ShapeError, match="index 9"):
        index_check.raise_pending()
    bt.gather(x, 1, bt.tensor([[1], [3], [0]], device="cuda"))
    index_check.raise_pending()  # a good index leaves no flag
