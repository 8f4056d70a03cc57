"""The op table: every built-in op, its forward/backward pair and its dispatch flags, in one place.

Each row becomes a kernel class (``PLUGIN_NAME = "blutensor.<op>"``, ``BACKEND = "*"``) that
blutensor registers through its own ``blutrain_register_kernels`` hook, exactly like a plugin.
"""

from __future__ import annotations

from blutensor.ops import activation as ac
from blutensor.ops import conv as cv
from blutensor.ops import decoder_ops as dec
from blutensor.ops import elementwise as ew
from blutensor.ops import gather as ga
from blutensor.ops import linalg as la
from blutensor.ops import nn_ops as nn
from blutensor.ops import rearrange as ra
from blutensor.ops import reduction as rd
from blutensor.ops import scan as sc
from blutensor.ops import shape as sh
from blutensor.ops.surface import Api, api, attach


class Kernel:
    """Base of op kernels. Plugins subclass it (or mimic its attributes)."""

    PLUGIN_NAME = ""
    OP = ""
    BACKEND = "*"  # 'cpu', 'cuda' or '*'
    DTYPES: tuple[str, ...] = ("*",)
    PRIORITY = 0  # among unconfigured candidates the highest wins; ties go to the built-in
    SAVES: tuple[int, ...] = ()  # inputs saved for backward (checked against their version)
    SAVES_OUTPUT = False
    SAME_DTYPE: tuple[int, ...] = ()  # inputs that must share a dtype
    DTYPE_ARG = 0  # input whose dtype selects the kernel (embedding: the weight)
    VIEW = False  # output is a view of input 0 (shares its storage and version counter)
    DIFFERENTIABLE = True
    BF16_NATIVE = False  # False: bfloat16 inputs are widened to float32 around the kernel
    #: backward honours ``ctx.grad_into`` (adds leaf gradients into the offered buffers, see autograd.engine)
    GRAD_INTO = False
    #: backward may add the input's pending gradient (``ctx.grad_pending``) into its result (autograd.engine)
    GRAD_SUM = False
    #: ``MIXED_BF16(inputs, attrs) -> bool`` (None: never): the forward takes this float32/bfloat16 operand mix as
    #: it is (widening inside the kernel), so dispatch and autocast do not promote it with a cast first
    MIXED_BF16 = None

    @staticmethod
    def forward(ctx, *arrays, **attrs):
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError


OPS: dict[str, type] = {}
#: op name -> its public surface (functional, Tensor methods, operators), for the rows that give one
API: dict[str, Api] = {}


def op(name: str, forward, backward=None, *, saves=(), saves_output=False, same_dtype=(), dtype_arg=0,
       view=False, bf16_native=False, dtypes=("*",), grad_into=False, grad_sum=False, api: Api | None = None) -> type:
    """Create and record the built-in kernel class of one op; ``api`` (:func:`blutensor.ops.surface.api`) is the
    public surface generated from the row: its ``blutensor.functional`` function(s) and Tensor method(s)."""
    cls = type(f"{name}_kernel", (Kernel,), {
        "PLUGIN_NAME": f"blutensor.{name}", "OP": name, "DTYPES": tuple(dtypes), "SAVES": tuple(saves),
        "SAVES_OUTPUT": saves_output,
        "SAME_DTYPE": tuple(same_dtype), "DTYPE_ARG": dtype_arg, "VIEW": view,
        "DIFFERENTIABLE": backward is not None, "BF16_NATIVE": bf16_native, "GRAD_INTO": grad_into,
        "GRAD_SUM": grad_sum,
        "forward": staticmethod(forward), "backward": staticmethod(backward) if backward else Kernel.backward,
        "__module__": __name__,
    })
    OPS[name] = cls
    if api is not None:
        API[name] = attach(api, name)
    return cls


ROPE_DOC = """Rotary position embedding of ``x`` (..., T, H, D) with angle tables cos/sin (T, D/2), in the
rotate-half layout of Hugging Face's Llama: the pair (i, i + D/2) of each head is rotated by angle[t, i].
The tables stay float32 whatever the dtype of ``x``; no gradient flows into them. ``transpose=True``
returns the result as a contiguous (..., H, T, D), the layout attention reads (on CUDA one kernel rotates and
transposes, each way: ``rope(x).transpose(-3, -2).contiguous()`` without the copy)."""

