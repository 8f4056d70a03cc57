"""``blutensor.ext``: the supported surface for packages that extend blutensor (compilers, profilers, parallel
strategies, GEMM libraries, model code with fused kernels).

User code needs only ``import blutensor as bt`` and its documented modules (``nn``, ``optim``, ``utils``,
``cuda``, ``amp``, ``random``, ``autograd``). What a sibling package needs beyond that is here, so that
blutensor's private modules (``blutensor._*``, ``ops.*``, ``backends.cupy.*``, ``plugin.manager``, ``gemm``) can
change without breaking it; ``tests/test_packaging.py`` forbids other packages to import them. Each name is
the object blutensor itself uses (not a copy), imported on first access.

Array modules (tracers, foreign array types)
    ``array_module(a)`` the array module (NumPy, CuPy, a registered provider's) that owns raw array ``a``;
    ``register_array_provider(array_type, provider)`` / ``unregister_array_provider(array_type)`` make every
    op kernel see ``provider.module(a)`` as the array module of ``array_type`` instances and route its
    contractions, scatter-adds and error functions to ``provider.gemm`` / ``.scatter_add`` / ``.erf``
    (``ArrayProvider``); ``gemm``, ``scatter_add``, ``erf`` the raw-array helpers the kernels call;
    ``bf16_bits_to_f32`` / ``f32_to_bf16_bits`` bfloat16 storage conversions; ``as_device``;
    ``array_module_for(device)`` NumPy or CuPy for a device; ``is_cuda_array(a)``.
Ops and kernels
    ``Kernel`` base of kernel classes (``OP``, ``BACKEND``, ``DTYPES``, ``PRIORITY``, flags) registered through
    ``blutrain_register_kernels``; ``op_rule(op)`` the built-in kernel class of one op (its reference
    ``forward``/``backward``), ``op_names()``; ``override_op_rule(op, forward=, backward=)`` a context in which
    the built-in rule of ``op`` runs other formulas (tracers that must avoid a host read);
    ``apply(op, *inputs, **attrs)`` run an op through the dispatcher; ``resolve_kernel(op, backend, dtype)``
    the kernel the dispatcher picks (priority, then ``BLUTRAIN_KERNELS`` / ``use_kernel``); ``kernel_for``
    (cached); ``use_kernel``; ``clear_kernel_cache``; ``define_op(name, forward, backward, api=op_api(...),
    **flags)`` adds an op (its row, kernel, ``blutensor.functional`` function and Tensor methods; see the README's
    "Adding an op"), ``remove_op(name)`` removes one so added, ``op_api(sig, doc, method=, inplace=, ...)`` the
    public surface of a row; ``linear_backward``; ``attention_block_forward`` /
    ``attention_block_backward`` (blockwise attention with its log-sum-exp, for context parallelism).
Observers
    ``recording_leaf_adds(offers=True)`` / ``recording_kernel_launches()``: contexts that record the engine's
    separate gradient adds into leaves and blutensor's CUDA kernel launches by name (launch-count checks);
    ``add_op_observer(fn, first=False)`` wraps every op call with ``fn(op, inputs, attrs, run)``;
    ``add_backward_observer(fn)`` wraps every backward formula with ``fn(node, grad, run)``;
    ``remove_op_observer(fn)`` / ``remove_backward_observer(fn)``; ``op_observers()`` /
    ``backward_observers()`` the installed ones (copies); ``autocast_active()`` whether an autocast input
    policy is in force; ``autocast_lower(*tensors)`` the tensors as a lowered op (``linear``) receives them in the
    active region (bf16 casts from the weight-cast cache; for a Function that runs GEMMs on its inputs itself).
Autograd pieces
    ``Function``, ``FunctionCtx`` (custom differentiable functions), ``Node``, ``Ctx``, ``AccumulateGrad``
    (graph nodes a compiler or profiler walks), ``run_backward``.
Optimizer steps
    ``adamw_update`` (the reference AdamW update of one parameter), ``fused_adamw_step`` (one group through
    the multi-tensor CUDA kernel), ``prepare_adamw_group`` (its device tables, built outside a capture),
    ``multi_tensor_adamw``, ``global_grad_norm``, ``grad_norm_table`` (the device table ``global_grad_norm``
    reads), ``cast_tables()`` (the multi-tensor bf16 cast tables built so far), ``lr_warmup_cosine``.
CUDA launch and compile helpers
    ``kernel_source(file)``, ``kernel_module(file)``, ``kernel_function(file, name)``, ``launch(...)``,
    ``compile_options(cc)``, ``num_sms()``, ``capturing()`` (whether the stream is being captured),
    ``index_flag_array()`` / ``raise_pending_index_error()`` (asynchronous index validation),
    ``layer_norm_forward`` / ``layer_norm_backward``, ``add_layer_norm_forward`` / ``add_layer_norm_backward``
    (the residual add fused with LayerNorm, a storage per tensor), ``gelu_forward`` / ``gelu_backward``,
    ``cuda_cross_entropy_forward``, ``flash_attention_forward`` / ``flash_attention_backward``,
    ``multi_tensor_adamw``, ``sdpa_qkv`` (attention on a packed qkv tensor), ``pick_attention_variant``;
    ``gelu_mlp_forward`` / ``gelu_mlp_backward`` (``c_proj(gelu_tanh(c_fc(x)))`` on raw arrays with the GELU in the
    GEMM epilogues where the provider fuses it, and its gradients, ``.grad`` buffers honoured) and
    ``gelu_gemm_provider(x)`` (the provider that fuses them for raw array ``x``, or None);
    bfloat16 pieces: ``cast_to_bf16`` / ``cast_to_f32`` (CuPy float32 <-> bf16 bits), ``add_widen(x, y)`` (float32
    ``x`` + widened bf16 ``y`` in one kernel), ``bf16_gemm_provider()``
    (the provider that runs bf16 GEMMs), ``bf16_gemm(prov, a, b, trans_a=, trans_b=)``,
    ``bf16_bias_grad(prov, g)`` (column sums of bf16 ``g`` as a GEMV, float32 out).
Execution policy
    ``current_policy()`` the active ``ExecutionPolicy`` (``blutensor.policy``: precision, fp32 GEMM algorithm,
    attention and embedding variants, GEMM provider, determinism, index validation); a kernel or provider that
    chooses among variants reads the field it needs from it at call time (the ``precision=`` argument blutensor
    passes to ``matmul`` is already resolved from it), so a ``bt.policy.scope(...)`` region reaches plugins too.
GEMM providers
    ``get_gemm_provider()`` the selected provider class (``matmul``, ``CAPTURE_SAFE``, ``PRECISIONS``),
    ``gemm_providers()`` every registered one, ``capture_safe_gemm_providers()``, ``XpGemm`` (the built-in
    CuPy provider), ``FP32_GEMMS``, ``provider_matmul``, ``max_3xtf32_k``; ``fused_epilogues(prov)`` (what its
    ``EPILOGUES`` declares: 'gelu', 'dgelu'), ``provider_linear_gelu`` (linear + GELU in one GEMM, the pre-activation
    saved), ``provider_matmul_dgelu`` (the GEMM times gelu' of a saved pre-activation, its column sums as a bias
    gradient).
Plugins and device memory
    ``kernel_cache`` the integrity-checked on-disk cache of compiled kernels (``safe_directory``, ``store``,
    ``verified``, ``check_stored``: SHA-256 records, private directories); ``tma`` the TMA tensor-map encoder of
    the sm_90a kernels (``tensor_spec``, ``spec_problem``, ``encode``, ``encode_args``, ``clear_cache``,
    ``TmaError``; cached 128-byte ``CUtensorMap`` kernel arguments from ``cuTensorMapEncodeTiled``);
    ``get_host()`` / ``reset_host()`` the plugin host (registries by kind: backend, kernel, gemm, allocator,
    parallel, compiler, profiler_sink, model_family), ``hookimpl``, ``BlutrainSpecs``, ``PluginError``,
    ``PluginHost``; ``allocator_plugins()`` the registered device allocators (``install()`` plugs one into
    CuPy); ``cpu_kernels_status()`` whether the compiled CPU kernels are in use, ``reference_kernels()`` a
    context that runs the NumPy reference kernels instead.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

#: name -> (module, attribute): the objects blutensor itself uses, imported on first access
_NAMES: dict[str, tuple[str, str]] = {
    # array modules
    "array_module": ("blutensor.backends", "array_module"),
    "gemm": ("blutensor.ops.linalg", "gemm"),
    "scatter_add": ("blutensor.ops._util", "scatter_add"),
    "erf": ("blutensor.ops.elementwise", "erf"),
    "bf16_bits_to_f32": ("blutensor.backends", "bf16_bits_to_f32"),
    "f32_to_bf16_bits": ("blutensor.backends", "f32_to_bf16_bits"),
    "as_device": ("blutensor.device", "as_device"),
    "array_module_for": ("blutensor.backends", "xp_of"),
    "is_cuda_array": ("blutensor.backends", "is_cuda_array"),
    # ops and kernels
    "Kernel": ("blutensor.ops.table", "Kernel"),
    "apply": ("blutensor.ops.dispatch", "apply"),
    "resolve_kernel": ("blutensor.ops.dispatch", "resolve"),
    "kernel_for": ("blutensor.ops.dispatch", "kernel_for"),
    "use_kernel": ("blutensor.ops.dispatch", "use_kernel"),
    "clear_kernel_cache": ("blutensor.ops.dispatch", "clear_cache"),
    "define_op": ("blutensor.ops.define", "define_op"),
    "remove_op": ("blutensor.ops.define", "remove_op"),
    "op_api": ("blutensor.ops.surface", "api"),
    "linear_backward": ("blutensor.ops.linalg", "linear_backward"),
    "attention_block_forward": ("blutensor.ops.attention", "attention_block_forward"),
    "attention_block_backward": ("blutensor.ops.attention", "attention_block_backward"),
    # observers
    "remove_op_observer": ("blutensor.ops.dispatch", "remove_observer"),
    "add_backward_observer": ("blutensor.autograd.engine", "add_backward_observer"),
    "remove_backward_observer": ("blutensor.autograd.engine", "remove_backward_observer"),
    # autograd pieces
    "Function": ("blutensor.autograd.function", "Function"),
    "FunctionCtx": ("blutensor.autograd.function", "FunctionCtx"),
    "Node": ("blutensor.autograd.node", "Node"),
    "Ctx": ("blutensor.autograd.node", "Ctx"),
    "AccumulateGrad": ("blutensor.autograd.node", "AccumulateGrad"),
    "run_backward": ("blutensor.autograd.engine", "run_backward"),
    # optimizer steps
    "adamw_update": ("blutensor.optim.adamw", "adamw_update"),
    "fused_adamw_step": ("blutensor.backends.cupy.adamw", "fused_step"),
    "prepare_adamw_group": ("blutensor.backends.cupy.adamw", "prepare_group"),
    "multi_tensor_adamw": ("blutensor.backends.cupy.adamw", "multi_tensor_adamw"),
    "global_grad_norm": ("blutensor.backends.cupy.norm", "global_grad_norm"),
    "grad_norm_table": ("blutensor.backends.cupy.norm", "_table"),
    "lr_warmup_cosine": ("blutensor.optim.lr_scheduler", "warmup_cosine"),
    # execution policy
    "current_policy": ("blutensor.policy", "current"),
    "ExecutionPolicy": ("blutensor.policy", "ExecutionPolicy"),
    # CUDA launch and compile helpers
    "kernel_source": ("blutensor.backends.cupy._loader", "source"),
    "kernel_module": ("blutensor.backends.cupy._loader", "module"),
    "kernel_function": ("blutensor.backends.cupy._loader", "function"),
    "launch": ("blutensor.backends.cupy._loader", "launch"),
    "compile_options": ("blutensor.backends.cupy._loader", "compile_options"),
    "num_sms": ("blutensor.backends.cupy._loader", "num_sms"),
    "capturing": ("blutensor.backends.cupy._loader", "capturing"),
    "index_flag_array": ("blutensor.backends.cupy.index_check", "flag_array"),
    "raise_pending_index_error": ("blutensor.backends.cupy.index_check", "raise_pending"),
    "layer_norm_forward": ("blutensor.backends.cupy.layer_norm", "layer_norm_forward"),
    "layer_norm_backward": ("blutensor.backends.cupy.layer_norm", "layer_norm_backward"),
    "add_layer_norm_forward": ("blutensor.backends.cupy.layer_norm", "add_layer_norm_forward"),
    "add_layer_norm_backward": ("blutensor.backends.cupy.layer_norm", "add_layer_norm_backward"),
    "gelu_forward": ("blutensor.backends.cupy.gelu", "gelu_forward"),
    "gelu_backward": ("blutensor.backends.cupy.gelu", "gelu_backward"),
    "cuda_cross_entropy_forward": ("blutensor.backends.cupy.cross_entropy", "cross_entropy_forward"),
    "flash_attention_forward": ("blutensor.backends.cupy.sdpa", "flash_attention_forward"),
    "flash_attention_backward": ("blutensor.backends.cupy.sdpa", "flash_attention_backward"),
    "sdpa_qkv": ("blutensor.backends.cupy.sdpa", "sdpa_qkv"),
    "pick_attention_variant": ("blutensor.backends.cupy.sdpa", "pick_variant"),
    "gelu_mlp_forward": ("blutensor.ops.gelu_mlp", "gelu_mlp_forward"),
    "gelu_mlp_backward": ("blutensor.ops.gelu_mlp", "gelu_mlp_backward"),
    "gelu_gemm_provider": ("blutensor.ops.gelu_mlp", "fusing_provider"),
    "cast_to_bf16": ("blutensor.backends.cupy.cast", "to_bf16"),
    "cast_to_f32": ("blutensor.backends.cupy.cast", "to_f32"),
    "add_widen": ("blutensor.backends.cupy.cast", "add_widen"),
    "bf16_gemm_provider": ("blutensor.backends.cupy.linalg", "bf16_provider"),
    "bf16_gemm": ("blutensor.backends.cupy.linalg", "mm"),
    "bf16_bias_grad": ("blutensor.backends.cupy.linalg", "bias_grad"),
    # GEMM providers
    "get_gemm_provider": ("blutensor.gemm", "get_gemm_provider"),
    "XpGemm": ("blutensor.gemm", "XpGemm"),
    "FP32_GEMMS": ("blutensor.gemm", "FP32_GEMMS"),
    "provider_matmul": ("blutensor.gemm", "provider_matmul"),
    "max_3xtf32_k": ("blutensor.gemm", "max_3xtf32_k"),
    "fused_epilogues": ("blutensor.gemm", "fused_epilogues"),
    "provider_linear_gelu": ("blutensor.gemm", "provider_linear_gelu"),
    "provider_matmul_dgelu": ("blutensor.gemm", "provider_matmul_dgelu"),
    # plugins and device memory
    "get_host": ("blutensor.plugin.manager", "get_host"),
    "kernel_cache": ("blutensor", "kernel_cache"),
    "tma": ("blutensor.backends.cupy.tma", ""),
    "reset_host": ("blutensor.plugin.manager", "reset_host"),
    "PluginHost": ("blutensor.plugin.manager", "PluginHost"),
    "hookimpl": ("blutensor.plugin.specs", "hookimpl"),
    "BlutrainSpecs": ("blutensor.plugin.specs", "BlutrainSpecs"),
    "PluginError": ("blutensor.plugin.registry", "PluginError"),
    "cpu_kernels_status": ("blutensor.backends.numpy", "status"),
    "reference_kernels": ("blutensor.backends.numpy", "reference_kernels"),
}


class ArrayProvider(Protocol):
    """What :func:`register_array_provider` expects: the array module of its array type plus the three raw-array
    helpers whose NumPy and CuPy forms differ (so a tracer records them instead of computing them)."""

    def module(self, a: Any) -> Any:
        """The array module (NumPy-like namespace) op kernels use for array ``a``."""

    def gemm(self, a: Any, b: Any) -> Any:
        """``a @ b`` where one operand is of the provider's array type."""

    def scatter_add(self, out: Any, index: Any, values: Any) -> None:
        """``out[index] += values``, repeated indices accumulating."""

    def erf(self, x: Any) -> Any:
        """The error function of ``x``."""


