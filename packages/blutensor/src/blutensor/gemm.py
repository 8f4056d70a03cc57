"""GEMM provider selection for CUDA matmuls.

Providers register through ``blutrain_register_gemm_providers``; the execution policy's ``gemm`` field
(:mod:`blutensor.policy`: ``BLUTRAIN_GEMM``, :func:`set_gemm_provider`, ``bt.policy.scope(gemm=...)``) chooses one;
'auto' is the default order: cublas, blublas, xp (CuPy's matmul). Each
provider's ``matmul(a, b)`` works on 2-D or 3-D (same batch) raw arrays. A provider that declares ``ACCUMULATE``
takes ``out=C, beta=1.0`` and adds into ``C``: weight gradients are then accumulated by the GEMM itself
(:func:`cuda_matmul_into`).

A provider's ``EPILOGUES`` lists what its ``matmul`` fuses into the GEMM besides the bias: 'gelu' (tanh GELU, the
pre-activation written to ``save_preact=``) and 'dgelu' (the backward through it: the product times gelu'(``preact=``),
the column sums written to ``bias_grad=``; None returned where it has no fused form for that problem).
:func:`provider_linear_gelu` and :func:`provider_matmul_dgelu` call them (GPT-2's MLP, :mod:`blutensor.ops.gelu_mlp`).

Precision 'fp32' (the default: the policy's ``precision``, :func:`set_matmul_precision`) means fp32-accurate
GEMMs. HOW they are computed is the policy's ``fp32_gemm`` (:func:`set_fp32_gemm` / ``BLUTRAIN_FP32_GEMM``):
'strict' (default: FP32 FFMA, SGEMM) or '3xtf32': fp32 emulated on the TF32 tensor cores, each operand split as
hi + lo (both TF32) and hi*hi + hi*lo + lo*hi accumulated in fp32; its error is of the order of SGEMM's (NOT
TF32's, ~1000x larger) at about twice SGEMM's speed. Providers that declare it in ``PRECISIONS`` (blublas, cublas)
run it; others run strict. GEMMs whose reduction is longer than :func:`max_3xtf32_k` (the policy's
``max_3xtf32_k``, ``BLUTRAIN_3XTF32_MAX_K``, default 4096) run strict even then: the tensor cores truncate their
fp32 sums, and over the 16K tokens of a weight gradient that bias made 3xtf32's error many times SGEMM's (a small
multiple at K <= 3072), enough to double the loss drift in training (measured: see
benchmarks/results/e2e_gpt2_fp32_h200_3xtf32_all_gemms.json and e2e_gpt2_fp32_h200_3xtf32_k4096.json).
"""

from __future__ import annotations

import numpy as np

from blutensor import policy as _policy

FP32_GEMMS = _policy.FP32_GEMMS
PRECISIONS = _policy.PRECISIONS
_resolved: dict = {}  # (provider name, plugin host, registrations) -> provider class


class XpGemm:
    """Built-in provider: ``cupy.matmul`` (cuBLAS through CuPy; not capture-safe)."""

    PLUGIN_NAME = "xp"
    #: capability: may its calls be recorded into a CUDA graph (stream capture)? CuPy's cuBLAS refuses capture
    CAPTURE_SAFE = False
    #: capability: the precisions ``matmul`` honours (CuPy's matmul runs float32 as strict SGEMM whatever is asked)
    PRECISIONS = ("fp32",)
    #: capability: the epilogues ``matmul`` fuses (none: it takes no bias or GELU at all)
    EPILOGUES = ("none",)

    @classmethod
    def is_available(cls) -> bool:
        return True

    @staticmethod
    def matmul(a, b, *, precision: str = "fp32", **_):
        import cupy

        return cupy.matmul(a, b)


def resolve_gemm_provider(name: str = "auto") -> type:
    """The provider class ``name`` names ('auto': the first available of the documented order); PluginError when
    it is not registered or not available here. Cached per name and plugin host."""
    from blutensor.plugin import get_host

    host = get_host()
    reg = host.registry("gemm")
    key = (name, id(host), len(reg))
    prov = _resolved.get(key)
    if prov is None:
        prov = reg.select(None if name == "auto" else name)
        if len(_resolved) >= 16:  # stale hosts or registrations (tests): start over
            _resolved.clear()
        _resolved[key] = prov
    return prov


def set_gemm_provider(name: str | None) -> None:
    """Choose the CUDA GEMM provider by plugin name (None: back to ``BLUTRAIN_GEMM``, else the documented default).
    Writes the execution policy's ``gemm`` (the active scope's, else the process default); an unknown or
    unavailable provider is refused here."""
    if name is None:
        _policy.update(gemm=_policy.env_defaults().gemm)
        return
    resolve_gemm_provider(name)
    _policy.update(gemm=name)


