"""The functional API (``blutensor.nn.functional`` re-exports the NN part).

Most functions here are generated from the op table (``ops/table.py``): a row's ``api=api(...)`` gives the
signature, docstring and public names, and :mod:`blutensor.ops.surface` compiles the wrapper that calls
:func:`blutensor.ops.dispatch.apply` (add, sub, mul, pow, the comparisons, exp/log/tanh/sqrt/..., mean, amax,
argmax, all/any, logsumexp, transpose, squeeze/unsqueeze, clone, matmul, bmm, linear, rope, swiglu, gather,
index_select, argsort, logcumsumexp, the activations silu, elu, softplus, ...). The functions written out below
have logic a table row does not express:

- ``div`` (``rounding_mode`` picks another op), ``clamp`` (checks of Tensor-or-number bounds),
  ``where`` / ``masked_fill`` (bool-condition checks, value normalisation), ``cast`` (no-op for the same dtype),
  ``square`` (``mul(a, a)``), ``allclose`` (a Python bool);
- ``sum`` / ``prod`` (``dtype=`` casts first), ``max`` / ``min`` (PyTorch's three overloads, a (values, indices)
  pair along a dim), ``var`` / ``std`` (``unbiased`` -> ``correction``), ``norm`` (p-norm composition);
- ``view`` / ``reshape`` / ``permute`` / ``expand`` (``*shape`` or one sequence; reshape views when it can),
  ``view_as`` / ``expand_as``, ``flatten`` (shape inference), ``contiguous`` (no copy when contiguous),
  ``split`` / ``chunk`` (section sizes, several outputs), ``cat`` / ``stack`` (a sequence of tensors, type
  promotion), ``tril`` / ``triu`` (matrix-rank check);
- ``softmax`` / ``log_softmax`` (a ``dim`` is required and checked), ``layer_norm`` / ``rms_norm`` (an int
  ``normalized_shape``, the dtype's epsilon), ``add_rms_norm`` / ``add_layer_norm`` (fused pair, autocast
  output dtype), ``gelu`` (``approximate`` check), ``cross_entropy`` (PyTorch's target forms, weights,
  label smoothing), ``embedding`` (index and weight checks), ``dropout`` / ``scaled_dot_product_attention``
  (random draw offsets, grouped-query heads, shape checks), ``to_device`` (a device copy, not an op).

``activations``, ``indexing`` (``scatter``), ``reshaping`` and ``sorting`` hold the rest under PyTorch's names.
"""

from __future__ import annotations

import math
import numbers
from collections import namedtuple

from blutensor import random as _random
from blutensor.autograd.grad_mode import STATE
from blutensor.autograd.node import Ctx, Node
from blutensor.errors import ArgumentError, DTypeError, ShapeError
from blutensor.ops._util import norm_dim
from blutensor.ops.dispatch import apply
from blutensor.ops.surface import generate as _generate
from blutensor.ops.surface import require_floating as _floating
from blutensor.ops.table import API as _API

#: the functions and Tensor methods generated from the op table's rows (``_tensor`` installs the methods)
_generated_functions, _generated_methods = _generate(_API)
globals().update(_generated_functions)
# the generated functions that the hand-written ones below call, by name (for readers and linters)
abs, amax, gather, ge, isclose, lt, maximum, minimum, ne, sqrt, unsqueeze = (  # noqa: A001
    _generated_functions[n] for n in ("abs", "amax", "gather", "ge", "isclose", "lt", "maximum", "minimum", "ne",
                                      "sqrt", "unsqueeze"))

# ---- elementwise ----


def _s(o):
    from blutensor._tensor import _scalar

    return _scalar(o)


def div(a, b, *, rounding_mode=None):
    """True division, or rounded toward zero (``rounding_mode="trunc"``) or down (``"floor"``); the rounded
    forms keep integer dtypes and have a zero gradient, as in PyTorch."""
    if rounding_mode is None:
        return apply("div", a, _s(b))
    if rounding_mode not in ("trunc", "floor"):
        raise ArgumentError(f"div: rounding_mode must be None, 'trunc' or 'floor', got {rounding_mode!r}")
    return apply("div_rounded", a, _s(b), rounding_mode=rounding_mode)