def register_array_provider(array_type: type, provider: ArrayProvider) -> None:
    """From now on, raw arrays of ``array_type`` (and its subclasses) inside op kernels use ``provider``'s array
    module, ``gemm``, ``scatter_add`` and ``erf``; the newest registration for a type wins. A tracer registers
    its traced-array type for the length of one trace. NumPy and CuPy arrays are never affected."""
    from blutensor.backends import array_providers

    if not isinstance(array_type, type):
        raise TypeError(f"register_array_provider: array_type must be a class, got {array_type!r}")
    missing = [m for m in ("module", "gemm", "scatter_add", "erf") if not callable(getattr(provider, m, None))]
    if missing:
        raise TypeError(f"register_array_provider: provider {provider!r} lacks {', '.join(missing)}")
    array_providers.append((array_type, provider))


def unregister_array_provider(array_type: type, provider: ArrayProvider | None = None) -> None:
    """Remove the newest registration of ``array_type`` (of ``provider`` when given); no error when none."""
    from blutensor.backends import array_providers

    for i in range(len(array_providers) - 1, -1, -1):
        typ, prov = array_providers[i]
        if typ is array_type and (provider is None or prov is provider):
            del array_providers[i]
            return


def op_names() -> list[str]:
    """The names of every built-in op (the rows of blutensor's op table), sorted."""
    from blutensor.ops.table import OPS

    return sorted(OPS)