def get_gemm_provider():
    """The provider class the current execution policy's ``gemm`` names."""
    return resolve_gemm_provider(_policy.current().gemm)


def set_matmul_precision(mode: str) -> None:
    """'fp32' (strict), 'tf32' (matrix units for fp32) or 'bf16' for CUDA GEMMs (the policy's ``precision``)."""
    if mode not in PRECISIONS:
        raise ValueError(f"matmul precision must be one of {PRECISIONS}, got {mode!r}")
    _policy.update(precision=mode)


def get_matmul_precision() -> str:
    """The current execution policy's ``precision``."""
    return _policy.current().precision


def set_fp32_gemm(mode: str | None) -> None:
    """How 'fp32' GEMMs run: 'strict' (FP32 FFMA) or '3xtf32' (split-TF32 on the tensor cores, not TF32:
    a small multiple of SGEMM's error at about twice its speed; near-fp32, see blublas' README). None: back to
    BLUTRAIN_FP32_GEMM (default 'strict'). Writes the execution policy's ``fp32_gemm``."""
    if mode is not None and mode not in FP32_GEMMS:
        raise ValueError(f"fp32 GEMM algorithm must be one of {FP32_GEMMS}, got {mode!r}")
    _policy.update(fp32_gemm=_policy.env_defaults().fp32_gemm if mode is None else mode)


def get_fp32_gemm() -> str:
    """'strict' or '3xtf32': the current execution policy's ``fp32_gemm`` (see :func:`set_fp32_gemm`)."""
    return _policy.current().fp32_gemm


def max_3xtf32_k() -> int:
    """The longest reduction a '3xtf32' fp32 GEMM keeps (longer run strict): the policy's ``max_3xtf32_k``
    (``BLUTRAIN_3XTF32_MAX_K``, default 4096)."""
    return _policy.current().max_3xtf32_k


def _default_precision(prov) -> str:
    """The provider precision of float32 GEMMs under the current execution policy."""
    pol = _policy.current()
    if pol.precision in ("tf32", "bf16"):
        return "tf32"
    if pol.fp32_gemm == "3xtf32" and "3xtf32" in getattr(prov, "PRECISIONS", ()):
        return "3xtf32"
    return "fp32"


def cuda_matmul(a, b):
    """Broadcasting matmul of CuPy arrays through the selected provider (cupy.matmul where the
    provider does not apply: dtypes other than float32, 1-D operands)."""
    import cupy

    prov = get_gemm_provider()
    if prov is XpGemm or a.dtype != np.float32 or b.dtype != np.float32 or a.ndim < 2 or b.ndim < 2:
        return cupy.matmul(a, b)
    return provider_matmul(prov, a, b, cupy)


def provider_matmul(prov, a, b, xp, precision: str | None = None):
    """``a @ b`` (float32, >= 2-D, broadcasting batch dims) as 2-D or 3-D provider calls whose operands
    have a contiguous last axis (transposed views are passed back transposed with trans_a/trans_b).
    'bf16' precision on float32 operands runs as 'tf32' (bf16 GEMMs take bf16 storage); 'fp32' as the
    :func:`get_fp32_gemm` algorithm."""
    prec = precision or _default_precision(prov)
    if a.ndim > 3 or b.ndim > 3 or (a.ndim == 3 and b.ndim == 3 and a.shape[0] != b.shape[0]):
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        a3 = xp.broadcast_to(a, batch + a.shape[-2:]).reshape(-1, *a.shape[-2:])
        b3 = xp.broadcast_to(b, batch + b.shape[-2:]).reshape(-1, *b.shape[-2:])
        return _call(prov, a3, b3, prec, xp).reshape(*batch, a.shape[-2], b.shape[-1])
    if a.ndim == 3 and b.ndim == 2:
        a2 = a.reshape(-1, a.shape[-1])
        return _call(prov, a2, b, prec, xp).reshape(a.shape[0], a.shape[1], b.shape[-1])
    if a.ndim == 2 and b.ndim == 3:
        a = xp.broadcast_to(a, (b.shape[0],) + a.shape)  # batch stride 0: one matrix shared by the batch
    return _call(prov, a, b, prec, xp)


def _operand(x, xp):
    """(array with a contiguous last axis, whether it is the transpose of ``x``)."""
    isz = x.itemsize
    if x.shape[-1] <= 1 or x.strides[-1] == isz:
        return x, False
    if x.shape[-2] <= 1 or x.strides[-2] == isz:
        return x.swapaxes(-1, -2), True
    return xp.ascontiguousarray(x), False


def _gemm_precision(prec: str, k: int) -> str:
    """``prec`` for a GEMM reducing over ``k``: '3xtf32' beyond :func:`max_3xtf32_k` runs strict 'fp32'."""
    return "fp32" if prec == "3xtf32" and k > max_3xtf32_k() else prec  # see the module docstring


