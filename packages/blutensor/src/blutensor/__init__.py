"""blutensor: a typed tensor with reverse-mode autograd on NumPy (cpu) and CuPy (cuda).

``import blutensor as bt``; names follow PyTorch where the concept is the same.
"""

from blutensor import (  # noqa: E402,F401
    backends,  # array backends (NumPy, CuPy) and their kernels (backends.get(name)); PyTorch's flags
    # bt.backends.cuda.matmul.allow_tf32 (the execution policy's precision)
    cuda,  # noqa: F401
    ext,  # the supported surface for packages that extend blutensor (compilers, profilers, strategies)
    kernel_cache,  # noqa: F401  (integrity checks of on-disk compiled-kernel caches)
    nn,
    optim,
    policy,  # the execution policy: bt.policy.current(), bt.policy.scope(...), bt.ExecutionPolicy
    utils,  # noqa: F401
)
from blutensor.__about__ import __version__
from blutensor._tensor import Size, Tensor
from blutensor.amp import autocast, get_autocast_dtype, is_autocast_enabled
from blutensor.autograd import enable_grad, grad, is_grad_enabled, no_grad, set_grad_enabled
from blutensor.autograd.grad_mode import inference_mode, is_inference_mode_enabled
from blutensor.compile import compile, compiler_backends  # noqa: A004 - PyTorch's name
from blutensor.convolution import avg_pool1d, conv1d, conv2d, max_pool1d, max_pool2d  # torch.conv2d, ...
from blutensor.creation import (
    arange,
    empty,
    empty_like,
    eye,
    from_numpy,
    full,
    full_like,
    linspace,
    meshgrid,
    ones,
    ones_like,
    rand,
    rand_like,
    randint,
    randn,
    randn_like,
    tensor,
    tril_indices,
    triu_indices,
    zeros,
    zeros_like,
)
from blutensor.determinism import are_deterministic_algorithms_enabled, use_deterministic_algorithms
from blutensor.device import device
from blutensor.dtypes import (
    bfloat16,
    bool_,
    dtype,
    float16,
    float32,
    float64,
    get_default_dtype,
    int32,
    int64,
    promote_types,
    result_type,
    set_default_dtype,
    uint16,
)
from blutensor.errors import ArgumentError, AutogradError, BluTensorError, DeviceError, DTypeError, ShapeError
from blutensor.functional import (  # noqa: E402  (ops beyond GPT-2's path, PyTorch's names)
    abs,
    add,
    all,
    allclose,
    amax,
    amin,
    any,
    argmax,
    argmin,
    argsort,
    bmm,
    cat,
    celu,
    chunk,
    clamp,
    clone,
    cos,
    cummax,
    cummin,
    cumprod,
    cumsum,
    div,
    divide,
    einsum,
    eq,
    exp,
    flatten,
    flip,
    floor_divide,
    fmod,
    gather,
    ge,
    gt,
    index_add,
    index_select,
    isclose,
    layer_norm,
    le,
    log,
    log_softmax,
    logcumsumexp,
    logical_not,
    logsumexp,
    lt,
    masked_fill,
    matmul,
    max,
    maximum,
    mean,
    min,
    minimum,
    movedim,
    mul,
    multinomial,
    ne,
    neg,
    norm,
    permute,
    pow,
    prod,
    relu,
    remainder,
    repeat_interleave,
    reshape,
    rms_norm,
    roll,
    rsqrt,
    scatter,
    scatter_add,
    selu,
    sigmoid,
    sin,
    softmax,
    sort,
    split,
    sqrt,
    square,
    squeeze,
    stack,
    std,
    sub,
    sum,
    take_along_dim,
    tanh,
    topk,
    transpose,
    tril,
    triu,
    true_divide,
    unbind,
    unsqueeze,
    var,
    where,
)
from blutensor.gemm import (
    get_float32_matmul_precision,
    get_fp32_gemm,
    get_matmul_precision,
    set_float32_matmul_precision,
    set_fp32_gemm,
    set_gemm_provider,
    set_matmul_precision,
)
from blutensor.policy import ExecutionPolicy  # noqa: E402
from blutensor.random import Generator, get_rng_state, initial_seed, manual_seed, randperm, set_rng_state
from blutensor.reshaping import diagonal, t  # noqa: E402
from blutensor.serialization import load, save
from blutensor.threads import get_num_threads, set_num_threads

bool = bool_  # noqa: A001 - PyTorch's name for the dtype
long = int64
float = float32  # noqa: A001
double = float64

__all__ = [
    "__version__", "ArgumentError", "AutogradError", "BluTensorError", "DTypeError", "DeviceError", "Generator",
    "ShapeError", "Tensor",
    "abs", "add", "amax", "amp", "autocast", "compile", "compiler_backends", "get_autocast_dtype",
    "is_autocast_enabled",
    "amin", "arange", "argmax", "argmin", "autograd", "backends", "bfloat16",
    "bmm", "bool", "bool_", "cat", "chunk", "clamp", "cos", "creation", "cuda", "device", "div",
    "double", "dtype", "dtypes", "empty", "empty_like", "enable_grad", "errors", "exp", "flatten",
    "float", "float16", "float32", "float64", "from_numpy", "full", "full_like", "functional", "gemm",
    "get_default_dtype", "get_matmul_precision", "get_rng_state", "grad", "int32", "int64",
    "is_grad_enabled", "linspace", "log", "log_softmax", "long", "manual_seed", "matmul", "max",
    "maximum", "mean", "min", "minimum", "mul", "neg", "nn", "no_grad", "norm", "ones", "ones_like",
    "ops", "optim", "permute", "pow", "rand", "rand_like", "randint", "randn", "randn_like", "random",
    "relu", "reshape", "rsqrt", "set_default_dtype", "set_fp32_gemm", "get_fp32_gemm", "set_gemm_provider",
    "set_grad_enabled",
    "set_matmul_precision", "set_rng_state", "sigmoid", "sin", "softmax", "split", "sqrt", "squeeze",
    "stack", "std", "sub", "sum", "tanh", "tensor", "transpose", "tril", "triu", "uint16", "unsqueeze",
    "are_deterministic_algorithms_enabled", "use_deterministic_algorithms",
    "var", "where", "zeros", "zeros_like",
    "get_float32_matmul_precision", "inference_mode", "initial_seed", "is_inference_mode_enabled", "load",
    "randperm", "save", "set_float32_matmul_precision", "utils",
    "Size", "all", "allclose", "any", "argsort", "cummax", "cummin", "cumprod", "cumsum", "diagonal", "divide",
    "einsum", "eye", "flip", "floor_divide", "fmod", "gather", "index_add", "index_select", "isclose",
    "logcumsumexp", "logsumexp", "meshgrid", "movedim", "multinomial", "prod", "promote_types", "remainder",
    "repeat_interleave", "result_type", "roll", "scatter", "scatter_add", "sort", "t", "take_along_dim", "topk",
    "tril_indices", "triu_indices", "true_divide", "unbind",
    "get_num_threads", "set_num_threads",
    "ext",
    "ExecutionPolicy", "policy", "backends",
    "avg_pool1d", "celu", "clone", "conv1d", "conv2d", "eq", "ge", "gt", "layer_norm", "le", "logical_not", "lt",
    "masked_fill", "max_pool1d", "max_pool2d", "ne", "rms_norm", "selu", "square",
]
