"""Execution policy: every run-wide setting that chooses HOW ops compute, in one immutable object.

:class:`ExecutionPolicy` holds the CUDA GEMM precision, the fp32 GEMM algorithm, the attention and embedding
kernel variants, the GEMM provider, deterministic algorithms and index validation. Kernels and providers read the
field they need from :func:`current` (plugins through ``blutensor.ext.current_policy``), never from environment
variables or module globals, so one object says what a run does and a region of code can run under another::

    import blutensor as bt

    bt.policy.current()                          # the active policy
    with bt.policy.scope(fp32_gemm="3xtf32"):     # changed fields for a region (this thread / context only)
        ...
    p = bt.ExecutionPolicy(precision="tf32", deterministic=True)
    with p.use():                                # a whole policy for a region
        ...
    bt.policy.set_default(p)                     # process-wide (what code outside any scope sees)

Defaults come from the environment variables of :data:`ENV` (``BLUTRAIN_FP32_GEMM``, ``BLUTRAIN_SDPA_KERNEL``,
``BLUTRAIN_COMPILER``, ...; the table with every variable is ``docs/environment.md``), read ONCE, at the first use of
the policy: changing ``os.environ`` later changes nothing (:func:`reset_defaults` reads them again, for tests). A bad
value is a ValueError naming the variable and the values it accepts. ``BLUTRAIN_KERNELS`` (the dispatcher's op ->
kernel plugin overrides, :func:`env_kernels`) is read once too, at the first op, and again after :func:`reset_defaults`.
The allowed values of the string fields are :data:`CHOICES` (:data:`PRECISIONS`, :data:`FP32_GEMMS`): the one list
that ``bt.set_matmul_precision`` and blumodels' config check against.

Scopes nest and restore on exit (a :class:`contextvars.ContextVar`: each thread, and each asyncio task, has its
own stack; a new thread starts at the process default). The older setters (``bt.set_matmul_precision``,
``bt.set_fp32_gemm``, ``bt.set_gemm_provider``, ``bt.use_deterministic_algorithms``, ...) stay: each writes one
field of the innermost layer -- the active scope's policy when one is active (undone when the scope exits), else the
process default -- so code written against them behaves as before.
"""

from __future__ import annotations

import os
import threading
from contextvars import ContextVar
from dataclasses import dataclass, fields, replace
from typing import Any

#: allowed values per string field (the first is the default)
CHOICES: dict[str, tuple[str, ...]] = {
    "precision": ("fp32", "tf32", "bf16"),
    "fp32_gemm": ("strict", "3xtf32"),
    "attention": ("auto", "wgmma", "mma"),
    "attention_fp32": ("tf32x3", "simt"),
    "attention_backward": ("auto", "fused", "split"),
    "attention_tf32": ("auto", "mma", "wgmma"),
    "attention_schedule": ("free", "pingpong"),
    "embedding_backward": ("segments", "runs", "pieces"),
    "embedding_sort": ("auto", "radix"),
    "validate_indices": ("lazy", "sync", "off"),
}

#: field -> the environment variable its default comes from
ENV: dict[str, str] = {
    "fp32_gemm": "BLUTRAIN_FP32_GEMM",
    "max_3xtf32_k": "BLUTRAIN_3XTF32_MAX_K",
    "attention": "BLUTRAIN_SDPA_KERNEL",
    "attention_fp32": "BLUTRAIN_SDPA_FP32",
    "attention_backward": "BLUTRAIN_SDPA_BWD",
    "attention_tf32": "BLUTRAIN_SDPA_TF32",
    "attention_schedule": "BLUTRAIN_SDPA_SCHEDULE",
    "embedding_backward": "BLUTRAIN_EMBEDDING_BWD",
    "embedding_sort": "BLUTRAIN_EMBEDDING_SORT",
    "gemm": "BLUTRAIN_GEMM",
    "deterministic": "BLUTRAIN_DETERMINISTIC",
    "validate_indices": "BLUTRAIN_VALIDATE_INDICES",
    "compiler": "BLUTRAIN_COMPILER",
}
#: the variable of the kernel override table (op -> kernel plugin; :func:`env_kernels`), read with :data:`ENV`
KERNELS_ENV = "BLUTRAIN_KERNELS"