def _call(prov, a, b, prec, xp, bias=None, out=None, **epilogue):
    """One provider GEMM; with ``out``: ``out += a @ b`` (beta = 1, the GEMM's own epilogue reads ``out``);
    ``epilogue``: the fused-epilogue keywords of ``matmul`` (``epilogue=``, ``save_preact=``, ...)."""
    a, ta = _operand(a, xp)
    b, tb = _operand(b, xp)
    prec = _gemm_precision(prec, a.shape[-2] if ta else a.shape[-1])
    kw = dict(epilogue)
    if out is not None:
        kw.update(out=out, beta=1.0)
    if bias is not None:
        kw["bias"] = bias
    return prov.matmul(a, b, trans_a=ta, trans_b=tb, precision=prec, **kw)


def accumulates(prov) -> bool:
    """Whether provider ``prov`` declares ``ACCUMULATE``: its ``matmul(..., out=C, beta=1.0)`` adds into ``C``
    (a provider without it may ignore ``out``; its products are then added separately)."""
    return bool(getattr(prov, "ACCUMULATE", False))


def provider_matmul_into(prov, a, b, out, xp, precision: str | None = None):
    """``out += a @ b`` for 2-D operands as ONE provider GEMM with beta = 1 (``out`` float32, C-contiguous,
    (M, N)): a weight gradient accumulated into its existing buffer with no product array and no separate add.
    bf16 operands (uint16 bits) run at precision 'bf16' with the float32 ``out``."""
    if a.ndim != 2 or b.ndim != 2 or out.shape != (a.shape[0], b.shape[1]):
        raise ValueError(f"provider_matmul_into: expected a (M, K), b (K, N), out (M, N), got {tuple(a.shape)}, "
                         f"{tuple(b.shape)}, {tuple(out.shape)}")
    if a.dtype == np.uint16:
        prec = "bf16"
    else:
        prec = precision or _default_precision(prov)
    return _call(prov, a, b, prec, xp, out=out)


def cuda_matmul_into(a, b, out) -> None:
    """``out += a @ b`` of 2-D CuPy arrays: one beta = 1 GEMM through the selected provider where it applies
    (float32 operands, or bf16 on the cublas/blublas provider), else the product plus an in-place add."""
    import cupy

    prov = get_gemm_provider()
    if a.dtype == np.uint16 and b.dtype == np.uint16:
        from blutensor.backends.cupy.linalg import bf16_provider

        prov = bf16_provider()
    elif a.dtype != np.float32 or b.dtype != np.float32:
        prov = None
    if (prov is None or not accumulates(prov) or out.dtype != np.float32 or not out.flags.c_contiguous
            or a.ndim != 2 or b.ndim != 2):
        out += cupy.matmul(a, b) if a.dtype != np.uint16 else _bf16_product(a, b)
        return
    provider_matmul_into(prov, a, b, out, cupy)


def _bf16_product(a, b):
    """a @ b of bf16 bits in float32 (the no-provider fallback)."""
    import cupy

    from blutensor.backends import bf16_bits_to_f32

    return cupy.matmul(bf16_bits_to_f32(a, cupy), bf16_bits_to_f32(b, cupy))


def _fp32_provider(*arrays):
    """The selected provider when it may take these CUDA arrays (float32, not the xp fallback), else None."""
    prov = get_gemm_provider()
    if prov is XpGemm or any(x is not None and x.dtype != np.float32 for x in arrays):
        return None
    return prov


def provider_linear(prov, x2, w, b, xp, precision: str | None = None):
    """``x2 @ w.T + b`` (x2 (M, in), w (out, in), b (out,) or None) as ONE provider GEMM: NT layout, no
    transpose copy, the bias fused into the GEMM epilogue (no second pass over the output)."""
    prec = precision or _default_precision(prov)
    bias = None if b is None else xp.ascontiguousarray(b)
    return _call(prov, x2, w.T, prec, xp, bias=bias)


def fused_epilogues(prov) -> tuple[str, ...]:
    """The epilogues provider ``prov`` declares in ``EPILOGUES`` ('none', 'gelu', 'dgelu'; none declared: ())."""
    return tuple(getattr(prov, "EPILOGUES", ()))