true_divide = divide = div


def allclose(a, b, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False) -> bool:
    return bool(isclose(a, b, rtol, atol, equal_nan).all())


def square(a):
    return apply("mul", a, a)


def clamp(a, min=None, max=None):  # noqa: A002
    for name, v in (("min", min), ("max", max)):
        if v is not None and not isinstance(v, numbers.Real) and not hasattr(v, "_data"):
            raise DTypeError(f"clamp: {name} must be a number, a Tensor or None, got {type(v).__name__} {v!r:.40}")
    return apply("clamp", a, min=min, max=max)


def where(cond, a, b):
    from blutensor._tensor import Tensor

    if not isinstance(cond, Tensor) or cond.dtype.name != "bool":
        got = cond._desc() if isinstance(cond, Tensor) else type(cond).__name__
        raise DTypeError(f"where: condition must be a bool Tensor, got {got} (compare it, e.g. x > 0)")
    return apply("where", cond, _s(a), _s(b))


def bool_mask(op: str, mask) -> None:
    """Raise unless ``mask`` is a bool Tensor (masked_fill, masked_fill_)."""
    from blutensor._tensor import Tensor

    if not isinstance(mask, Tensor) or mask.dtype.name != "bool":
        got = mask._desc() if isinstance(mask, Tensor) else type(mask).__name__
        raise DTypeError(f"{op}: mask must be a bool Tensor, got {got}")


def masked_fill(a, mask, value):
    bool_mask("masked_fill", mask)
    return apply("masked_fill", a, mask, value=float(value) if not isinstance(value, bool) else value)


def cast(a, dtype):
    if a.dtype is dtype:
        return a
    return apply("cast", a, src=a.dtype, dst=dtype)


# ---- reductions ----

MaxMin = namedtuple("MaxMin", ["values", "indices"])


def sum(a, dim=None, keepdim=False, dtype=None):  # noqa: A001
    if dtype is not None:
        from blutensor.dtypes import as_dtype

        a = cast(a, as_dtype(dtype))
    return apply("sum", a, dim=dim, keepdim=keepdim)


def _is_tensor(x) -> bool:
    return hasattr(x, "_data") and hasattr(x, "grad_fn")


def max(a, dim=None, keepdim=False):  # noqa: A001
    """Global max, (values, indices) along ``dim``, or ``maximum(a, other)`` when ``dim`` is a Tensor (PyTorch's
    three overloads)."""
    if _is_tensor(dim):
        return maximum(a, dim)
    if dim is None:
        return apply("amax", a)
    return MaxMin(apply("max_dim", a, dim=dim, keepdim=keepdim), apply("argmax", a, dim=dim, keepdim=keepdim))


def min(a, dim=None, keepdim=False):  # noqa: A001
    """Global min, (values, indices) along ``dim``, or ``minimum(a, other)`` when ``dim`` is a Tensor."""
    if _is_tensor(dim):
        return minimum(a, dim)
    if dim is None:
        return apply("amin", a)
    return MaxMin(apply("min_dim", a, dim=dim, keepdim=keepdim), apply("argmin", a, dim=dim, keepdim=keepdim))


def var(a, dim=None, keepdim=False, correction=1, unbiased=None):
    if unbiased is not None:
        correction = 1 if unbiased else 0
    _floating(a, "var")
    return apply("var", a, dim=dim, keepdim=keepdim, correction=correction)


def std(a, dim=None, keepdim=False, correction=1, unbiased=None):
    return sqrt(var(a, dim, keepdim, correction, unbiased))


def norm(a, p=2, dim=None, keepdim=False):
    if p == math.inf:
        return amax(abs(a), dim=dim, keepdim=keepdim)
    if p == 0 or isinstance(p, bool) or not isinstance(p, numbers.Real) or p != p:
        raise ArgumentError(f"norm: p must be a nonzero number or inf, got {p!r}")
    if p != 2:
        return sum(abs(a) ** p, dim=dim, keepdim=keepdim) ** (1.0 / p)
    return sqrt(sum(a * a, dim=dim, keepdim=keepdim))