#: the values of ``precision`` (what ``bt.set_matmul_precision`` and blumodels' ``train.precision`` accept)
PRECISIONS: tuple[str, ...] = CHOICES["precision"]
#: the values of ``fp32_gemm`` (``bt.set_fp32_gemm``, blumodels' ``train.fp32_gemm``)
FP32_GEMMS: tuple[str, ...] = CHOICES["fp32_gemm"]

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
#: spellings of BLUTRAIN_VALIDATE_INDICES -> validate_indices
_INDEX_MODES = {"0": "off", "false": "off", "off": "off", "no": "off", "": "off", "sync": "sync", "eager": "sync",
                "lazy": "lazy", "1": "lazy", "true": "lazy", "yes": "lazy", "on": "lazy"}


@dataclass(frozen=True)
class ExecutionPolicy:
    """How ops compute (immutable; :meth:`replace` makes a changed copy). Fields:

    - ``precision``: CUDA GEMMs of float32 tensors: 'fp32' (fp32-accurate), 'tf32' (TF32 matrix units) or 'bf16'
      (as 'tf32' for float32 operands; blumodels' Trainer also runs forward + loss under bf16 autocast);
      ``bt.set_matmul_precision`` / ``bt.set_float32_matmul_precision`` write it.
    - ``fp32_gemm``: how 'fp32' GEMMs run: 'strict' (FP32 FFMA, SGEMM) or '3xtf32' (split-TF32 on the tensor
      cores, for providers declaring it in ``PRECISIONS``); ``max_3xtf32_k``: the longest reduction a '3xtf32' GEMM
      keeps (longer ones run strict).
    - ``attention``: the bf16 flash-attention kernels: 'auto' (Hopper wgmma on sm_90, mma.sync elsewhere), 'wgmma'
      (require them: an error off sm_90) or 'mma'; ``attention_fp32``: fp32 attention under precision 'fp32':
      'tf32x3' (matrix units, fp32-accurate) or 'simt'; ``attention_backward``: 'auto' (the fused kernel where it
      is faster), 'fused' or 'split' (the deterministic two-kernel backward); ``attention_tf32``: fp32 attention
      under precision 'tf32' / 'bf16': 'auto' (the Hopper wgmma tf32 kernels on sm_90, mma.sync elsewhere),
      'mma' (the mma.sync tf32 kernels) or 'wgmma' (require the Hopper ones: an error off sm_90);
      ``attention_schedule``: how the Hopper bf16 forward's two consumer warpgroups issue their products:
      'pingpong' (the default: in turns, so that one's softmax runs under the other's products) or 'free' (each as
      soon as its tiles arrive; the same results, bit for bit).
    - ``embedding_backward``: 'segments', 'runs' or 'pieces' (all bitwise deterministic); ``embedding_sort``:
      'auto' (Thrust eagerly, the radix argsort inside CUDA graphs) or 'radix' (the radix argsort always).
    - ``gemm``: the CUDA GEMM provider: 'auto' (blutensor's documented order: cublas, blublas, xp) or a registered
      provider's ``PLUGIN_NAME`` (resolved, and refused when unknown or unavailable, where it is used: the plugin
      registry may change after the policy is made).
    - ``compiler``: the compiler plugin of ``bt.compile`` when its ``backend`` is not given: 'auto' (the host's
      default, blucompiler, or the first available) or a registered compiler plugin's ``PLUGIN_NAME`` (resolved
      where used, like ``gemm``).
    - ``deterministic``: require bitwise-repeatable kernels (``bt.use_deterministic_algorithms``).
    - ``validate_indices``: CUDA index checks: 'lazy' (a device flag read at log time), 'sync' (raise at the call)
      or 'off'.
    """

    precision: str = "fp32"
    fp32_gemm: str = "strict"
    attention: str = "auto"
    gemm: str = "auto"
    deterministic: bool = False
    validate_indices: str = "lazy"
    attention_fp32: str = "tf32x3"
    attention_backward: str = "auto"
    embedding_backward: str = "segments"
    embedding_sort: str = "auto"
    max_3xtf32_k: int = 4096
    compiler: str = "auto"
    attention_tf32: str = "auto"
    attention_schedule: str = "pingpong"

    def __post_init__(self) -> None:
        for name, allowed in CHOICES.items():
            v = getattr(self, name)
            if v not in allowed:
                raise ValueError(f"ExecutionPolicy.{name} must be one of {allowed}, got {v!r}")
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"ExecutionPolicy.deterministic must be True or False, got {self.deterministic!r}")
        if not isinstance(self.gemm, str) or not self.gemm:
            raise ValueError(f"ExecutionPolicy.gemm must be 'auto' or a registered GEMM provider's name, got "
                             f"{self.gemm!r}")
        if not isinstance(self.compiler, str) or not self.compiler:
            raise ValueError(f"ExecutionPolicy.compiler must be 'auto' or a registered compiler plugin's name, got "
                             f"{self.compiler!r}")
        k = self.max_3xtf32_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"ExecutionPolicy.max_3xtf32_k must be an integer >= 0, got {k!r}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ExecutionPolicy:
        """The policy the environment variables of :data:`ENV` ask for (unset ones: the field defaults).
        A bad value is a ValueError naming the variable and its allowed values."""
        env = os.environ if environ is None else environ
        kw: dict[str, Any] = {}
        for name, var in ENV.items():
            raw = env.get(var)
            if raw is None:
                continue
            v = raw.strip()
            if name == "deterministic":
                if v.lower() not in _TRUE + _FALSE:
                    raise ValueError(f"{var} must be 0 or 1, got {raw!r}")
                kw[name] = v.lower() in _TRUE
            elif name == "max_3xtf32_k":
                try:
                    kw[name] = int(v)
                except ValueError:
                    raise ValueError(f"{var} must be an integer, got {raw!r}") from None
                if kw[name] < 0:
                    raise ValueError(f"{var} must be >= 0, got {kw[name]}")
            elif name in ("gemm", "compiler"):
                if v:
                    kw[name] = v
            elif name == "validate_indices":
                if v.lower() not in _INDEX_MODES:
                    raise ValueError(f"{var} must be one of lazy, sync (or eager), 0 (or off), got {raw!r}")
                kw[name] = _INDEX_MODES[v.lower()]
            else:
                v = v.lower() or CHOICES[name][0]
                if v not in CHOICES[name]:
                    raise ValueError(f"{var} must be one of {CHOICES[name]}, got {raw!r}")
                kw[name] = v
        return cls(**kw)

    def replace(self, **changes: Any) -> ExecutionPolicy:
        """A copy with ``changes`` (validated); an unknown field is a ValueError naming the fields."""
        names = {f.name for f in fields(self)}
        bad = sorted(set(changes) - names)
        if bad:
            raise ValueError(f"ExecutionPolicy has no field {', '.join(map(repr, bad))}; fields: "
                             f"{', '.join(f.name for f in fields(self))}")
        return replace(self, **changes)

    def use(self) -> _Scope:
        """Context manager: this policy is :func:`current` inside the ``with`` block (this thread/context)."""
        return _Scope(self)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (logs, run records)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def autocast(self, device_type: str) -> Any:
        """The autocast region this policy asks for on ``device_type``: bf16 autocast when ``precision`` is
        'bf16', else a disabled (no-op) region."""
        from blutensor.amp import autocast
        from blutensor.dtypes import bfloat16

        return autocast(device_type, dtype=bfloat16, enabled=self.precision == "bf16")


