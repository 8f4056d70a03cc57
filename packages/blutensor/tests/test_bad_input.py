"""Bad input to the public API (CPU): each error has a blutensor class and names the argument at fault,
and is raised before any work is done (no NumPy-internal tracebacks, no silent wrong results)."""

from __future__ import annotations

import blutensor as bt
import blutensor.nn as nn
import blutensor.nn.functional as F
import numpy as np
import pytest


def test_error_classes():
    assert issubclass(bt.ArgumentError, ValueError) and issubclass(bt.ArgumentError, bt.BluTensorError)
    assert issubclass(bt.DTypeError, TypeError) and issubclass(bt.ShapeError, ValueError)


def test_creation_sizes():
    with pytest.raises(bt.ShapeError, match=r"zeros: size \(-1, 3\) has a negative dimension"):
        bt.zeros(-1, 3)
    with pytest.raises(bt.ShapeError, match=r"randn: size \(-2, 3\)"):  # was a silent (0, 3) tensor
        bt.randn(-2, 3)
    with pytest.raises(bt.ShapeError, match=r"full: size \(-1,\)"):
        bt.full((-1,), 2.0)
    with pytest.raises(bt.DTypeError, match=r"zeros: size must be a sequence of ints, got \(2\.5,\)"):
        bt.zeros(2.5)  # was silently truncated to 2
    with pytest.raises(bt.DTypeError, match=r"ones: size .*'3'"):
        bt.ones("3")
    with pytest.raises(bt.ArgumentError, match=r"randint: low \(5\) must be less than high \(2\)"):
        bt.randint(5, 2, (3,))
    with pytest.raises(bt.ArgumentError, match="arange: step must be nonzero"):
        bt.arange(0, 5, 0)
    with pytest.raises(bt.DTypeError, match="arange: end must be a number"):
        bt.arange("5")
    with pytest.raises(bt.ArgumentError, match="linspace: steps must be a non-negative int, got -3"):
        bt.linspace(0, 1, -3)
    with pytest.raises(bt.DTypeError, match="full: fill_value must be a number, got str"):
        bt.full((2,), "a")
    assert bt.zeros(np.int64(2), 3).shape == (2, 3) and bt.randint(0, 5, 4).shape == (4,)


def test_tensor_from_bad_data():
    with pytest.raises(bt.ShapeError, match="tensor: data is ragged"):
        bt.tensor([[1, 2], [3]])
    with pytest.raises(bt.DTypeError, match=r"tensor: .*non-numeric data of NumPy dtype <U1"):
        bt.tensor(["a", "b"])
    with pytest.raises(bt.DTypeError, match="dtype object"):
        bt.tensor(np.array([1, None], dtype=object))
    with pytest.raises(bt.DTypeError, match="complex128"):
        bt.tensor([1j])
    with pytest.raises(bt.DTypeError, match="from_numpy: expected a numpy.ndarray, got list"):
        bt.from_numpy([1, 2])
    with pytest.raises(bt.DTypeError, match="zeros_like: expected a Tensor, got list"):
        bt.zeros_like([1, 2])
    with pytest.raises(bt.DTypeError, match="set_default_dtype: only floating-point dtypes.*int64"):
        bt.set_default_dtype(bt.int64)
    assert bt.get_default_dtype() is bt.float32
    assert bt.tensor(np.ones(2, dtype=bt.bfloat16.np)).dtype is bt.bfloat16


def test_operands_that_are_not_tensors():
    x = bt.zeros(2, 3)
    with pytest.raises(bt.DTypeError, match="operand str 'a' is not a Tensor or a real number"):
        x + "a"
    with pytest.raises(bt.DTypeError, match="operand list is not a Tensor"):
        x * [1.0, 2.0, 3.0]
    with pytest.raises(bt.DTypeError, match="matmul: expected a Tensor operand, got list"):
        x @ [[1.0], [2.0], [3.0]]
    with pytest.raises(bt.DTypeError, match=r"where: condition must be a bool Tensor, got Tensor\(shape=\(2, 3\), "
                                            r"dtype=float32"):
        bt.where(x, x, x)  # was silently used as truthiness
    with pytest.raises(bt.DTypeError, match="masked_fill: mask must be a bool Tensor.*float32"):
        x.masked_fill(x, 1.0)
    with pytest.raises(bt.DTypeError, match="masked_fill_: mask must be a bool Tensor"):
        x.masked_fill_(x, 1.0)
    with pytest.raises(bt.DTypeError, match=r"to: 'tpu' is neither a device .* nor a dtype"):
        x.to("tpu")
    with pytest.raises(bt.DTypeError, match=r"to: 'tpu' is neither a device"):
        nn.Linear(2, 2).to("tpu")


