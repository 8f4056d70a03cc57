"""Every op of the op table, and every function of ``blutensor.functional`` / ``blutensor.nn.functional``, whose name
PyTorch has at the top level (``torch.<name>``) is ``bt.<name>`` too and gives ``torch.<name>``'s result on a small
input (float64 values, dtypes and shapes; PyTorch CPU is the reference). A name PyTorch has at the top level with
another signature is listed in NOT_TOP_LEVEL with the reason, and blutensor does not export it there."""

from __future__ import annotations

import inspect

import blutensor as bt
import blutensor.functional as F
import blutensor.nn.functional as NF
import numpy as np
import pytest
import torch
from blutensor.ops.table import API, OPS

#: torch.<name> whose signature is not the functional one: exporting the functional under the name would
#: silently compute something else (or refuse torch's calls), so ``bt.<name>`` stays undefined
NOT_TOP_LEVEL = {
    "embedding": "torch.embedding(weight, indices) takes the reverse order of F.embedding(input, weight)",
    "dropout": "torch.dropout(input, p, train) has a required, differently named flag (F.dropout's training)",
    "binary_cross_entropy_with_logits": "torch's top-level form takes reduction as an int enum, not a string",
    "kl_div": "torch's top-level form takes reduction as an int enum, not a string",
}

_r = np.random.default_rng(0)
x = _r.standard_normal((3, 4))
y = _r.standard_normal((3, 4))
pos = np.abs(x) + 0.5
z = np.where(_r.random((3, 4)) < 0.3, 0.0, x)  # some exact zeros
x3 = _r.standard_normal((2, 3, 4))
y3 = _r.standard_normal((2, 4, 5))
sig = _r.standard_normal((2, 3, 8))  # (N, C, L)
img = _r.standard_normal((2, 3, 6, 6))  # (N, C, H, W)
idx = np.array([[0, 3], [2, 2], [1, 0]])
rows = np.array([2, 0])
src = _r.standard_normal((3, 2))
w4, b4 = _r.standard_normal(4), _r.standard_normal(4)

UNARY = ["abs", "celu", "clone", "cos", "exp", "neg", "relu", "selu", "sigmoid", "sin", "square", "tanh"]
POSITIVE = ["log", "rsqrt", "sqrt"]
BINARY = ["add", "allclose", "div", "divide", "eq", "floor_divide", "fmod", "ge", "gt", "isclose", "le", "lt",
          "maximum", "minimum", "mul", "ne", "remainder", "sub", "true_divide"]
ALONG_DIM1 = ["amax", "amin", "argmax", "argmin", "argsort", "cummax", "cummin", "cumprod", "cumsum",
              "log_softmax", "logcumsumexp", "logsumexp", "mean", "prod", "softmax", "sort", "std", "sum", "var"]