BIN = (0, 1)
#: transcendental ops: an integer or bool input has no kernel (NumPy would return float64 / float16 silently)
FLOAT = ("float16", "bfloat16", "float32", "float64")
# name              forward                 backward               flags
op("add",           ew.add_forward,         ew.add_backward,       same_dtype=BIN,
   api=api("a, b:s, alpha?=1", "a + alpha * b elementwise (b a Tensor or a number; broadcasting).", method=True,
           inplace=True, operators=("__add__", "__radd__")))
op("sub",           ew.sub_forward,         ew.sub_backward,       same_dtype=BIN,
   api=api("a, b:s", "a - b elementwise (b a Tensor or a number; broadcasting).", method=True, inplace=True,
           operators=("__sub__",)))
op("mul",           ew.mul_forward,         ew.mul_backward,       same_dtype=BIN, saves=BIN,
   api=api("a, b:s", "a * b elementwise (b a Tensor or a number; broadcasting).", method=True, inplace=True,
           operators=("__mul__", "__rmul__")))
op("div",           ew.div_forward,         ew.div_backward,       same_dtype=BIN, saves=BIN,
   api=api("a, b:s", functional=False, operators=("__truediv__",), reflected=("__rtruediv__",),
           doc="a / b elementwise (true division)."))
op("pow",           ew.pow_forward,         ew.pow_backward,       same_dtype=BIN, saves=BIN, saves_output=True,
   api=api("a, b:s", "a ** b elementwise (b a Tensor or a number).", method=True, inplace=True, operators=("__pow__",),
           reflected=("__rpow__",)))
op("maximum",       ew.maximum_forward,     ew.maximum_backward,   same_dtype=BIN, saves=BIN,
   api=api("a, b:s", "The elementwise maximum of a and b (NaN wins).", method=True))
op("minimum",       ew.minimum_forward,     ew.minimum_backward,   same_dtype=BIN, saves=BIN,
   api=api("a, b:s", "The elementwise minimum of a and b (NaN wins).", method=True))
op("neg",           ew.neg_forward,         ew.neg_backward,
   api=api("a", "-a elementwise.", method=True, inplace=True, operators=("__neg__",)))
op("exp",           ew.exp_forward,         ew.exp_backward,       saves_output=True, dtypes=FLOAT,
   api=api("a", "e ** a elementwise.", method=True, inplace=True))
op("log",           ew.log_forward,         ew.log_backward,       saves=(0,), dtypes=FLOAT,
   api=api("a", "The natural logarithm elementwise.", method=True, inplace=True))
op("tanh",          ew.tanh_forward,        ew.tanh_backward,      saves_output=True, dtypes=FLOAT,
   api=api("a", "The hyperbolic tangent elementwise.", method=True, inplace=True))
op("sqrt",          ew.sqrt_forward,        ew.sqrt_backward,      saves_output=True, dtypes=FLOAT,
   api=api("a", "The square root elementwise.", method=True, inplace=True))
op("rsqrt",         ew.rsqrt_forward,       ew.rsqrt_backward,     saves_output=True, dtypes=FLOAT,
   api=api("a", "1 / sqrt(a) elementwise.", method=True))
op("sin",           ew.sin_forward,         ew.sin_backward,       saves=(0,), dtypes=FLOAT,
   api=api("a", "The sine elementwise (radians).", method=True))
op("cos",           ew.cos_forward,         ew.cos_backward,       saves=(0,), dtypes=FLOAT,
   api=api("a", "The cosine elementwise (radians).", method=True))
op("abs",           ew.abs_forward,         ew.abs_backward,       saves=(0,),
   api=api("a", "|a| elementwise.", method=True, inplace=True))
op("sigmoid",       ew.sigmoid_forward,     ew.sigmoid_backward,   saves_output=True, dtypes=FLOAT,
   api=api("a", "1 / (1 + exp(-a)) elementwise.", method=True, inplace=True, floating=True))
op("relu",          ew.relu_forward,        ew.relu_backward,
   api=api("a", "max(a, 0) elementwise.", method=True, inplace=True))
op("clamp",         ew.clamp_forward,       ew.clamp_backward,     saves=(0,))
op("cast",          ew.cast_forward,        ew.cast_backward,        bf16_native=True)
op("eq",            ew.eq_forward,          same_dtype=BIN,
   api=api("a, b:s", "a == b elementwise (a bool Tensor).", method=True, operators=("__eq__",)))
op("ne",            ew.ne_forward,          same_dtype=BIN,
   api=api("a, b:s", "a != b elementwise (a bool Tensor).", method=True, operators=("__ne__",)))
op("lt",            ew.lt_forward,          same_dtype=BIN,
   api=api("a, b:s", "a < b elementwise (a bool Tensor).", method=True, operators=("__lt__",)))