def test_shape_op_arguments():
    x = bt.zeros(2, 3, 4)
    with pytest.raises(bt.ShapeError, match="flatten: dim 3 out of range for a tensor with 3 dims"):
        x.flatten(3)  # was a silent no-op
    with pytest.raises(bt.ShapeError, match=r"flatten: start_dim 2 comes after end_dim 1 for shape \(2, 3, 4\)"):
        x.flatten(2, 1)  # was a silent (2, 3, 1, 4)
    assert bt.zeros(0, 2, 3).flatten(1).shape == (0, 6) and bt.tensor(1.0).flatten().shape == (1,)
    with pytest.raises(bt.ArgumentError, match="split: split_size must be a positive int, got 0"):
        x.split(0, dim=1)
    with pytest.raises(bt.ArgumentError, match="chunk: chunks must be a positive int, got 0"):
        x.chunk(0)
    with pytest.raises(bt.ShapeError, match="split: dim 5 out of range"):
        x.split(1, dim=5)  # was a silent split along dim 5 % 3
    with pytest.raises(bt.ArgumentError, match=r"split: sections must be non-negative ints, got \[-1, 4\]"):
        x.split([-1, 4], dim=1)
    with pytest.raises(bt.ShapeError, match=r"tril: input must have at least 2 dims, got shape \(3,\)"):
        bt.tril(bt.zeros(3))
    with pytest.raises(bt.DTypeError, match="sum: dim must be an int, got float 1.0"):
        x.sum(dim=1.0)
    with pytest.raises(bt.ShapeError, match=r"sum: dims \(0, -3\) repeat a dim"):
        x.sum(dim=(0, -3))
    with pytest.raises(bt.DTypeError, match=r"view: shape \(2.0, 12\) must hold ints"):
        x.reshape(2.0, 12)
    with pytest.raises(bt.ShapeError, match=r"setitem: cannot assign 1.0 to the selection 5 of Tensor\(shape="
                                            r"\(2, 3, 4\)"):
        x[5] = 1.0
    with pytest.raises(bt.ShapeError, match=r"setitem: cannot assign Tensor\(shape=\(5,\)"):
        x[0] = bt.zeros(5)


def test_cat_stack_arguments():
    a = bt.zeros(2, 3)
    with pytest.raises(bt.DTypeError, match=r"cat: expected a sequence of tensors, got a single Tensor"):
        bt.cat(a)  # was a silent cat of its rows
    with pytest.raises(bt.DTypeError, match="cat: element 1 is a list, not a Tensor"):
        bt.cat([a, [1, 2, 3]])
    s = bt.stack([a, bt.ones(2, 3, dtype=bt.int64)])  # promoted like PyTorch (was a silent float64 result)
    assert s.dtype is bt.float32 and s.shape == (2, 2, 3) and s[1].tolist() == [[1.0] * 3] * 2
    c = bt.cat([bt.ones(1, dtype=bt.float64, requires_grad=True), bt.tensor([2], dtype=bt.int32)])
    assert c.dtype is bt.float64 and c.tolist() == [1.0, 2.0]
    with pytest.raises(bt.ShapeError, match="cat: zero-dimensional tensors cannot be concatenated"):
        bt.cat([bt.tensor(1.0), bt.tensor(2.0)])
    with pytest.raises(bt.ShapeError, match="stack: dim 4 out of range for a tensor with 3 dims"):
        bt.stack([a, a], dim=4)  # was a silent stack along dim 4 % 3
    assert bt.stack([a, a], dim=-3).shape == (2, 2, 3)