#: name -> (args, kwargs): NumPy arrays become bt / torch tensors, lists of them lists of tensors
CASES: dict[str, tuple[tuple, dict]] = {
    **{n: ((x,), {}) for n in UNARY},
    **{n: ((pos,), {}) for n in POSITIVE},
    **{n: ((x, y), {}) for n in BINARY},
    **{n: ((x, 1), {}) for n in ALONG_DIM1},
    "pow": ((pos, y), {}),
    "logical_not": ((z,), {}),
    "all": ((z,), {"dim": 1}),
    "any": ((z - z,), {}),
    "max": ((x, 1), {}),
    "min": ((x,), {}),
    "norm": ((x,), {}),
    "topk": ((x, 2), {}),
    "clamp": ((x,), {"min": -0.5, "max": 0.5}),
    "where": ((x > 0, x, y), {}),
    "masked_fill": ((x, z == 0, 2.5), {}),
    "cat": (([x, y], 1), {}),
    "stack": (([x, y],), {"dim": 0}),
    "chunk": ((x, 2, 1), {}),
    "split": ((x, 3, 1), {}),
    "unbind": ((x, 1), {}),
    "flatten": ((x3,), {"start_dim": 1}),
    "reshape": ((x, (4, 3)), {}),
    "permute": ((x3, (2, 0, 1)), {}),
    "transpose": ((x3, 0, 2), {}),
    "movedim": ((x3, 0, 2), {}),
    "squeeze": ((x[:, None],), {}),
    "unsqueeze": ((x, 1), {}),
    "flip": ((x, [0, 1]), {}),
    "roll": ((x, 1, 1), {}),
    "diagonal": ((x3,), {"dim1": 1, "dim2": 2}),
    "tril": ((x,), {"diagonal": 1}),
    "triu": ((x,), {}),
    "repeat_interleave": ((x, 2), {"dim": 0}),
    "matmul": ((x, y.T), {}),
    "bmm": ((x3, y3), {}),
    "einsum": (("ij,kj->ik", x, y), {}),
    "gather": ((x, 1, idx), {}),
    "take_along_dim": ((x, idx, 1), {}),
    "scatter": ((x, 1, idx, src), {}),
    "scatter_add": ((x, 1, idx, src), {}),
    "index_select": ((x, 0, rows), {}),
    "index_add": ((x, 0, rows, y[:2]), {"alpha": 2}),
    "multinomial": ((np.eye(4)[[2, 0, 3]], 1), {}),  # one-hot rows: the draw is certain
    "layer_norm": ((x, (4,), w4, b4), {"eps": 1e-5}),
    "rms_norm": ((x, (4,), w4), {"eps": 1e-6}),
    "conv1d": ((sig, _r.standard_normal((5, 3, 3)), _r.standard_normal(5)), {"padding": 1}),
    "conv2d": ((img, _r.standard_normal((4, 3, 3, 3)), None), {"stride": 2, "padding": 1}),
    "max_pool1d": ((sig, 2), {}),
    "max_pool2d": ((img, 3), {"stride": 2, "padding": 1}),
    "avg_pool1d": ((sig, 3), {"stride": 2}),
}


def _candidates() -> set[str]:
    names = set(OPS)
    for a in API.values():
        names |= set(a.functional)
    for mod in (F, NF):
        names |= {n for n in dir(mod) if not n.startswith("_") and inspect.isfunction(getattr(mod, n))}
    return names


def _to(lib, v):
    if isinstance(v, np.ndarray):
        return bt.tensor(v) if lib is bt else torch.tensor(v)
    if isinstance(v, list) and v and isinstance(v[0], np.ndarray):
        return [_to(lib, a) for a in v]
    return v


def _np(r):
    if isinstance(r, tuple | list):
        return [_np(a) for a in r]
    if isinstance(r, torch.Tensor):
        return r.detach().numpy()
    if isinstance(r, bt.Tensor):
        return r.numpy()
    return r


def _same(got, want, name):
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{name}: {len(got)} results, torch {len(want)}"
        for g, w in zip(got, want, strict=True):
            _same(g, w, name)
        return
    if not isinstance(want, np.ndarray):
        assert got == want, f"{name}: {got!r}, torch {want!r}"
        return
    assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape, (
        f"{name}: {getattr(got, 'dtype', type(got))} {getattr(got, 'shape', '')}, torch {want.dtype} {want.shape}")
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=name)


def test_every_torch_top_level_name_of_the_ops_has_a_case_or_a_reason():
    torch_names = {n for n in _candidates() if hasattr(torch, n)}
    unexplained = sorted(torch_names - set(CASES) - set(NOT_TOP_LEVEL))
    assert not unexplained, f"torch has these at the top level: export bt.<name> with a case here, or give a " \
                            f"reason in NOT_TOP_LEVEL: {unexplained}"
    assert set(CASES) <= torch_names, sorted(set(CASES) - torch_names)
    assert {"eq", "ge", "clone", "logical_not", "conv2d"} <= set(CASES) and "silu" not in torch_names
    exported_elsewhere = sorted(n for n in NOT_TOP_LEVEL if hasattr(bt, n))
    assert not exported_elsewhere, f"bt exports {exported_elsewhere} with a signature torch's does not have"
    only_bt = sorted(n for n in _candidates() if hasattr(bt, n) and not hasattr(torch, n))
    assert not only_bt, f"bt exports op names torch has only in torch.nn.functional (or not at all): {only_bt}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_top_level_function_gives_torchs_result(name):
    assert hasattr(bt, name) and name in bt.__all__, f"bt.{name} is missing (torch.{name} exists)"
    args, kwargs = CASES[name]
    want = getattr(torch, name)(*[_to(torch, a) for a in args], **kwargs)
    got = getattr(bt, name)(*[_to(bt, a) for a in args], **kwargs)
    _same(_np(got), _np(want), name)