def provider_linear_gelu(prov, x2, w, b, xp, precision: str | None = None):
    """``(h, u)`` with ``u = x2 @ w.T + b`` and ``h = gelu_tanh(u)`` as ONE provider GEMM (NT layout, the bias and
    the GELU in its epilogue, ``u`` written alongside as backward's saved pre-activation): no separate GELU pass over
    the output. bf16 operands (uint16 bits) run at 'bf16' with bf16 ``h`` and ``u``. None when the provider returns
    nothing (a provider without the 'gelu' epilogue for this problem); the caller then runs linear and gelu."""
    prec = "bf16" if x2.dtype == np.uint16 else (precision or _default_precision(prov))
    u = xp.empty((x2.shape[0], w.shape[0]), dtype=x2.dtype)
    bias = None if b is None else xp.ascontiguousarray(b)
    h = _call(prov, x2, w.T, prec, xp, bias=bias, epilogue="gelu", save_preact=u)
    return None if h is None else (h, u)


def provider_matmul_dgelu(prov, g2, w, u, xp, bias_grad=None, precision: str | None = None):
    """``du = (g2 @ w) * gelu_tanh'(u)`` as ONE provider GEMM with the 'dgelu' epilogue (the input gradient of
    ``gelu`` followed by a linear of weight ``w``, from the pre-activation ``u`` the forward saved): no separate
    GELU-backward pass. With ``bias_grad`` (float32 (N,), C-contiguous) the same GEMM writes du's column sums into
    it (overwritten, not added: the bias gradient of the linear that produced ``u``). bf16 operands run at 'bf16'.
    None, with nothing written, where the provider has no fused form for the problem, and for '3xtf32' (fp32 split
    on the tensor cores is two GEMMs, the second accumulating, which an output-rewriting epilogue cannot end)."""
    if g2.dtype == np.uint16:
        prec = "bf16"
    else:
        prec = _gemm_precision(precision or _default_precision(prov), g2.shape[-1])
    if prec == "3xtf32":
        return None
    kw = {} if bias_grad is None else {"bias_grad": bias_grad}
    return _call(prov, g2, w, prec, xp, epilogue="dgelu", preact=u, **kw)


_ones: dict = {}


def provider_bias_grad(prov, g2, xp, out=None):
    """Column sums of g2 (M, N) -> (N,) as a strict-fp32 GEMV ``ones(1, M) @ g2`` through the provider:
    one coalesced read of g2 on the GEMM engine (CuPy's axis-0 sum runs one thread per column). With ``out``
    (float32 (N,), C-contiguous): ``out +=`` the sums, beta = 1 in the same GEMV."""
    m = g2.shape[0]
    dev = getattr(getattr(g2, "device", None), "id", None)
    key = (m, dev, xp.__name__)
    ones = _ones.get(key)
    if ones is None:
        ones = _ones[key] = xp.ones((1, m), dtype=np.float32)
    if out is not None:
        _call(prov, ones, g2, "fp32", xp, out=out.reshape(1, -1))
        return out
    return _call(prov, ones, g2, "fp32", xp).reshape(-1)


def cuda_linear(x2, w, b):
    """``x2 @ w.T + b`` of CuPy arrays: one provider GEMM with the bias in its epilogue (float32), else
    cupy.matmul plus a separate bias add."""
    import cupy

    prov = _fp32_provider(x2, w, b)
    if prov is None or x2.ndim != 2 or w.ndim != 2 or (b is not None and b.ndim != 1):
        y = cupy.matmul(x2, w.T)
        if b is not None:
            y += b
        return y
    return provider_linear(prov, x2, w, b, cupy)


def cuda_bias_grad(g2, out=None):
    """Bias gradient (column sums of a 2-D CuPy array) through the provider's GEMV when it applies; with
    ``out`` (float32 (N,)) the sums are added into it (beta = 1) and ``out`` is returned."""
    import cupy

    prov = _fp32_provider(g2)
    if out is not None and prov is not None and not accumulates(prov):
        prov = None
    if prov is None or g2.ndim != 2 or g2.shape[0] == 0 or (out is not None and not out.flags.c_contiguous):
        s = g2.sum(axis=0)
        if out is None:
            return s
        out += s
        return out
    return provider_bias_grad(prov, g2, cupy, out=out)


_TORCH_PRECISION = {"highest": "fp32", "high": "tf32", "medium": "bf16"}


def set_float32_matmul_precision(precision: str) -> None:
    """PyTorch's name for :func:`set_matmul_precision`: ``"highest"`` -> strict fp32, ``"high"`` -> TF32
    matrix units, ``"medium"`` -> bf16 (CUDA GEMMs of float32 tensors; CPU matmuls are always fp32)."""
    if precision not in _TORCH_PRECISION:
        raise ValueError(f"set_float32_matmul_precision: precision must be 'highest', 'high' or 'medium', got "
                         f"{precision!r}")
    set_matmul_precision(_TORCH_PRECISION[precision])


def get_float32_matmul_precision() -> str:
    """``"highest"``, ``"high"`` or ``"medium"``: the current :func:`get_matmul_precision` in PyTorch's words."""
    return {v: k for k, v in _TORCH_PRECISION.items()}[get_matmul_precision()]