def test_linear_embedding_arguments():
    with pytest.raises(bt.ShapeError, match=r"linear: weight must be 2-D .* got shape \(3,\)"):
        F.linear(bt.zeros(2, 3), bt.zeros(3))
    with pytest.raises(bt.ShapeError, match=r"linear: bias shape \(5,\) does not match weight shape \(4, 3\)"):
        F.linear(bt.zeros(2, 3), bt.zeros(4, 3), bt.zeros(5))
    with pytest.raises(bt.ShapeError, match=r"linear: input must have at least 1 dim"):
        nn.Linear(4, 5)(bt.tensor(1.0))
    with pytest.raises(bt.ArgumentError, match="Linear: in_features must be >= 0, got -4"):
        nn.Linear(-4, 5)
    with pytest.raises(bt.DTypeError, match="Linear: in_features must be an int, got float 4.5"):
        nn.Linear(4.5, 5)
    with pytest.raises(bt.ArgumentError, match="Embedding: num_embeddings must be >= 0"):
        nn.Embedding(-1, 4)
    with pytest.raises(bt.ArgumentError, match=r"LayerNorm: normalized_shape\[0\] must be >= 0"):
        nn.LayerNorm(-3)
    emb = nn.Embedding(10, 4)
    with pytest.raises(bt.DTypeError, match="embedding: indices must be an integer Tensor, got list"):
        emb([1, 2])
    with pytest.raises(bt.DTypeError, match=r"embedding: indices must be an integer Tensor, got Tensor.*bool"):
        emb(bt.tensor([True]))
    with pytest.raises(bt.ShapeError, match=r"embedding: weight must be 2-D .* got shape \(4,\)"):
        F.embedding(bt.tensor([1]), bt.zeros(4))


def test_nn_option_arguments():
    x, t = bt.zeros(2, 3), bt.tensor([0, 1])
    with pytest.raises(bt.ArgumentError, match="gelu: approximate must be 'none' or 'tanh', got 'fast'"):
        F.gelu(x, approximate="fast")
    with pytest.raises(bt.ArgumentError, match="GELU: approximate"):
        nn.GELU("fast")
    with pytest.raises(ValueError, match=r"Dropout: p must be in \[0, 1\], got 2.0"):
        nn.Dropout(2.0)
    with pytest.raises(bt.ArgumentError, match="cross_entropy: reduction must be 'mean', 'sum' or 'none', got 'avg'"):
        F.cross_entropy(x, t, reduction="avg")
    with pytest.raises(bt.ArgumentError, match=r"cross_entropy: label_smoothing must be in \[0, 1\], got 1.5"):
        F.cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(bt.DTypeError, match="cross_entropy: logits must be a floating-point Tensor.*int64"):
        F.cross_entropy(bt.zeros(2, 3, dtype=bt.int64), t)  # was an int64 'loss'
    with pytest.raises(bt.DTypeError, match="cross_entropy: target must hold class indices .*got list"):
        F.cross_entropy(x, [0, 1])
    with pytest.raises(bt.DTypeError, match="Sequential: submodule '0' must be a Module or None, got function"):
        nn.Sequential(lambda v: v)
    with pytest.raises(bt.DTypeError, match="ModuleList: submodule '0' must be a Module or None, got int"):
        nn.ModuleList([3])
    with pytest.raises(bt.DTypeError, match="register_parameter: 'w' must be a Parameter or None, got int"):
        nn.Module().register_parameter("w", 3)


def test_sdpa_arguments():
    q = bt.zeros(1, 2, 4, 8)
    with pytest.raises(bt.ShapeError, match=r"batch dims of q \(1, 2, 4, 8\), k \(1, 3, 4, 8\), v \(1, 3, 4, 8\) do "
                                            r"not broadcast"):
        F.scaled_dot_product_attention(q, bt.zeros(1, 3, 4, 8), bt.zeros(1, 3, 4, 8))
    with pytest.raises(bt.ShapeError, match=r"q must have at least 2 dims .* got shape \(8,\)"):
        F.scaled_dot_product_attention(bt.zeros(8), bt.zeros(8), bt.zeros(8))
    with pytest.raises(bt.ShapeError, match=r"attn_mask shape \(3, 3\) does not broadcast to \(\.\.\., L, S\) = "
                                            r"\(1, 2, 4, 4\)"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=bt.zeros(3, 3))
    with pytest.raises(bt.ArgumentError, match="either attn_mask or is_causal=True, not both"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=bt.zeros(4, 4), is_causal=True)
    with pytest.raises(bt.ArgumentError, match=r"dropout_p must be in \[0, 1\), got 1.5"):
        F.scaled_dot_product_attention(q, q, q, dropout_p=1.5)
    # still accepted: a (L, S) mask and batch dims that broadcast
    assert F.scaled_dot_product_attention(q, q, q, attn_mask=bt.zeros(4, 4)).shape == (1, 2, 4, 8)
    k = bt.zeros(3, 1, 4, 8)
    assert F.scaled_dot_product_attention(q, k, k).shape == (3, 2, 4, 8)