def prod(a, dim=None, keepdim=False, dtype=None):
    """Product of the elements (along ``dim``); integer and bool inputs give int64, as in PyTorch."""
    if dtype is not None:
        from blutensor.dtypes import as_dtype

        a = cast(a, as_dtype(dtype))
    return apply("prod", a, dim=dim, keepdim=keepdim)


# ---- shape ----


def _size(shape):
    if len(shape) == 1 and isinstance(shape[0], list | tuple):
        return tuple(shape[0])
    return tuple(shape)


def view(a, *shape):
    return apply("view", a, shape=_size(shape))


def reshape(a, *shape):
    shape = _size(shape)
    if a.is_contiguous():
        return apply("view", a, shape=shape)
    return apply("reshape", a, shape=shape)


def view_as(a, other):
    return view(a, other.shape)


def flatten(a, start_dim=0, end_dim=-1):
    nd = a.ndim
    s, e = norm_dim(start_dim, nd, "flatten"), norm_dim(end_dim, nd, "flatten")
    if s > e:
        raise ShapeError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim} for shape {tuple(a.shape)}")
    new = tuple(a.shape[:s]) + (math.prod(a.shape[s:e + 1]),) + tuple(a.shape[e + 1:])
    return reshape(a, new)


def permute(a, *dims):
    return apply("permute", a, dims=_size(dims))


def expand(a, *shape):
    return apply("expand", a, shape=_size(shape))


def expand_as(a, other):
    return expand(a, other.shape)


def contiguous(a):
    return a if a.is_contiguous() else apply("contiguous", a)