def op_rule(op: str, missing_ok: bool = False) -> type | None:
    """The built-in kernel class of ``op``: its reference ``forward(ctx, *arrays, **attrs)`` and
    ``backward(ctx, grad)`` formulas and dispatch flags (``SAVES``, ``DTYPE_ARG``, ...). An unknown op raises
    KeyError, or gives None with ``missing_ok=True``."""
    from blutensor.ops.table import OPS

    k = OPS.get(op)
    if k is None and not missing_ok:
        raise KeyError(f"blutensor has no op {op!r} (see blutensor.ext.op_names())")
    return k


@contextmanager
def override_op_rule(op: str, forward: Callable | None = None, backward: Callable | None = None) -> Iterator[type]:
    """Within the block, the built-in rule of ``op`` runs ``forward`` / ``backward`` (None: keep that formula);
    restored on exit, exceptions included. The flags stay those of the op. Yields the kernel class."""
    from blutensor.ops import dispatch

    cls = op_rule(op)
    assert cls is not None
    saved = {k: cls.__dict__[k] for k in ("forward", "backward") if k in cls.__dict__}
    try:
        if forward is not None:
            cls.forward = staticmethod(forward)
        if backward is not None:
            cls.backward = staticmethod(backward)
        dispatch.clear_cache()
        yield cls
    finally:
        for k in ("forward", "backward"):
            if k in saved:
                setattr(cls, k, saved[k])
            elif k in cls.__dict__:
                delattr(cls, k)
        dispatch.clear_cache()