def test_optimizer_arguments():
    params = list(nn.Linear(3, 2).parameters())
    with pytest.raises(bt.ArgumentError, match=r"AdamW: invalid hyperparameters: lr='1e-3' must be a number"):
        bt.optim.AdamW(params, lr="1e-3")
    with pytest.raises(bt.ArgumentError, match=r"betas=\(0.9,\) must be a pair"):
        bt.optim.AdamW(params, betas=(0.9,))
    with pytest.raises(bt.ArgumentError, match=r"betas\[1\]=1.5 must be in \[0.0, 1.0\)"):
        bt.optim.AdamW(params, betas=(0.9, 1.5))
    with pytest.raises(bt.ArgumentError, match="SGD: invalid hyperparameters: lr=-1 must be >= 0"):
        bt.optim.SGD(params, lr=-1)
    with pytest.raises(bt.DTypeError, match=r"AdamW: params must be an iterable of Tensors, got a single Tensor"):
        bt.optim.AdamW(bt.zeros(3, requires_grad=True))  # was an optimizer over the tensor's rows
    with pytest.raises(bt.DTypeError, match=r"params is a Linear module; pass its .parameters\(\)"):
        bt.optim.AdamW(nn.Linear(3, 2))
    with pytest.raises(bt.DTypeError, match=r"AdamW: params\[1\] is a int, not a Tensor"):
        bt.optim.AdamW([params[0], 2])
    with pytest.raises(bt.ArgumentError, match=r"params\[0\] .* is not a leaf tensor"):
        bt.optim.AdamW([bt.ones(3, requires_grad=True) * 2])
    with pytest.raises(bt.ArgumentError, match="param group 0 must be a dict with a 'params' key"):
        bt.optim.AdamW([{"lr": 1e-3}])
    opt = bt.optim.AdamW(params)
    with pytest.raises(bt.ArgumentError, match=r"AdamW.load_state_dict: expected a dict with 'state' and "
                                               r"'param_groups'"):
        opt.load_state_dict({"foo": 1})


@pytest.mark.parametrize("make", [lambda ps: bt.optim.AdamW(ps, lr=0.1), lambda ps: bt.optim.SGD(ps, lr=0.1)])
def test_optimizer_step_checks_grad_shapes_before_updating(make):
    a, b = bt.ones(3, requires_grad=True), bt.ones(2, requires_grad=True)
    opt = make([a, b])
    a.grad, b.grad = bt.ones(3), bt.ones(4)
    with pytest.raises(bt.ShapeError, match=r"step: parameter Tensor\(shape=\(2,\).*gradient Tensor\(shape=\(4,\)"):
        opt.step()
    assert a.numpy().tolist() == [1.0, 1.0, 1.0]  # nothing was updated


def test_module_state_dict_arguments():
    m = nn.Linear(3, 2)
    with pytest.raises(bt.DTypeError, match=r"load_state_dict\(Linear\): 'weight' is a list"):
        m.load_state_dict({"weight": [[0.0] * 3] * 2, "bias": [0.0, 0.0]})
    with pytest.raises(bt.DTypeError, match=r"load_state_dict\(Linear\): expected a dict of name -> Tensor, got list"):
        m.load_state_dict([1, 2])


def test_grad_mode_and_rng_arguments():
    with pytest.raises(bt.DTypeError, match="set_grad_enabled: mode must be a bool, got str 'no'"):
        bt.set_grad_enabled("no")
    assert bt.is_grad_enabled()

    @bt.no_grad
    def f(x):
        return x * 2

    assert not f(bt.ones(2, requires_grad=True)).requires_grad and bt.is_grad_enabled()
    with pytest.raises(bt.DTypeError, match=r"set_rng_state: expected the dict from get_rng_state\(\)"):
        bt.set_rng_state("x")


def test_float_only_ops_refuse_integer_tensors():
    """Each used to return a silently truncated integer result, an int64 'attention', or a NumPy cast error."""
    xi = bt.arange(6).reshape(2, 3)
    for name, fn in [("sigmoid", bt.sigmoid), ("gelu", F.gelu), ("softmax", lambda t: F.softmax(t, -1)),
                     ("log_softmax", lambda t: F.log_softmax(t, -1)), ("layer_norm", lambda t: F.layer_norm(t, 3))]:
        with pytest.raises(bt.DTypeError, match=rf"{name}: needs a floating-point tensor, got Tensor\(shape=\(2, 3\), "
                                                r"dtype=int64"):
            fn(xi)
    qi = bt.zeros(1, 4, 8, dtype=bt.int64)
    with pytest.raises(bt.DTypeError, match="scaled_dot_product_attention: q: needs a floating-point tensor"):
        F.scaled_dot_product_attention(qi, qi, qi)
    with pytest.raises(bt.ArgumentError, match="softmax: dim must be given"):
        F.softmax(bt.zeros(2, 3), dim=None)
    with pytest.raises(bt.DTypeError, match="log_softmax: dim must be an int, got float 1.0"):
        F.log_softmax(bt.zeros(2, 3), dim=1.0)
    with pytest.raises(bt.DTypeError, match="unsqueeze: dim must be an int, got float 1.5"):
        bt.zeros(2, 3).unsqueeze(1.5)  # was silently dim 1


