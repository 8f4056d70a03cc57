"""Ops defined at run time: one op-table row plus its forward/backward pair, from outside ``ops/table.py``.

:func:`define_op` is what a row of the built-in table does, for an extension package or a user: it records the
kernel class (``PLUGIN_NAME = "blutensor.<name>"``, every backend) in the op table, registers it with the plugin
host (so ``BLUTRAIN_KERNELS`` / ``use_kernel`` and a plugin's faster kernels for the op work as for a built-in
op), and generates the op's ``blutensor.functional`` function(s) and Tensor method(s) from its ``api``.
"""

from __future__ import annotations

import inspect

from blutensor.errors import ArgumentError
from blutensor.ops import surface, table

#: op name -> the public names it installed (functional, Tensor), for the ops defined by define_op
_DEFINED: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
_FLAGS = tuple(n for n, p in inspect.signature(table.op).parameters.items()
               if p.kind is inspect.Parameter.KEYWORD_ONLY and n != "api")


def define_op(name: str, forward, backward=None, *, api: surface.Api | None = None, **flags) -> type:
    """Add op ``name``: ``forward(ctx, *arrays, **attrs) -> array`` and ``backward(ctx, grad) -> tuple of
    gradients`` (one per input; None: not differentiable), dispatch ``flags`` as in the op table (``saves``,
    ``saves_output``, ``same_dtype``, ``dtype_arg``, ``view``, ``bf16_native``, ``dtypes``, ``grad_into``,
    ``grad_sum``) and the public surface ``api`` (:func:`blutensor.ops.surface.api`). Returns the kernel class.

    Raises ArgumentError, with nothing installed, when ``name`` is already an op or a generated name is
    already taken in ``blutensor.functional`` or on Tensor."""
    from blutensor import functional as F
    from blutensor._tensor import Tensor
    from blutensor.ops import dispatch
    from blutensor.plugin import get_host

    if not isinstance(name, str) or not name.isidentifier():
        raise ArgumentError(f"define_op: op name must be an identifier string, got {name!r}")
    if name in table.OPS:
        raise ArgumentError(f"define_op: op {name!r} already exists (see blutensor.ext.op_names())")
    if not callable(forward) or (backward is not None and not callable(backward)):
        raise ArgumentError(f"define_op: {name}: forward and backward must be callables (backward may be None)")
    bad = sorted(set(flags) - set(_FLAGS))
    if bad:
        raise ArgumentError(f"define_op: {name}: unknown flag(s) {bad}; flags: {', '.join(_FLAGS)}")
    if api is not None and not isinstance(api, surface.Api):
        raise ArgumentError(f"define_op: {name}: api must come from blutensor.ext.op_api(...), got "
                            f"{type(api).__name__}")
    fns, meths = surface.generate({name: surface.attach(api, name)}) if api is not None else ({}, {})
    for n in fns:
        if hasattr(F, n):
            raise ArgumentError(f"define_op: {name}: blutensor.functional already has {n!r}")
    for n in meths:
        if hasattr(Tensor, n):
            raise ArgumentError(f"define_op: {name}: Tensor already has an attribute {n!r}")
    cls = table.op(name, forward, backward, api=api, **flags)
    get_host().registry("kernel").register(cls, "blutensor.ext.define_op", "-")
    for n, fn in fns.items():
        setattr(F, n, fn)
    for n, fn in meths.items():
        setattr(Tensor, n, fn)
    _DEFINED[name] = (tuple(fns), tuple(meths))
    dispatch.clear_cache()
    return cls


def remove_op(name: str) -> None:
    """Undo :func:`define_op` for op ``name``: its row, kernel registration, functional and Tensor names.
    Built-in ops cannot be removed (ArgumentError)."""
    from blutensor import functional as F
    from blutensor._tensor import Tensor
    from blutensor.ops import dispatch
    from blutensor.plugin import get_host

    if name not in _DEFINED:
        what = "a built-in op" if name in table.OPS else "not an op"
        raise ArgumentError(f"remove_op: {name!r} was not added by define_op ({what})")
    fns, meths = _DEFINED.pop(name)
    cls = table.OPS.pop(name)
    table.API.pop(name, None)
    get_host().registry("kernel").unregister(cls.PLUGIN_NAME)
    for n in fns:
        delattr(F, n)
    for n in meths:
        delattr(Tensor, n)
    dispatch.clear_cache()