@contextmanager
def recording_leaf_adds(offers: bool = True) -> Iterator[list]:
    """A context recording the autograd engine's separate gradient adds into leaves: the yielded list gets the
    shape of each leaf whose ``.grad`` received a gradient through the engine's add (not in a kernel that
    accumulated into the buffer itself). ``offers=False`` also stops the engine offering gradient buffers to
    the kernels, so every gradient takes the separate add (the reference a test compares with)."""
    from blutensor.autograd import engine

    adds: list = []
    real_acc, real_targets = engine._accumulate, engine._targets

    def acc(t, g, T_):
        if g is not None:
            adds.append(tuple(t.shape))
        return real_acc(t, g, T_)

    engine._accumulate = acc
    if not offers:
        engine._targets = lambda node, fan_in: None
    try:
        yield adds
    finally:
        engine._accumulate, engine._targets = real_acc, real_targets


@contextmanager
def recording_kernel_launches() -> Iterator[Counter]:
    """A context counting blutensor's own CUDA kernel launches by entry-point name (``Counter``): how many
    launches a step makes (per-parameter launches show as counts that grow with the model)."""
    import pkgutil

    import blutensor.backends.cupy as co

    names: Counter = Counter()
    saved = []
    for m in pkgutil.iter_modules(co.__path__):
        mod = importlib.import_module(f"blutensor.backends.cupy.{m.name}")
        real = getattr(mod, "launch", None)
        if callable(real):
            def rec(f, name, *a, _r=real, **k):
                names.update([name])
                return _r(f, name, *a, **k)

            saved.append((mod, real))
            mod.launch = rec
    try:
        yield names
    finally:
        for mod, real in saved:
            mod.launch = real