def test_tensor_method_arguments():
    x = bt.zeros(2, 3)
    with pytest.raises(bt.DTypeError, match=r"fill_: value must be a real number, got NoneType None \(filling Tensor"):
        x.fill_(None)  # was a silent fill with NaN
    with pytest.raises(bt.DTypeError, match="fill_: value must be a real number, got str 'a'"):
        x.fill_("a")
    with pytest.raises(bt.DTypeError, match="clamp: min must be a number, a Tensor or None, got str 'a'"):
        x.clamp("a")
    with pytest.raises(bt.ArgumentError, match="dropout: p must be a number in \\[0, 1\\], got str '0.5'"):
        F.dropout(x, p="0.5")
    with pytest.raises(TypeError, match=r"iteration over a 0-d tensor"):
        list(bt.tensor(1.0))
    w = bt.ones(2, requires_grad=True)
    with pytest.raises(bt.DTypeError, match="register_hook: hook must be callable, got int"):
        w.register_hook(3)  # used to fail only inside a later backward
    with pytest.raises(bt.DTypeError, match="register_post_accumulate_grad_hook: hook must be callable"):
        w.register_post_accumulate_grad_hook(None)
    with pytest.raises(bt.DTypeError, match=r"grad: inputs\[0\] is a int, not a Tensor"):
        bt.grad((w * 2).sum(), [3])
    with pytest.raises(ValueError, match=r"bad device 'cuda:-1'"):
        bt.device("cuda:-1")


def test_training_utility_arguments():
    lin = nn.Linear(2, 2)
    with pytest.raises(bt.ArgumentError, match="AdamW: invalid hyperparameters: lr=-1 must be >= 0"):
        bt.optim.AdamW([{"params": list(lin.parameters()), "lr": -1}])  # a group's own value is checked too
    with pytest.raises(bt.ArgumentError, match="clip_grad_norm_: max_norm must be a number, got str '1.0'"):
        bt.optim.clip_grad_norm_(list(lin.parameters()), "1.0")
    with pytest.raises(bt.DTypeError, match=r"clip_grad_norm_: parameters\[0\] is a int"):
        bt.optim.clip_grad_norm_([1, 2], 1.0)
    with pytest.raises(bt.DTypeError, match="LambdaLR: expected an optimizer"):
        bt.optim.lr_scheduler.LambdaLR([1], lambda s: 1.0)
    from blutensor.utils.checkpoint import checkpoint

    with pytest.raises(bt.DTypeError, match="checkpoint: fn must be callable"):
        checkpoint(3, bt.zeros(2, requires_grad=True))
    with pytest.raises(bt.DTypeError, match="Parameter: data must be a Tensor, got list"):
        nn.Parameter([1.0, 2.0])
    with pytest.raises(bt.AutogradError, match="Parameter: only floating-point tensors can require grad"):
        nn.Parameter(bt.arange(3))
    assert nn.Parameter(bt.arange(3), requires_grad=False).dtype is bt.int64
    with pytest.raises(bt.DTypeError, match="manual_seed: seed must be an int, got float 1.5"):
        bt.manual_seed(1.5)  # was silently seed 1