op("le",            ew.le_forward,          same_dtype=BIN,
   api=api("a, b:s", "a <= b elementwise (a bool Tensor).", method=True, operators=("__le__",)))
op("gt",            ew.gt_forward,          same_dtype=BIN,
   api=api("a, b:s", "a > b elementwise (a bool Tensor).", method=True, operators=("__gt__",)))
op("ge",            ew.ge_forward,          same_dtype=BIN,
   api=api("a, b:s", "a >= b elementwise (a bool Tensor).", method=True, operators=("__ge__",)))
op("logical_not",   ew.logical_not_forward,
   api=api("a", "Logical not elementwise: True where ``a`` is zero (a bool Tensor).", method=True,
           operators=("__invert__",)))
op("where",         ew.where_forward,       ew.where_backward,     same_dtype=(1, 2), dtype_arg=1, saves=(0,))
op("masked_fill",   ew.masked_fill_forward, ew.masked_fill_backward, saves=(1,))
op("sum",           rd.sum_forward,         rd.sum_backward)
op("mean",          rd.mean_forward,        rd.mean_backward,
   api=api("a, dim=None, keepdim=False", "The mean of the elements (along ``dim``, an int or a tuple).", method=True,
           floating=True))
op("amax",          rd.amax_forward,        rd.amax_backward,      saves=(0,), saves_output=True,
   api=api("a, dim=None, keepdim=False", "The largest element (along ``dim``; the gradient is split among ties).",
           method=True))
op("amin",          rd.amin_forward,        rd.amin_backward,      saves=(0,), saves_output=True,
   api=api("a, dim=None, keepdim=False", "The smallest element (along ``dim``; the gradient is split among ties).",
           method=True))
op("max_dim",       rd.max_dim_forward,     rd.max_dim_backward)
op("min_dim",       rd.min_dim_forward,     rd.min_dim_backward)
op("argmax",        rd.argmax_forward,
   api=api("a, dim=None, keepdim=False",
           "The index of the largest element (of the flattened tensor, or along ``dim``).", method=True))
op("argmin",        rd.argmin_forward,
   api=api("a, dim=None, keepdim=False",
           "The index of the smallest element (of the flattened tensor, or along ``dim``).", method=True))
op("var",           rd.var_forward,         rd.var_backward)
op("view",          sh.view_forward,        sh.view_backward,      view=True, bf16_native=True)
op("reshape",       sh.reshape_forward,     sh.reshape_backward, bf16_native=True)
op("permute",       sh.permute_forward,     sh.permute_backward,   view=True, bf16_native=True)
op("transpose",     sh.transpose_forward,   sh.transpose_backward, view=True, bf16_native=True,
   api=api("a, dim0:a, dim1:a", "A view with dims ``dim0`` and ``dim1`` swapped.", method=True))
op("expand",        sh.expand_forward,      sh.expand_backward,    view=True)
op("squeeze",       sh.squeeze_forward,     sh.squeeze_backward,   view=True, bf16_native=True,
   api=api("a, dim=None", "A view without the size-1 dims (or only ``dim``, an int or a tuple).", method=True))
op("unsqueeze",     sh.unsqueeze_forward,   sh.unsqueeze_backward, view=True, bf16_native=True,
   api=api("a, dim:a", "A view with a size-1 dim inserted at ``dim``.", method=True))
op("contiguous",    sh.contiguous_forward,  sh.contiguous_backward, bf16_native=True)
op("clone",         sh.clone_forward,       sh.clone_backward, bf16_native=True,
   api=api("a", "A copy with its own storage (differentiable).", method=True))
op("getitem",       sh.getitem_forward,     sh.getitem_backward,   view=True, bf16_native=True)
op("index",         sh.index_forward,       sh.index_backward)
op("setitem",       sh.setitem_forward,     sh.setitem_backward,   same_dtype=BIN)
op("cat",           sh.cat_forward,         sh.cat_backward, bf16_native=True)
op("stack",         sh.stack_forward,       sh.stack_backward, bf16_native=True)
op("tril",          sh.tril_forward,        sh.tril_backward)
op("triu",          sh.triu_forward,        sh.triu_backward)
op("matmul",        la.matmul_forward,      la.matmul_backward,    same_dtype=BIN, saves=BIN,
   api=api("a, b", "The matrix product with NumPy/PyTorch broadcasting of the batch dims.", method=True))
op("bmm",           la.bmm_forward,         la.bmm_backward,       same_dtype=BIN, saves=BIN,
   api=api("a, b", "The batched matrix product of (B, n, m) and (B, m, p).", method=True))