def add_op_observer(fn: Callable, first: bool = False) -> None:
    """Wrap every subsequent op call with ``fn(op, inputs, attrs, run)``; ``fn`` returns ``run()``'s result
    (possibly after changing nothing but what it records). ``first=True`` puts it outermost (it sees the call
    before every other observer: a parallel strategy that rewrites inputs), else innermost of those installed."""
    from blutensor.ops import dispatch

    if first:
        dispatch.observers.insert(0, fn)
    else:
        dispatch.add_observer(fn)


def op_observers() -> tuple:
    """The op observers installed now, outermost first (a copy)."""
    from blutensor.ops import dispatch

    return tuple(dispatch.observers)


def backward_observers() -> tuple:
    """The backward observers installed now (a copy)."""
    from blutensor.autograd import engine

    return tuple(engine.backward_observers)


def autocast_active() -> bool:
    """Whether an autocast region's input policy is in force (ops may see their inputs cast)."""
    from blutensor.ops import dispatch

    return dispatch.autocast_hook is not None


def autocast_lower(*tensors: Any) -> tuple:
    """The tensors as an op that autocast lowers (``linear``, ``matmul``) receives them in the active region: float32
    tensors of an autocasting device type as their bf16 casts (parameters through the region's weight-cast cache, so
    precast copies are reused; the cast is the differentiable ``cast`` op, which carries the gradient to the float32
    master and offers its ``.grad`` buffer through), others and ``None`` unchanged; outside a region, the tensors
    themselves. For an autograd Function that runs GEMMs on its inputs' arrays itself (GPT-2's fused MLP)."""
    from blutensor.ops import dispatch

    hook = dispatch.autocast_hook
    if hook is None:
        return tensors
    return tuple(hook("linear", tensors, {})[0])