def test_more_silent_cases():
    x = bt.zeros(2, 3)
    with pytest.raises(bt.AutogradError, match=r"'with no_grad:' needs parentheses"):
        with bt.no_grad:
            pass
    assert bt.is_grad_enabled()
    with pytest.raises(bt.DTypeError, match=r"expand: shape \(2.5, 3\) must hold ints"):
        bt.zeros(1, 3).expand(2.5, 3)  # was silently 2
    with pytest.raises(bt.DTypeError, match="split: split_size_or_sections must be an int or a list of ints"):
        x.split(1.5)
    with pytest.raises(bt.DTypeError, match="view: reinterpreting .* as int32 is not supported"):
        x.view(bt.int32)
    with pytest.raises(bt.ArgumentError, match="norm: p must be a nonzero number or inf, got 0"):
        bt.norm(x, p=0)
    v = bt.tensor([3.0, -4.0])
    assert bt.norm(v, p=float("inf")).item() == 4.0  # was 1.0 (|v| ** inf ** 0)
    with pytest.raises(bt.ArgumentError, match="normal_: std must be >= 0, got -1"):
        x.normal_(0, -1)
    with pytest.raises(bt.ArgumentError, match="uniform_: needs a <= b, got a=1, b=0"):
        x.uniform_(1, 0)
    with pytest.raises(bt.DTypeError, match="generator must be a blutensor.Generator, got int"):
        bt.randn(2, generator=3)
    lin = nn.Linear(2, 2)
    with pytest.raises(bt.DTypeError, match="Linear: cannot assign a int to parameter 'weight'"):
        lin.weight = 3  # used to replace the parameter silently
    assert isinstance(lin.weight, nn.Parameter)


def test_tensor_integer_overflow_and_nan():
    with pytest.raises(bt.ArgumentError, match=r"tensor: value 1099511627776 is out of range for int32"):
        bt.tensor([2**40], dtype=bt.int32)  # was a silent wrap-around to 0
    with pytest.raises(bt.ArgumentError, match="tensor: value -1 is out of range for uint16"):
        bt.tensor([-1], dtype=bt.uint16)
    with pytest.raises(bt.ArgumentError, match="NaN or inf in the data cannot be converted to int64"):
        bt.tensor([float("nan")], dtype=bt.int64)
    assert bt.tensor([1.7, -2.0], dtype=bt.int64).tolist() == [1, -2]  # truncation, as in PyTorch
    assert bt.tensor(np.arange(3), dtype=bt.int32).tolist() == [0, 1, 2]


def test_array_module_type_errors_are_dtype_errors():
    """A TypeError from NumPy inside a kernel is re-raised as DTypeError (was ShapeError), naming op and operands."""
    with pytest.raises(bt.DTypeError, match=r"neg failed on Tensor\(shape=\(2,\), dtype=bool"):
        -bt.zeros(2, dtype=bt.bool_)
    with pytest.raises(bt.DTypeError, match=r"add failed on Tensor\(shape=\(2, 3\)"):
        bt.zeros(2, 3) + None
    with pytest.raises(bt.ShapeError, match=r"add failed on .*\(2, 3\).*\(4,\)"):
        bt.zeros(2, 3) + bt.zeros(4)


@pytest.mark.parametrize("op", ["exp", "log", "tanh", "sqrt", "rsqrt", "sin", "cos"])
def test_transcendental_ops_refuse_integer_and_bool(op):
    """Their kernels serve floating dtypes only (table DTYPES): an int64 input used to give a float64 result and a
    bool input float16 (NumPy's promotion) while PyTorch gives float32; now a DTypeError names op and dtype."""
    for x in (bt.tensor([1, 2]), bt.tensor([True, False])):
        with pytest.raises(bt.DTypeError, match=rf"{op}: no kernel for dtype {x.dtype.name} \(kernels serve "
                                                 r"bfloat16, float16, float32, float64\)"):
            getattr(bt, op)(x)
    y = getattr(bt, op)(bt.tensor([1.0, 2.0]))  # floating inputs unchanged, reference: NumPy float64
    ref = 1 / np.sqrt([1.0, 2.0]) if op == "rsqrt" else getattr(np, op)(np.array([1.0, 2.0]))
    assert y.dtype == bt.float32
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-6)


def test_cross_entropy_pytorch_layout():
    """PyTorch's (N, C, d) logits with an (N, d) target: the class dim is dim 1, so the loss equals the
    flattened (N*d, C) loss of the logits with the class dim moved last; a class-last target shape is refused."""
    rng = np.random.default_rng(0)
    x, t = rng.standard_normal((2, 5, 3)), rng.integers(0, 5, (2, 3))
    with pytest.raises(bt.ShapeError, match=r"need a target of shape \(2, 3\) \(N, d...\), got \(2, 5\)"):
        F.cross_entropy(bt.tensor(x), bt.tensor(rng.integers(0, 3, (2, 5))))
    got = F.cross_entropy(bt.tensor(x, dtype=bt.float64), bt.tensor(t)).item()
    z = np.moveaxis(x, 1, -1).reshape(-1, 5)
    ref = np.mean(np.log(np.exp(z).sum(-1)) - z[np.arange(6), t.reshape(-1)])
    assert abs(got - ref) < 1e-12