_CURRENT: ContextVar[ExecutionPolicy | None] = ContextVar("blutensor_execution_policy", default=None)
_lock = threading.Lock()
_env: ExecutionPolicy | None = None  # what the environment asked for, read once
_env_kernels: dict[str, str] | None = None  # BLUTRAIN_KERNELS, read once
_default: ExecutionPolicy | None = None  # the process default (None: _env)


class _Scope:
    """``with`` block making a policy current (re-entrant per use: each ``with`` pushes and pops once)."""

    __slots__ = ("policy", "_tokens")

    def __init__(self, policy: ExecutionPolicy):
        if not isinstance(policy, ExecutionPolicy):
            raise TypeError(f"expected an ExecutionPolicy, got {type(policy).__name__}")
        self.policy = policy
        self._tokens: list = []

    def __enter__(self) -> ExecutionPolicy:
        self._tokens.append(_CURRENT.set(self.policy))
        return self.policy

    def __exit__(self, *exc: object) -> None:
        _CURRENT.reset(self._tokens.pop())


def env_defaults() -> ExecutionPolicy:
    """The policy the environment variables asked for when first read (see :func:`reset_defaults`)."""
    global _env
    p = _env
    if p is None:
        with _lock:
            if _env is None:
                _env = ExecutionPolicy.from_env()
            p = _env
    return p


