"""Each op added for PyTorch parity against PyTorch CPU: random shapes with broadcasting, non-contiguous views,
0-d and zero-size tensors; forward values and dtypes, gradients of a weighted sum in float64 and float32."""

from __future__ import annotations

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from _parity import check

R = np.random.default_rng(0)


def rn(*shape):
    return R.standard_normal(shape)


def pos(*shape):
    return R.uniform(0.5, 2.0, shape)


def idx(high, *shape):
    return R.integers(0, high, shape).astype(np.int64)


def perm_idx(n, rows, k):
    """(rows, k) indices, distinct within each row (scatter without collisions along dim 1)."""
    return np.argsort(R.standard_normal((rows, n)), axis=-1)[:, :k].astype(np.int64)


# name, blutensor fn, torch fn, inputs
CASES = [
    ("sort", lambda x: bt.sort(x, 1), lambda x: torch.sort(x, 1), [rn(3, 5, 2)]),
    ("sort_desc_stable", lambda x: bt.sort(x, -1, descending=True, stable=True),
     lambda x: torch.sort(x, dim=-1, descending=True, stable=True), [rn(4, 6)]),
    ("sort_0d", lambda x: bt.sort(x), lambda x: torch.sort(x), [rn()]),
    ("sort_empty", lambda x: bt.sort(x, 0), lambda x: torch.sort(x, 0), [rn(0, 3)]),
    ("argsort", lambda x: bt.argsort(x, 0), lambda x: torch.argsort(x, 0), [rn(5, 3)]),
    ("topk", lambda x: bt.topk(x, 3), lambda x: torch.topk(x, 3), [rn(4, 7)]),
    ("topk_smallest_dim0", lambda x: x.topk(2, dim=0, largest=False), lambda x: x.topk(2, dim=0, largest=False),
     [rn(5, 3)]),
    ("cumsum", lambda x: bt.cumsum(x, 1), lambda x: torch.cumsum(x, 1), [rn(3, 4, 2)]),
    ("cumsum_0d", lambda x: x.cumsum(0), lambda x: x.cumsum(0), [rn()]),
    ("cumprod", lambda x: bt.cumprod(x, -1), lambda x: torch.cumprod(x, -1), [rn(3, 5)]),
    ("cumprod_zero", lambda x: bt.cumprod(x, 0), lambda x: torch.cumprod(x, 0), [np.array([2.0, 0.0, 3.0, 0.5])]),
    ("cummax", lambda x: bt.cummax(x, 1), lambda x: torch.cummax(x, 1), [rn(3, 6)]),
    ("cummin", lambda x: bt.cummin(x, 0), lambda x: torch.cummin(x, 0), [rn(6, 2)]),
    ("logcumsumexp", lambda x: bt.logcumsumexp(x, 1), lambda x: torch.logcumsumexp(x, 1), [rn(2, 5)]),
    ("gather", lambda x, i: bt.gather(x, 1, i), lambda x, i: torch.gather(x, 1, i), [rn(3, 4), idx(4, 3, 6)]),
    ("gather_dim0", lambda x, i: x.gather(0, i), lambda x, i: x.gather(0, i), [rn(4, 3), idx(4, 2, 3)]),
    ("take_along_dim", lambda x, i: bt.take_along_dim(x, i, 1), lambda x, i: torch.take_along_dim(x, i, 1),
     [rn(3, 5), idx(5, 1, 4)]),
    ("take_along_dim_flat", lambda x, i: bt.take_along_dim(x, i), lambda x, i: torch.take_along_dim(x, i),
     [rn(3, 5), idx(15, 7)]),
    ("scatter", lambda x, i, s: bt.scatter(x, 1, i, s), lambda x, i, s: torch.scatter(x, 1, i, s),
     [rn(3, 5), perm_idx(5, 3, 3), rn(3, 3)]),
    ("scatter_value", lambda x, i: x.scatter(1, i, 2.5), lambda x, i: x.scatter(1, i, 2.5),
     [rn(3, 5), perm_idx(5, 3, 2)]),
    ("scatter_add", lambda x, i, s: bt.scatter_add(x, 0, i, s), lambda x, i, s: torch.scatter_add(x, 0, i, s),
     [rn(4, 3), idx(4, 6, 3), rn(6, 3)]),
    ("index_select", lambda x, i: bt.index_select(x, 1, i), lambda x, i: torch.index_select(x, 1, i),
     [rn(3, 5), idx(5, 7)]),
    ("index_add", lambda x, i, s: bt.index_add(x, 0, i, s, alpha=2.0),
     lambda x, i, s: torch.index_add(x, 0, i, s, alpha=2.0), [rn(4, 3), idx(4, 5), rn(5, 3)]),
    ("prod", lambda x: bt.prod(x, 1), lambda x: torch.prod(x, 1), [rn(3, 4)]),
    ("prod_all_zero", lambda x: x.prod(), lambda x: x.prod(), [np.array([[1.5, 0.0], [2.0, -1.0]])]),
    ("prod_keepdim", lambda x: x.prod(0, keepdim=True), lambda x: x.prod(0, keepdim=True), [rn(3, 2)]),
    ("logsumexp", lambda x: bt.logsumexp(x, 1), lambda x: torch.logsumexp(x, 1), [rn(3, 4) * 30]),
    ("logsumexp_dims", lambda x: x.logsumexp((0, 2), keepdim=True), lambda x: x.logsumexp((0, 2), keepdim=True),
     [rn(2, 3, 4)]),
    ("pad_constant", lambda x: F.pad(x, (1, 2, 0, 1), value=0.5), lambda x: TF.pad(x, (1, 2, 0, 1), value=0.5),
     [rn(2, 3, 4)]),
    ("pad_crop", lambda x: F.pad(x, (-1, 2)), lambda x: TF.pad(x, (-1, 2)), [rn(3, 4)]),
    ("pad_reflect", lambda x: F.pad(x, (2, 1, 1, 2), mode="reflect"),
     lambda x: TF.pad(x, (2, 1, 1, 2), mode="reflect"), [rn(1, 2, 4, 5)]),
    ("pad_replicate", lambda x: F.pad(x, (3, 1), mode="replicate"), lambda x: TF.pad(x, (3, 1), mode="replicate"),
     [rn(2, 2, 4)]),
    ("pad_circular", lambda x: F.pad(x, (2, 1, 1, 1), mode="circular"),
     lambda x: TF.pad(x, (2, 1, 1, 1), mode="circular"), [rn(1, 2, 3, 4)]),
    ("conv1d", lambda x, w, b: F.conv1d(x, w, b, stride=2, padding=1),
     lambda x, w, b: TF.conv1d(x, w, b, stride=2, padding=1), [rn(2, 3, 9), rn(4, 3, 3), rn(4)]),
    ("conv1d_same_dilated", lambda x, w: F.conv1d(x, w, padding="same", dilation=2),
     lambda x, w: TF.conv1d(x, w, padding="same", dilation=2), [rn(1, 2, 7), rn(3, 2, 4)]),
    ("conv2d", lambda x, w, b: F.conv2d(x, w, b, stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
     lambda x, w, b: TF.conv2d(x, w, b, stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
     [rn(2, 3, 6, 7), rn(4, 3, 3, 2), rn(4)]),
    ("conv2d_groups", lambda x, w: F.conv2d(x, w, groups=2), lambda x, w: TF.conv2d(x, w, groups=2),
     [rn(2, 4, 5, 5), rn(6, 2, 3, 3)]),
    ("conv2d_unbatched", lambda x, w: F.conv2d(x, w, padding=1), lambda x, w: TF.conv2d(x, w, padding=1),
     [rn(2, 4, 4), rn(3, 2, 3, 3)]),
    ("max_pool1d", lambda x: F.max_pool1d(x, 3, 2, 1), lambda x: TF.max_pool1d(x, 3, 2, 1), [rn(2, 3, 8)]),
    ("max_pool2d", lambda x: F.max_pool2d(x, 2), lambda x: TF.max_pool2d(x, 2), [rn(2, 3, 6, 5)]),
    ("max_pool2d_indices", lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True, return_indices=True),
     lambda x: TF.max_pool2d(x, 3, 2, 1, ceil_mode=True, return_indices=True), [rn(1, 2, 7, 6)]),
    ("max_pool2d_dilation", lambda x: F.max_pool2d(x, 2, 1, dilation=2),
     lambda x: TF.max_pool2d(x, 2, 1, dilation=2), [rn(1, 2, 6, 6)]),
    ("avg_pool1d", lambda x: F.avg_pool1d(x, 3, 2, 1), lambda x: TF.avg_pool1d(x, 3, 2, 1), [rn(2, 3, 8)]),
    ("avg_pool2d", lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
     lambda x: TF.avg_pool2d(x, 3, 2, 1, count_include_pad=False), [rn(2, 2, 7, 6)]),
    ("avg_pool2d_ceil", lambda x: F.avg_pool2d(x, 2, 2, 1, ceil_mode=True),
     lambda x: TF.avg_pool2d(x, 2, 2, 1, ceil_mode=True), [rn(1, 2, 5, 6)]),
    ("avg_pool2d_divisor", lambda x: F.avg_pool2d(x, 2, divisor_override=3),
     lambda x: TF.avg_pool2d(x, 2, divisor_override=3), [rn(1, 1, 4, 4)]),
    ("einsum_bmm", lambda a, b: bt.einsum("bij,bjk->bik", a, b), lambda a, b: torch.einsum("bij,bjk->bik", a, b),
     [rn(2, 3, 4), rn(2, 4, 5)]),
    ("einsum_ellipsis", lambda a, b: bt.einsum("...ij,j->...i", a, b),
     lambda a, b: torch.einsum("...ij,j->...i", a, b), [rn(2, 3, 4), rn(4)]),
    ("einsum_implicit_sum", lambda a, b: bt.einsum("ij,kj", a, b), lambda a, b: torch.einsum("ij,kj", a, b),
     [rn(3, 4), rn(5, 4)]),
    ("einsum_reduce", lambda a: bt.einsum("ijk->j", a), lambda a: torch.einsum("ijk->j", a), [rn(2, 3, 4)]),
    ("einsum_outer3", lambda a, b, c: bt.einsum("i,j,k->ijk", a, b, c),
     lambda a, b, c: torch.einsum("i,j,k->ijk", a, b, c), [rn(2), rn(3), rn(4)]),
    ("repeat", lambda x: x.repeat(2, 1, 3), lambda x: x.repeat(2, 1, 3), [rn(3, 2)]),
    ("repeat_interleave", lambda x: x.repeat_interleave(2, dim=1), lambda x: x.repeat_interleave(2, dim=1),
     [rn(3, 2)]),
    ("repeat_interleave_tensor", lambda x, r: bt.repeat_interleave(x, r, dim=0),
     lambda x, r: torch.repeat_interleave(x, r, dim=0), [rn(3, 2), np.array([1, 0, 3])]),
    ("repeat_interleave_flat", lambda x: bt.repeat_interleave(x, 3), lambda x: torch.repeat_interleave(x, 3),
     [rn(2, 2)]),
    ("flip", lambda x: bt.flip(x, (0, 2)), lambda x: torch.flip(x, (0, 2)), [rn(2, 3, 4)]),
    ("roll", lambda x: bt.roll(x, (1, -2), (0, 1)), lambda x: torch.roll(x, (1, -2), (0, 1)), [rn(3, 4)]),
    ("roll_flat", lambda x: x.roll(5), lambda x: x.roll(5), [rn(3, 4)]),
    ("diagonal", lambda x: bt.diagonal(x, 1), lambda x: torch.diagonal(x, 1), [rn(4, 5)]),
    ("diagonal_dims", lambda x: x.diagonal(-1, 0, 2), lambda x: x.diagonal(-1, 0, 2), [rn(4, 2, 3)]),
    ("unbind", lambda x: x.unbind(1), lambda x: x.unbind(1), [rn(2, 3)]),
    ("t", lambda x: x.t(), lambda x: x.t(), [rn(2, 3)]),
    ("movedim", lambda x: bt.movedim(x, (0, 1), (2, 0)), lambda x: torch.movedim(x, (0, 1), (2, 0)),
     [rn(2, 3, 4)]),
    ("div_trunc", lambda a, b: bt.div(a, b, rounding_mode="trunc"),
     lambda a, b: torch.div(a, b, rounding_mode="trunc"), [rn(3, 4) * 5, pos(4)]),
    ("div_floor", lambda a, b: a.div(b, rounding_mode="floor"), lambda a, b: a.div(b, rounding_mode="floor"),
     [rn(3, 4) * 5, -pos(3, 1)]),
    ("floor_divide_op", lambda a, b: a // b, lambda a, b: a // b, [rn(3, 4) * 5, pos(4)]),
    ("remainder", lambda a, b: bt.remainder(a, b), lambda a, b: torch.remainder(a, b), [rn(3, 4) * 5, pos(4)]),
    ("mod_op_neg", lambda a, b: a % b, lambda a, b: a % b, [rn(3, 4) * 5, -pos(3, 1)]),
    ("fmod", lambda a, b: bt.fmod(a, b), lambda a, b: torch.fmod(a, b), [rn(3, 4) * 5, pos(4)]),
    ("isclose", lambda a, b: bt.isclose(a, b, rtol=0.1), lambda a, b: torch.isclose(a, b, rtol=0.1),
     [rn(3, 4), rn(3, 4)]),
]

_ACT = [
    ("silu", F.silu, TF.silu, {}), ("softplus", F.softplus, TF.softplus, {"beta": 2.0, "threshold": 3.0}),
    ("hardtanh", F.hardtanh, TF.hardtanh, {"min_val": -0.5, "max_val": 1.2}),
    ("celu", F.celu, TF.celu, {"alpha": 0.7}), ("mish", F.mish, TF.mish, {}), ("elu", F.elu, TF.elu, {"alpha": 1.3}),
    ("leaky_relu", F.leaky_relu, TF.leaky_relu, {"negative_slope": 0.2}), ("selu", F.selu, TF.selu, {}),
    ("hardswish", F.hardswish, TF.hardswish, {}), ("hardsigmoid", F.hardsigmoid, TF.hardsigmoid, {}),
    ("logsigmoid", F.logsigmoid, TF.logsigmoid, {}), ("softsign", F.softsign, TF.softsign, {}),
    ("tanhshrink", F.tanhshrink, TF.tanhshrink, {}), ("relu6", F.relu6, TF.relu6, {}),
    ("glu", F.glu, TF.glu, {"dim": 1}), ("gelu_tanh", F.gelu, TF.gelu, {"approximate": "tanh"}),
]
for _n, _fb, _ft, _kw in _ACT:
    CASES.append((_n, lambda x, f=_fb, k=_kw: f(x, **k), lambda x, f=_ft, k=_kw: f(x, **k), [rn(3, 4) * 4]))


#: PyTorch has no derivative for these (blutensor's is zero, like torch's div with a rounding mode)
NO_TORCH_GRAD = {"floor_divide_op"}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name, fb, ft, arrays", CASES, ids=[c[0] for c in CASES])
def test_op_vs_torch(name, fb, ft, arrays, dtype, device):
    check(fb, ft, arrays, device, dtype, grad=name not in NO_TORCH_GRAD, what=name)


NC = [c for c in CASES if c[3] and c[3][0].ndim >= 2 and c[0] not in ("conv2d_unbatched", "take_along_dim_flat")]


@pytest.mark.parametrize("name, fb, ft, arrays", NC, ids=[c[0] for c in NC])
def test_op_vs_torch_non_contiguous(name, fb, ft, arrays, device):
    check(fb, ft, arrays, device, "float64", grad=name not in NO_TORCH_GRAD, nc=True, what=name)


BF16 = ["sort", "topk", "cumsum", "cummax", "gather", "scatter_add", "index_select", "pad_reflect", "conv2d",
        "max_pool2d", "avg_pool2d", "einsum_bmm", "repeat", "flip", "roll", "diagonal", "silu", "mish", "softplus",
        "hardswish", "elu", "leaky_relu", "glu", "logsumexp"]


@pytest.mark.parametrize("name, fb, ft, arrays", [c for c in CASES if c[0] in BF16], ids=BF16)
def test_op_vs_torch_bfloat16(name, fb, ft, arrays, device):
    """bfloat16 inputs: a bfloat16 result and bfloat16 gradients within bfloat16 rounding of PyTorch's."""
    check(fb, ft, arrays, device, "bfloat16", what=name)


ZERO_SIZE = [
    ("cumsum", lambda x: x.cumsum(1)), ("cumprod", lambda x: x.cumprod(0)), ("prod", lambda x: x.prod(1)),
    ("logsumexp", lambda x: x.logsumexp(1)), ("flip", lambda x: x.flip(0)), ("repeat", lambda x: x.repeat(2, 2)),
    ("pad", lambda x: (F if hasattr(x, "_data") else TF).pad(x, (1, 1))), ("roll", lambda x: x.roll(1, 0)),
    ("sort", lambda x: x.sort(1)), ("topk0", lambda x: x.topk(0, 1)), ("cummax", lambda x: x.cummax(1)),
    ("silu", lambda x: (F if hasattr(x, "_data") else TF).silu(x)),
]


@pytest.mark.parametrize("name, fn", ZERO_SIZE, ids=[z[0] for z in ZERO_SIZE])
def test_zero_size_vs_torch(name, fn, device):
    check(fn, fn, [np.zeros((0, 3))], device, "float64", what=name)


INT_CASES = [
    ("cumsum_int32", lambda x: x.cumsum(0), np.array([[1, 2], [3, 4]], dtype=np.int32)),
    ("prod_int32", lambda x: x.prod(1), np.array([[1, 2], [3, 4]], dtype=np.int32)),
    ("prod_bool", lambda x: x.prod(), np.array([True, False])),
    ("sort_int", lambda x: x.sort(descending=True), np.array([3, -1, 7, 0], dtype=np.int64)),
    ("sort_bool", lambda x: x.sort(), np.array([True, False, True])),
    ("floor_divide_int", lambda x: x // 3, np.array([-7, -3, 0, 4, 8])),
    ("div_trunc_int", lambda x: x.div(3, rounding_mode="trunc"), np.array([-7, -3, 0, 4, 8])),
    ("remainder_int", lambda x: x % -3, np.array([-7, -3, 0, 4, 8])),
    ("fmod_int", lambda x: x.fmod(3), np.array([-7, -3, 0, 4, 8])),
    ("repeat_int", lambda x: x.repeat(2), np.array([1, 2], dtype=np.int32)),
    ("flip_bool", lambda x: x.flip(0), np.array([True, False, False])),
    ("all_dim", lambda x: x.all(1), np.array([[1, 0], [2, 3]])),
    ("any_keepdim", lambda x: x.any(0, keepdim=True), np.array([[0, 0], [0, 3]])),
    ("cummax_int", lambda x: x.cummax(0), np.array([1, 3, 2, 3, 0])),
]


@pytest.mark.parametrize("name, fn, a", INT_CASES, ids=[c[0] for c in INT_CASES])
def test_integer_and_bool_ops_vs_torch(name, fn, a, device):
    check(fn, fn, [a], device, what=name)


def test_nan_ordering_like_torch(device):
    a = np.array([[1.0, np.nan, -2.0, np.inf, 0.5]])
    for desc in (False, True):
        check(lambda x, d=desc: x.sort(-1, descending=d), lambda x, d=desc: x.sort(-1, descending=d), [a], device,
              grad=False, what=f"sort nan desc={desc}")
    check(lambda x: x.topk(2), lambda x: x.topk(2), [a], device, grad=False, what="topk nan")
    check(lambda x: x.cummax(1), lambda x: x.cummax(1), [a], device, grad=False, what="cummax nan")
    check(lambda x: F.max_pool1d(x[None], 2), lambda x: TF.max_pool1d(x[None], 2), [a[:, :4]], device,
          grad=False, what="max_pool nan")


def test_creation_ops_vs_torch(device):
    from _parity import close

    close(bt.eye(3, device=device), torch.eye(3), what="eye")
    close(bt.eye(2, 4, dtype=bt.int64, device=device), torch.eye(2, 4, dtype=torch.int64), what="eye 2x4")
    for args in ((4, 3), (3, 5, 1), (4, 4, -1)):
        close(bt.tril_indices(*args, device=device), torch.tril_indices(*args), what=f"tril_indices{args}")
        close(bt.triu_indices(*args, device=device), torch.triu_indices(*args), what=f"triu_indices{args}")
    x, y = np.arange(3.0), np.arange(4.0) + 10
    for ind in ("ij", "xy"):
        check(lambda a, b, i=ind: bt.meshgrid(a, b, indexing=i), lambda a, b, i=ind: torch.meshgrid(a, b, indexing=i),
              [x, y], device, what=f"meshgrid {ind}")
    assert bt.allclose(bt.tensor([1.0, 2.0]), bt.tensor([1.0, 2.0 + 1e-9])) is True
    assert bt.allclose(bt.tensor([1.0, np.nan]), bt.tensor([1.0, np.nan])) is False
    assert bt.allclose(bt.tensor([1.0, np.nan]), bt.tensor([1.0, np.nan]), equal_nan=True) is True


def test_tensor_factory_methods(device):
    x = bt.zeros(2, 3, dtype=bt.float64, device=device)
    for name in ("new_zeros", "new_ones", "new_empty"):
        y = getattr(x, name)(4, 1)
        assert (tuple(y.shape), y.dtype, y.device) == ((4, 1), bt.float64, x.device), name
    assert x.new_ones((2,)).tolist() == [1.0, 1.0]
    f = x.new_full((2, 2), 7, dtype=bt.int64)
    assert f.dtype is bt.int64 and f.tolist() == [[7, 7], [7, 7]]
    nt = x.new_tensor([1, 2])
    assert nt.dtype is bt.float64 and nt.tolist() == [1.0, 2.0]
    assert x.expand_as(bt.zeros(4, 2, 3)).shape == (4, 2, 3)
    assert bt.zeros(2, dtype=bt.int32).type_as(x).dtype is bt.float64


def test_inplace_index_methods_vs_torch(device):
    a = R.standard_normal((3, 4))
    i = perm_idx(4, 3, 2)
    src = R.standard_normal((3, 2))
    tb, tt = bt.tensor(a, device=device), torch.tensor(a)
    tb.scatter_(1, bt.tensor(i, device=device), bt.tensor(src, device=device))
    tt.scatter_(1, torch.tensor(i), torch.tensor(src))
    np.testing.assert_allclose(tb.cpu().numpy(), tt.numpy())
    tb.index_add_(0, bt.tensor(np.array([0, 0]), device=device), bt.ones(2, 4, dtype=bt.float64, device=device))
    tt.index_add_(0, torch.tensor([0, 0]), torch.ones(2, 4, dtype=torch.float64))
    np.testing.assert_allclose(tb.cpu().numpy(), tt.numpy())


def test_multinomial_distribution_and_errors(device):
    w = bt.tensor([[0.0, 1.0, 3.0, 0.0], [5.0, 0.0, 0.0, 5.0]], device=device)
    s = bt.multinomial(w, 4000, replacement=True)
    assert s.shape == (2, 4000) and s.dtype is bt.int64
    h = s.cpu().numpy()
    freq0 = np.bincount(h[0], minlength=4) / 4000
    freq1 = np.bincount(h[1], minlength=4) / 4000
    np.testing.assert_allclose(freq0, [0, 0.25, 0.75, 0], atol=0.03)
    np.testing.assert_allclose(freq1, [0.5, 0, 0, 0.5], atol=0.03)
    nr = bt.multinomial(bt.tensor([1.0, 2.0, 3.0, 4.0], device=device), 4).cpu().numpy()
    assert sorted(nr.tolist()) == [0, 1, 2, 3]  # without replacement: a permutation
    # without replacement, the first draw follows the weights
    first = np.array([bt.multinomial(bt.tensor([1.0, 3.0], device=device), 1).item() for _ in range(400)])
    assert abs(first.mean() - 0.75) < 0.08
    bt.manual_seed(3)
    a = bt.multinomial(w, 5, True).cpu().numpy()
    bt.manual_seed(3)
    assert (bt.multinomial(w, 5, True).cpu().numpy() == a).all()  # reproducible from the seed
    with pytest.raises(bt.ArgumentError, match="without replacement from 4 categories"):
        bt.multinomial(w, 5)
    with pytest.raises(bt.ArgumentError, match="non-negative"):
        bt.multinomial(bt.tensor([1.0, -1.0], device=device), 1)
    with pytest.raises(bt.ArgumentError, match="positive sum"):
        bt.multinomial(bt.tensor([0.0, 0.0], device=device), 1)


@pytest.mark.parametrize("name, args", [("relu_", ()), ("exp_", ()), ("sigmoid_", ()), ("pow_", (2,)),
                                        ("remainder_", (0.7,)), ("floor_divide_", (0.3,)), ("neg_", ())])
def test_inplace_math_methods_vs_torch(name, args, device):
    a = R.standard_normal((2, 3))
    tb, tt = bt.tensor(a, device=device), torch.tensor(a)
    assert getattr(tb, name)(*args) is tb
    getattr(tt, name)(*args)
    np.testing.assert_allclose(tb.cpu().numpy(), tt.numpy(), rtol=1e-12)
    # through the graph: a non-leaf written in place keeps the gradient PyTorch gives
    lb = bt.tensor(a, device=device, requires_grad=True)
    lt = torch.tensor(a, requires_grad=True)
    yb, yt = lb * 1.5, lt * 1.5
    getattr(yb, name)(*args)
    getattr(yt, name)(*args)
    if name != "floor_divide_":  # PyTorch has no floor_divide derivative
        yb.sum().backward()
        yt.sum().backward()
        np.testing.assert_allclose(lb.grad.cpu().numpy(), lt.grad.numpy(), rtol=1e-10, atol=1e-12)
    with pytest.raises(bt.AutogradError, match=f"leaf tensor that requires grad .* in-place op '{name}'"):
        getattr(bt.ones(2, device=device, requires_grad=True), name)(*args)