def split(a, split_size_or_sections, dim=0):
    if a.ndim == 0:
        raise ShapeError("split: cannot split a 0-d tensor")
    d = norm_dim(dim, a.ndim, "split")
    n = a.shape[d]
    if not isinstance(split_size_or_sections, numbers.Integral | list | tuple):
        raise DTypeError(f"split: split_size_or_sections must be an int or a list of ints, got "
                         f"{type(split_size_or_sections).__name__} {split_size_or_sections!r}")
    if isinstance(split_size_or_sections, numbers.Integral):
        if split_size_or_sections <= 0:
            raise ArgumentError(f"split: split_size must be a positive int, got {split_size_or_sections}")
        sizes = [split_size_or_sections] * (n // split_size_or_sections)
        if n % split_size_or_sections:
            sizes.append(n % split_size_or_sections)
    else:
        sizes = list(split_size_or_sections)
        if builtins_any(not isinstance(z, numbers.Integral) or z < 0 for z in sizes):
            raise ArgumentError(f"split: sections must be non-negative ints, got {sizes}")
        if builtins_sum(sizes) != n:
            raise ShapeError(f"split: sections {sizes} do not sum to dim {d} size {n} of shape {tuple(a.shape)}")
    out, start = [], 0
    for s in sizes:
        idx = (slice(None),) * d + (slice(start, start + s),)
        out.append(apply("getitem", a, index=idx))
        start += s
    return tuple(out)


def chunk(a, chunks, dim=0):
    if not isinstance(chunks, numbers.Integral) or chunks <= 0:
        raise ArgumentError(f"chunk: chunks must be a positive int, got {chunks!r}")
    if a.ndim == 0:
        raise ShapeError("chunk: cannot chunk a 0-d tensor")
    n = a.shape[norm_dim(dim, a.ndim, "chunk")]
    return split(a, -(-n // chunks), dim)


def _tensor_list(op: str, tensors) -> list:
    """The tensors of cat/stack as a list: a non-empty sequence of tensors, cast to their promoted dtype."""
    from blutensor._tensor import Tensor

    if isinstance(tensors, Tensor):
        raise DTypeError(f"{op}: expected a sequence of tensors, got a single {tensors._desc()} "
                         f"(wrap it in a list)")
    tensors = list(tensors)
    if not tensors:
        raise ShapeError(f"{op}: expected a non-empty list of tensors")
    t0 = tensors[0]
    mixed = False
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise DTypeError(f"{op}: element {i} is a {type(t).__name__}, not a Tensor")
        mixed = mixed or t.dtype is not t0.dtype
    if mixed:  # PyTorch promotes the inputs of cat/stack to their common dtype (differentiably)
        from blutensor.dtypes import promote_types

        want = t0.dtype
        for t in tensors[1:]:
            want = promote_types(want, t.dtype)
        tensors = [cast(t, want) for t in tensors]
    return tensors


def cat(tensors, dim=0):
    tensors = _tensor_list("cat", tensors)
    if tensors[0].ndim == 0:
        raise ShapeError("cat: zero-dimensional tensors cannot be concatenated (use stack)")
    return apply("cat", *tensors, dim=dim)


def stack(tensors, dim=0):
    tensors = _tensor_list("stack", tensors)
    norm_dim(dim, tensors[0].ndim + 1, "stack")
    return apply("stack", *tensors, dim=dim)


def _matrix(op: str, a) -> None:
    if a.ndim < 2:
        raise ShapeError(f"{op}: input must have at least 2 dims, got shape {tuple(a.shape)}")


def tril(a, diagonal=0):
    _matrix("tril", a)
    return apply("tril", a, diagonal=diagonal)


def triu(a, diagonal=0):
    _matrix("triu", a)
    return apply("triu", a, diagonal=diagonal)


# ---- linear algebra ----


# ---- neural-network ops ----


def _softmax_args(op: str, a, dim) -> None:
    _floating(a, op)
    if type(dim) is not int:
        if dim is None:
            raise ArgumentError(f"{op}: dim must be given (an int), got None")
        norm_dim(dim, a.ndim, op)  # raises for a non-int dim


def softmax(a, dim=-1):
    _softmax_args("softmax", a, dim)
    return apply("softmax", a, dim=dim)


def log_softmax(a, dim=-1):
    _softmax_args("log_softmax", a, dim)
    return apply("log_softmax", a, dim=dim)


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    _floating(x, "layer_norm")
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    return apply("layer_norm", x, weight, bias, normalized_shape=tuple(normalized_shape), eps=eps)


def rms_norm(x, normalized_shape, weight=None, eps=None):
    """x / sqrt(mean(x^2) + eps) * weight over the trailing ``normalized_shape`` dims (PyTorch's
    ``F.rms_norm``; ``eps=None`` is the dtype's machine epsilon, as there)."""
    _floating(x, "rms_norm")
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    if eps is None:
        import numpy as np

        eps = float(np.finfo(np.float32 if x.dtype.name == "bfloat16" else x.dtype.np).eps)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ArgumentError(f"rms_norm: eps must be a non-negative number, got {eps!r}")
    return apply("rms_norm", x, weight, normalized_shape=tuple(normalized_shape), eps=float(eps))


def add_rms_norm(x, residual, normalized_shape, weight=None, eps=None):
    """``(h, y)``: ``h = x + residual`` (the new residual stream) and ``y = rms_norm(h, normalized_shape, weight,
    eps)`` in one fused op, forward and backward (the pre-norm of a Llama block). ``h`` has the promoted dtype of
    the two addends; inside ``autocast`` on their device ``y`` is in the autocast dtype (the next matmul's input),
    else in ``h``'s. ``eps=None`` is the dtype's machine epsilon, as in :func:`rms_norm`."""
    from blutensor.ops.residual_norm import add_rms_norm as _fused

    x, residual, normalized_shape, h_dtype, y_dtype = _residual_norm_args("add_rms_norm", x, residual,
                                                                         normalized_shape, (("weight", weight),))
    if eps is None:
        import numpy as np

        eps = float(np.finfo(np.float32 if h_dtype.name == "bfloat16" else h_dtype.np).eps)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ArgumentError(f"add_rms_norm: eps must be a non-negative number, got {eps!r}")
    return _fused(x, residual, normalized_shape, weight, float(eps), y_dtype)


def add_layer_norm(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
    """``(h, y)``: ``h = x + residual`` (the new residual stream) and ``y = layer_norm(h, normalized_shape, weight,
    bias, eps)`` in one fused op, forward and backward (the pre-norm of a GPT-2 block after a sublayer's residual
    add). ``h`` has the promoted dtype of the two addends; inside ``autocast`` on their device ``y`` is in the
    autocast dtype (the next matmul's input: no separate cast), else in ``h``'s. Values equal ``x + residual``
    followed by :func:`layer_norm` (and autocast's cast of its output)."""
    from blutensor.ops.residual_norm import add_layer_norm as _fused

    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ArgumentError(f"add_layer_norm: eps must be a non-negative number, got {eps!r}")
    x, residual, normalized_shape, h_dtype, y_dtype = _residual_norm_args("add_layer_norm", x, residual,
                                                                         normalized_shape, (("weight", weight),
                                                                                            ("bias", bias)))
    return _fused(x, residual, normalized_shape, weight, bias, float(eps), y_dtype)


def _residual_norm_args(op: str, x, residual, normalized_shape, params):
    """The checks of a fused residual add + norm: (x, residual in h's dtype, normalized_shape, h's dtype, y's)."""
    from blutensor._tensor import Tensor
    from blutensor.amp import get_autocast_dtype, is_autocast_enabled
    from blutensor.dtypes import promote_types

    for name, t in (("x", x), ("residual", residual)):
        if not isinstance(t, Tensor):
            raise ArgumentError(f"{op}: {name} must be a Tensor, got {type(t).__name__}")
        _floating(t, f"{op}: {name}")
    if tuple(x.shape) != tuple(residual.shape):
        raise ShapeError(f"{op}: x {tuple(x.shape)} and residual {tuple(residual.shape)} must have one shape")
    if x.device != residual.device:
        raise ArgumentError(f"{op}: x is on {x.device}, residual on {residual.device}")
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    normalized_shape = tuple(normalized_shape)
    n = len(normalized_shape)
    if n == 0 or tuple(x.shape[x.ndim - n:]) != normalized_shape:
        raise ShapeError(f"{op}: input shape {tuple(x.shape)} does not end with normalized_shape {normalized_shape}")
    for name, p in params:
        if p is not None and (not isinstance(p, Tensor) or tuple(p.shape) != normalized_shape
                              or p.device != x.device):
            got = f"{tuple(p.shape)} on {p.device}" if isinstance(p, Tensor) else type(p).__name__
            raise ShapeError(f"{op}: {name} must be a {normalized_shape} Tensor on {x.device}, got {got}")
        if p is not None:
            _floating(p, f"{op}: {name}")
    h_dtype = promote_types(x.dtype, residual.dtype)
    dev = x.device.type
    y_dtype = get_autocast_dtype(dev) if is_autocast_enabled(dev) and h_dtype.name in ("float32", "bfloat16") \
        else h_dtype
    if h_dtype != residual.dtype:  # the fused op writes h in the residual's dtype
        residual = residual.to(h_dtype)
    return x, residual, normalized_shape, h_dtype, y_dtype


def gelu(x, approximate="none"):
    if approximate != "none" and approximate != "tanh":
        raise ArgumentError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    _floating(x, "gelu")
    return apply("gelu", x, approximate=approximate)


def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,  # noqa: A002
                  reduction="mean", label_smoothing=0.0):
    """PyTorch's cross_entropy: logits ``(C,)``, ``(N, C)`` or ``(N, C, d1, ...)`` (classes in dim 1) and
    either class indices ``()``, ``(N,)``, ``(N, d1, ...)`` (``ignore_index`` skipped) or class probabilities
    of the logits' shape; optional per-class ``weight``; ``label_smoothing`` mixes in the uniform
    distribution. Index targets without weight run the fused kernel, on logits with the class dim moved last."""
    from blutensor._tensor import Tensor

    if not isinstance(input, Tensor) or not input.dtype.is_floating_point:
        got = input._desc() if isinstance(input, Tensor) else type(input).__name__
        raise DTypeError(f"cross_entropy: logits must be a floating-point Tensor, got {got}")
    if not isinstance(target, Tensor) or target.dtype.name == "bool":
        got = target._desc() if isinstance(target, Tensor) else type(target).__name__
        raise DTypeError(f"cross_entropy: target must hold class indices (int) or class probabilities (float), "
                         f"got {got}")
    if size_average is not None or reduce is not None:  # PyTorch's deprecated pair, translated as it does
        reduction = "none" if reduce is False else ("sum" if size_average is False else "mean")
    if reduction not in ("mean", "sum", "none"):
        raise ArgumentError(f"cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real) \
            or not 0.0 <= label_smoothing <= 1.0:
        raise ArgumentError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    if input.ndim == 0:
        raise ShapeError("cross_entropy: logits must have a class dim, got a 0-d tensor")
    C = input.shape[1] if input.ndim >= 2 else input.shape[0]
    if weight is not None:
        if not isinstance(weight, Tensor) or tuple(weight.shape) != (C,):
            got = weight._desc() if isinstance(weight, Tensor) else type(weight).__name__
            raise ShapeError(f"cross_entropy: weight must be a Tensor of shape ({C},) (one per class), got {got}")
        weight = weight.to(input.dtype)
    if target.dtype.is_floating_point:
        if tuple(target.shape) != tuple(input.shape):
            raise ShapeError(f"cross_entropy: a floating-point target holds class probabilities and must have the "
                             f"logits' shape {tuple(input.shape)}, got {target._desc()}; class indices must be an "
                             f"integer Tensor (.long())")
        return _ce_probs(input, target.to(input.dtype), weight, reduction, float(label_smoothing), C)
    want = tuple(input.shape[:1]) + tuple(input.shape[2:]) if input.ndim >= 2 else ()
    if tuple(target.shape) != want:
        raise ShapeError(f"cross_entropy: logits {tuple(input.shape)} (N, C, d...) need a target of shape "
                         f"{want} (N, d...), got {tuple(target.shape)}")
    logits = input
    if input.ndim > 2:  # (N, C, d...) -> (N, d..., C): the kernels read the class dim last
        logits = contiguous(movedim(input, 1, -1))
    if weight is None:
        return apply("cross_entropy", logits, target, ignore_index=ignore_index, reduction=reduction,
                     label_smoothing=label_smoothing)
    return _ce_weighted(logits, target, weight, ignore_index, reduction, float(label_smoothing), C)


def _ce_weighted(logits, target, weight, ignore_index, reduction, ls, C):
    """Index targets with class weights, class dim last: PyTorch's nll_loss normalisation (the mean divides
    by the summed weights of the counted targets)."""

    valid = ne(target, ignore_index)
    safe = where(valid, target, 0).long()
    if safe.numel() and (bool(lt(safe, 0).any()) or bool(ge(safe, C).any())):
        bad = safe._data[(safe._data < 0) | (safe._data >= C)].reshape(-1)[0]
        raise ShapeError(f"cross_entropy: target index {int(bad)} out of range for {C} classes")
    logp = log_softmax(logits, dim=-1)
    wt = where(valid, weight[safe], 0.0)
    nll = -gather(logp, -1, unsqueeze(safe, -1)).squeeze(-1) * wt
    smooth = None
    if ls:
        smooth = where(valid, -sum(logp * weight, dim=-1), 0.0)
    if reduction == "none":
        return nll if smooth is None else (1 - ls) * nll + smooth * (ls / C)
    tot = sum(nll)
    stot = sum(smooth) if smooth is not None else None
    if reduction == "mean":
        den = sum(wt)
        tot = tot / den
        stot = stot / den if stot is not None else None
    return tot if stot is None else (1 - ls) * tot + stot * (ls / C)


def _ce_probs(input, target, weight, reduction, ls, C):
    """Class-probability targets: -sum_c w_c t_c log_softmax(x)_c per element (classes in dim 1)."""
    if ls:
        target = target * (1 - ls) + ls / C
    cd = 1 if input.ndim >= 2 else 0
    logp = log_softmax(input, dim=cd)
    prod_ = logp * target
    if weight is not None:
        prod_ = prod_ * weight.reshape((C,) + (1,) * (input.ndim - 2) if input.ndim >= 2 else (C,))
    loss = -sum(prod_, dim=cd)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return sum(loss)
    return sum(loss) / builtins_max(loss.numel(), 1) if loss.numel() else sum(loss) / 0.0


def embedding(idx, weight):
    from blutensor._tensor import Tensor

    if not isinstance(idx, Tensor) or idx.dtype.is_floating_point or idx.dtype.name == "bool":
        got = idx._desc() if isinstance(idx, Tensor) else type(idx).__name__
        raise DTypeError(f"embedding: indices must be an integer Tensor, got {got}")
    if weight.ndim != 2:
        raise ShapeError(f"embedding: weight must be 2-D (num_embeddings, embedding_dim), got shape "
                         f"{tuple(weight.shape)}")
    return apply("embedding", idx, weight)


def _draw_offset(numel: int):
    """(seed, start offset) of a draw of ``numel`` numbers from the default generator (the start is a device
    array while the generator draws at a device counter: a captured step's dropout)."""
    gen = _random.default_generator
    return gen.seed, gen.draw((numel + 3) // 4)


def dropout(x, p=0.5, training=True):
    """Inverted dropout; the mask comes from the default Philox generator (seed, offset)."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise ArgumentError(f"dropout: p must be a number in [0, 1], got {type(p).__name__} {p!r}")
    if not 0.0 <= p < 1.0:
        if p == 1.0 and training:
            return x * 0.0
        if not 0.0 <= p <= 1.0:
            raise ArgumentError(f"dropout: p must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return x
    seed, off = _draw_offset(x.numel())
    return apply("dropout", x, p=p, seed=seed, offset=off)


def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """softmax(q k^T / sqrt(E) [+ mask]) v with an optional causal mask, over (..., L, E).

    ``enable_gqa=True`` (grouped-query attention, PyTorch's flag): k and v may have fewer heads (dim -3) than q,
    a divisor of q's; each K/V head serves ``Hq // Hkv`` consecutive query heads. The heads are repeated here
    (a differentiable expand + reshape whose backward sums the group), so every attention kernel sees equal heads --
    except on CUDA, where the flash kernels read each group's K/V head in place (``backends.cupy.sdpa_gqa``).
    """
    if enable_gqa:
        if getattr(q, "device", None) is not None and q.device.type == "cuda" and not dropout_p:
            from blutensor.backends.cupy import sdpa_gqa

            variant = sdpa_gqa.applies(q, k, v, attn_mask, dropout_p)
            if variant is not None:  # shapes and dtypes checked there
                return sdpa_gqa.sdpa_gqa(q, k, v, is_causal, scale, variant)
        k, v = _repeat_kv_heads(q, k, v)
    _check_sdpa(q, k, v, attn_mask, dropout_p, is_causal)
    seed = off = 0
    if dropout_p > 0:
        seed, off = _draw_offset(q.shape[-2] * k.shape[-2] * math.prod(q.shape[:-2]))
    return apply("sdpa", q, k, v, attn_mask, scale=scale, is_causal=is_causal, dropout_p=dropout_p,
                 seed=seed, offset=off)


def _repeat_kv_heads(q, k, v):
    """k, v (..., Hkv, S, E) -> (..., Hq, S, E), K/V head j serving query heads j*G .. j*G + G - 1."""
    from blutensor._tensor import Tensor

    op = "scaled_dot_product_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.ndim < 3:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ShapeError(f"{op}: enable_gqa=True needs (..., heads, seq, head_dim) tensors; {name} is {got}")
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if hk != hv or hq % hk:
        raise ShapeError(f"{op}: enable_gqa=True needs k and v with one number of heads dividing q's; got q "
                         f"{hq}, k {hk}, v {hv} heads (dim -3)")
    if hk == hq:
        return k, v
    g = hq // hk

    def rep(t):
        *lead, h, s, e = t.shape
        return t.unsqueeze(-3).expand(*lead, h, g, s, e).reshape(*lead, h * g, s, e)

    return rep(k), rep(v)


def _check_sdpa(q, k, v, mask, dropout_p, is_causal) -> None:
    """Shapes (..., L, E), (..., S, E), (..., S, Ev) with broadcastable batch dims; mask to (..., L, S)."""
    from blutensor._tensor import Tensor

    op = "scaled_dot_product_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise DTypeError(f"{op}: {name} must be a Tensor, got {type(t).__name__}")
        _floating(t, f"{op}: {name}")
        if t.ndim < 2:
            raise ShapeError(f"{op}: {name} must have at least 2 dims (..., seq, head_dim), got shape "
                             f"{tuple(t.shape)}")
    qs, ks, vs = tuple(q.shape), tuple(k.shape), tuple(v.shape)
    if qs[-1] != ks[-1] or ks[-2] != vs[-2]:
        raise ShapeError(f"{op}: q {qs}, k {ks}, v {vs} do not fit (..., L, E), (..., S, E), (..., S, Ev)")
    import numpy as np

    batch = qs[:-2]
    if batch != ks[:-2] or batch != vs[:-2]:  # the common case (equal batch dims) skips NumPy
        try:
            batch = np.broadcast_shapes(qs[:-2], ks[:-2], vs[:-2])
        except ValueError:
            raise ShapeError(f"{op}: batch dims of q {qs}, k {ks}, v {vs} do not broadcast") from None
    if mask is not None:
        if is_causal:
            raise ArgumentError(f"{op}: pass either attn_mask or is_causal=True, not both")
        ms, want = tuple(mask.shape), batch + (qs[-2], ks[-2])
        try:
            ok = np.broadcast_shapes(ms, want) == want
        except ValueError:
            ok = False
        if not ok:
            raise ShapeError(f"{op}: attn_mask shape {ms} does not broadcast to (..., L, S) = {want}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        raise ArgumentError(f"{op}: dropout_p must be in [0, 1), got {dropout_p}")


# ---- devices ----


class _ToDevice:
    """Backward of a device move: move the gradient back."""

    @staticmethod
    def backward(ctx, g):
        dt, src, dst = ctx.saved
        return (_move(g, dt, dst, src),)


def _move(arr, dt, src, dst):
    import numpy as np

    from blutensor.backends import xp_of

    if src == dst:
        return arr
    host = arr.get() if src.type == "cuda" else arr
    if dst.type == "cpu":
        if dt.name == "bfloat16" and host.dtype == np.uint16:
            host = host.view(dt.np)
        return np.require(host, requirements="C")  # (np.ascontiguousarray makes a 0-d array 1-d)
    cp = xp_of(dst)
    if dt.name == "bfloat16":
        host = np.require(host, requirements="C").view(np.uint16)
    with cp.cuda.Device(dst.index):
        return cp.asarray(host)


def to_device(t, dev):
    """Copy ``t`` to ``dev`` (differentiable)."""
    from blutensor._tensor import Tensor

    out = Tensor._from_data(_move(t._data, t.dtype, t.device, dev), t.dtype, dev)
    if STATE.enabled and t.requires_grad:
        ctx = Ctx()
        ctx.needs = (True,)
        ctx.saved = (t.dtype, t.device, dev)
        out.grad_fn = Node("to_device", _ToDevice, ctx, (t,), [])
        out.requires_grad = True
    return out


import builtins as _b  # noqa: E402

from blutensor.activations import (  # noqa: E402,F401  (compositions of the activation rows)
    celu,
    glu,
    hardtanh,
    relu6,
    selu,
    softsign,
    tanhshrink,
)
from blutensor.indexing import scatter  # noqa: E402,F401
from blutensor.reshaping import (  # noqa: E402,F401  (diagonal and t: from blutensor.reshaping)
    einsum,
    flip,
    movedim,
    repeat,
    repeat_interleave,
    roll,
    unbind,
)
from blutensor.sorting import (  # noqa: E402,F401
    cummax,
    cummin,
    cumprod,
    cumsum,
    multinomial,
    sort,
    topk,
)

builtins_max = _b.max
builtins_sum = _b.sum
builtins_any = _b.any