def parse_kernels(spec: str, var: str = KERNELS_ENV) -> dict[str, str]:
    """``"op=plugin,op2=plugin2"`` as {op: kernel plugin name}; a malformed entry is a ValueError naming ``var``."""
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        op, eq, name = (s.strip() for s in item.partition("="))
        if not eq or not op or not name:
            raise ValueError(f"{var} entry {item!r} is not of the form op=plugin (e.g. relu=example.relu)")
        out[op] = name
    return out


def env_kernels() -> dict[str, str]:
    """The kernel overrides ``BLUTRAIN_KERNELS`` asked for ({op: kernel plugin name}), read once at the first op
    (a copy: ``bt.ext.use_kernel`` overrides it per op; :func:`reset_defaults` reads it again)."""
    global _env_kernels
    k = _env_kernels
    if k is None:
        with _lock:
            if _env_kernels is None:
                _env_kernels = parse_kernels(os.environ.get(KERNELS_ENV, ""))
            k = _env_kernels
    return dict(k)


def get_default() -> ExecutionPolicy:
    """The process-wide policy: what :func:`set_default` set, else :func:`env_defaults`."""
    p = _default
    return p if p is not None else env_defaults()


def set_default(policy: ExecutionPolicy) -> None:
    """Make ``policy`` the process-wide default (what every thread sees outside a scope)."""
    global _default
    if not isinstance(policy, ExecutionPolicy):
        raise TypeError(f"set_default expects an ExecutionPolicy, got {type(policy).__name__}")
    _default = policy


def reset_defaults() -> None:
    """Forget the process default and read the environment variables (:data:`ENV` and ``BLUTRAIN_KERNELS``) again
    at the next use, forgetting the kernel choices made under the old ones (tests)."""
    global _env, _default, _env_kernels
    with _lock:
        _env = None
        _default = None
        _env_kernels = None
    from blutensor.ops import dispatch

    dispatch.clear_cache()


def current() -> ExecutionPolicy:
    """The active policy: the innermost scope of this thread/context, else the process default."""
    p = _CURRENT.get()
    return p if p is not None else get_default()


def scope(policy: ExecutionPolicy | None = None, /, **changes: Any) -> _Scope:
    """Context manager making ``policy`` (default: :func:`current`) with ``changes`` current for a region::

        with bt.policy.scope(deterministic=True, attention_backward="split"):
            loss.backward()
    """
    base = current() if policy is None else policy
    return _Scope(base.replace(**changes) if changes else base)


def update(**changes: Any) -> ExecutionPolicy:
    """Change fields of the innermost layer -- the active scope's policy (until that scope exits), else the
    process default -- and return the new policy. The setters (``bt.set_matmul_precision``, ...) write this way."""
    inner = _CURRENT.get()
    if inner is not None:
        p = inner.replace(**changes)
        _CURRENT.set(p)
        return p
    p = get_default().replace(**changes)
    set_default(p)
    return p


__all__ = ["CHOICES", "ENV", "FP32_GEMMS", "KERNELS_ENV", "PRECISIONS", "ExecutionPolicy", "current",
           "env_defaults", "env_kernels", "get_default", "parse_kernels", "reset_defaults", "scope", "set_default",
           "update"]