def cast_tables() -> list:
    """The device tables of the multi-tensor bf16 weight cast built so far (hold them while captured graphs that
    launch the cast replay)."""
    from blutensor.backends.cupy import cast

    return list(cast._multi.values())


def gemm_providers() -> list[type]:
    """Every registered GEMM provider class, in registration order."""
    from blutensor.plugin.manager import get_host

    return [r.cls for r in get_host().registry("gemm")]


def capture_safe_gemm_providers() -> list[type]:
    """The registered GEMM providers that declare ``CAPTURE_SAFE = True`` (may run inside a CUDA graph)."""
    return [p for p in gemm_providers() if getattr(p, "CAPTURE_SAFE", False)]


def allocator_plugins() -> dict[str, type]:
    """The registered device allocator plugins by name."""
    from blutensor.plugin.manager import get_host

    return {r.name: r.cls for r in get_host().registry("allocator")}


_DEFINED = ["ArrayProvider", "add_op_observer", "allocator_plugins", "autocast_active", "autocast_lower",
            "backward_observers",
            "capture_safe_gemm_providers", "cast_tables", "gemm_providers", "op_names", "op_observers", "op_rule",
            "override_op_rule", "recording_kernel_launches", "recording_leaf_adds", "register_array_provider",
            "unregister_array_provider"]
__all__ = sorted(_DEFINED + list(_NAMES))


def __getattr__(name: str) -> Any:
    try:
        mod, attr = _NAMES[name]
    except KeyError:
        raise AttributeError(f"module 'blutensor.ext' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(mod), attr) if attr else importlib.import_module(mod)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