op("linear",        la.linear_forward,      la.linear_backward,    same_dtype=(0, 1, 2), saves=(0, 1),
   grad_into=True,
   api=api("x, weight, bias:t?=None", "x @ weight^T + bias."))
op("softmax",       nn.softmax_forward,     nn.softmax_backward,   saves_output=True)
op("log_softmax",   nn.log_softmax_forward, nn.log_softmax_backward, saves_output=True)
op("layer_norm",    nn.layer_norm_forward,  nn.layer_norm_backward, same_dtype=(0, 1, 2), saves=(1,),
   grad_into=True, grad_sum=True)
op("gelu",          nn.gelu_forward,        nn.gelu_backward,      saves=(0,))
op("cross_entropy", nn.cross_entropy_forward, nn.cross_entropy_backward, saves=(0,))
op("embedding",     nn.embedding_forward,   nn.embedding_backward, dtype_arg=1, grad_into=True)
op("dropout",       nn.dropout_forward,     nn.dropout_backward)
op("sdpa",          nn.sdpa_forward,        nn.sdpa_backward,      same_dtype=(0, 1, 2), saves=(0, 1, 2))
# rounding division, modulo, closeness
op("div_rounded",   ew.div_rounded_forward, ew.div_rounded_backward, same_dtype=BIN)
op("floor_divide",  ew.floor_divide_forward, ew.floor_divide_backward, same_dtype=BIN,
   api=api("a, b:s", "a / b rounded down (PyTorch's floor_divide and ``//``).", method=True, inplace=True,
           operators=("__floordiv__",), reflected=("__rfloordiv__",)))
op("remainder",     ew.remainder_forward,   ew.remainder_backward, same_dtype=BIN,
   api=api("a, b:s", "Python's modulo (sign of the divisor): PyTorch's remainder and ``%``.", method=True, inplace=True,
           operators=("__mod__",), reflected=("__rmod__",)))
op("fmod",          ew.fmod_forward,        ew.fmod_backward,      same_dtype=BIN,
   api=api("a, b:s", "C's fmod (sign of the dividend).", method=True))
op("isclose",       ew.isclose_forward,     same_dtype=BIN,
   api=api("a, b:s, rtol=1e-05, atol=1e-08, equal_nan=False",
           "|a - b| <= atol + rtol * |b| elementwise (bool Tensor); inf equals inf of the same sign.", method=True))
# activations
op("silu",          ac.silu_forward,        ac.silu_backward,      saves=(0,), dtypes=FLOAT,
   api=api("input, inplace:inplace=False", "x * sigmoid(x).", floating=True))
op("softplus",      ac.softplus_forward,    ac.softplus_backward,  saves=(0,), dtypes=FLOAT,
   api=api("input, beta:f=1.0, threshold:f=20.0", "log(1 + exp(beta x)) / beta; linear where beta x > threshold.",
           floating=True))
op("hardtanh",      ac.hardtanh_forward,    ac.hardtanh_backward,  saves=(0,), dtypes=FLOAT)
op("elu",           ac.elu_forward,         ac.elu_backward,       saves=(0,), dtypes=FLOAT,
   api=api("input, alpha:f=1.0, inplace:inplace=False", "x where x > 0, else alpha (exp(x) - 1).", floating=True))
op("leaky_relu",    ac.leaky_relu_forward,  ac.leaky_relu_backward, saves=(0,), dtypes=FLOAT,
   api=api("input, negative_slope:f=0.01, inplace:inplace=False", "x where x >= 0, else negative_slope x.",
           floating=True))
op("hardsigmoid",   ac.hardsigmoid_forward, ac.hardsigmoid_backward, saves=(0,), dtypes=FLOAT,
   api=api("input, inplace:inplace=False", "relu6(x + 3) / 6.", floating=True))
op("hardswish",     ac.hardswish_forward,   ac.hardswish_backward, saves=(0,), dtypes=FLOAT,
   api=api("input, inplace:inplace=False", "x relu6(x + 3) / 6.", floating=True))
op("mish",          ac.mish_forward,        ac.mish_backward,      saves=(0,), dtypes=FLOAT,
   api=api("input, inplace:inplace=False", "x * tanh(softplus(x)).", floating=True))
op("logsigmoid",    ac.logsigmoid_forward,  ac.logsigmoid_backward, saves=(0,), dtypes=FLOAT,
   api=api("input", "log(sigmoid(x)), without overflow.", floating=True))
# reductions and scans
op("prod",          rd.prod_forward,        rd.prod_backward,      saves=(0,))
op("logsumexp",     rd.logsumexp_forward,   rd.logsumexp_backward, saves=(0,), dtypes=FLOAT,
   api=api("a, dim:a, keepdim=False", "log(sum(exp(a))) along ``dim`` without overflow.", method=True, floating=True))
op("all",           rd.all_forward,
   api=api("a, dim=None, keepdim=False",
           "Whether every element (along ``dim``) is nonzero: a bool Tensor, as in PyTorch (``bool(t.all())``).",
           method=True))
op("any",           rd.any_forward,
   api=api("a, dim=None, keepdim=False", "Whether some element (along ``dim``) is nonzero: a bool Tensor.",
           method=True))
op("cumsum",        sc.cumsum_forward,      sc.cumsum_backward)
op("cumprod",       sc.cumprod_forward,     sc.cumprod_backward,   saves=(0,))
op("logcumsumexp",  sc.logcumsumexp_forward, sc.logcumsumexp_backward, saves=(0,), dtypes=FLOAT,
   api=api("a:T, dim:i", "log(cumsum(exp(a))) along ``dim`` without overflow.", method=True))
op("cumext_indices", sc.cumext_indices_forward)
op("argsort",       sc.argsort_forward,
   api=api("a:T, dim:i=-1, descending:b=False, stable:b=False",
           "Indices (int64) that sort ``a`` along ``dim``; NaN counts as the largest value.", method=True))
op("topk_indices",  sc.topk_indices_forward)
# index ops along a dim
op("gather",        ga.gather_forward,      ga.gather_backward,
   api=api("input, dim:i, index:idx",
           "out[i][j][k] = input[i][index[i][j][k]][k] for dim 1 (and likewise for the other dims).", method=True))
op("take_along_dim", ga.take_along_dim_forward, ga.take_along_dim_backward,
   api=api("input, indices:idx, dim:i=None",
           "Values at ``indices`` along ``dim`` (broadcasting the other dims), or of the flattened input.",
           method=True))
op("scatter",       ga.scatter_forward,     ga.scatter_backward,   same_dtype=(0, 2))
op("scatter_add",   ga.scatter_add_forward, ga.scatter_add_backward, same_dtype=(0, 2),
   api=api("input, dim:i, index:idx, src:T",
           "A copy of ``input`` with ``src`` added at ``index`` along ``dim`` (repeated indices accumulate).",
           method=True, inplace=True))
op("index_select",  ga.index_select_forward, ga.index_select_backward,
   api=api("input, dim:i, index:idx", "The entries of ``input`` at ``index`` along ``dim``.", method=True))
op("index_add",     ga.index_add_forward,   ga.index_add_backward, same_dtype=(0, 2),
   api=api("input, dim:i, index:idx, source:T, *, alpha=1",
           "A copy of ``input`` with ``alpha * source`` added at rows ``index`` of ``dim``.", method=True,
           inplace=True))
# rearrangements
op("flip",          ra.flip_forward,        ra.flip_backward,      bf16_native=True)
op("roll",          ra.roll_forward,        ra.roll_backward,      bf16_native=True)
op("diagonal",      ra.diagonal_forward,    ra.diagonal_backward,  bf16_native=True)
op("repeat",        ra.repeat_forward,      ra.repeat_backward)
op("repeat_interleave", ra.repeat_interleave_forward, ra.repeat_interleave_backward)
op("pad",           ra.pad_forward,         ra.pad_backward)
# convolution, pooling, einsum
op("conv2d",        cv.conv2d_forward,      cv.conv2d_backward,    same_dtype=BIN, saves=BIN)
op("max_pool2d",    cv.max_pool2d_values_forward, cv.max_pool2d_backward)
op("max_pool2d_indices", cv.max_pool2d_indices_forward)
op("avg_pool2d",    cv.avg_pool2d_forward,  cv.avg_pool2d_backward)
op("einsum",        cv.einsum_forward,      cv.einsum_backward)
op("rms_norm",      dec.rms_norm_forward,   dec.rms_norm_backward, same_dtype=(0, 1), saves=(1,), dtypes=FLOAT,
   grad_into=True)
op("rope",          dec.rope_forward,       dec.rope_backward,     same_dtype=(1, 2), dtypes=FLOAT,
   api=api("x, cos, sin, transpose?=False", ROPE_DOC, floating=True))
op("swiglu",        dec.swiglu_forward,     dec.swiglu_backward,   same_dtype=(0, 1), saves=(0, 1), dtypes=FLOAT,
   api=api("gate, up",
           "silu(gate) * up in one op (Llama's gated MLP): saves the two inputs, not the intermediate product.",
           floating=True))


def builtin_kernels() -> list[type]:
    return list(OPS.values())
