"""``bt.compile``: a function compiled by the compiler plugin the host selects (the counterpart of
``torch.compile``). blutensor imports no compiler: blucompiler, or a third-party backend, registers itself
through the ``blutrain_register_compiler_backends`` hook and is chosen here by name."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from blutensor import policy as _policy
from blutensor.plugin import PluginError, get_host

__all__ = ["compile", "compiler_backends"]


def compiler_backends() -> list[str]:
    """Names of the compiler plugins installed (``backend=`` values of :func:`compile`)."""
    return get_host().registry("compiler").names()


def _backend(name: str | None) -> type:
    """The compiler plugin ``name`` names, else the execution policy's ``compiler`` ('auto': the defaults)."""
    if name is None:
        name = _policy.current().compiler
        name = None if name == "auto" else name
    reg = get_host().registry("compiler")
    if name is None and not len(reg):
        raise PluginError("bt.compile: no compiler plugin is installed (pip install blucompiler, or register "
                          "one through the blutrain_register_compiler_backends hook)")
    return reg.select(name)


def compile(fn: Callable | None = None, *, backend: str | None = None,  # noqa: A001 - PyTorch's name
            options: Mapping[str, Any] | None = None) -> Any:
    """Compile ``fn`` (typically a whole training step) with the compiler plugin ``backend``: by default
    the execution policy's ``compiler`` (``bt.policy.scope(compiler=...)``; its default ``BLUTRAIN_COMPILER``, read
    once), 'auto' being the first available of the host's defaults ("blucompiler"). ``options`` are
    passed to that plugin's ``compile`` (blucompiler: ``backend``, ``cuda_graph``, ``force_eager``, ``dump``).
    Without ``fn`` it returns a decorator: ``@bt.compile(options={...})``."""
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"bt.compile: backend must be a plugin name (str), got {type(backend).__name__}")
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"bt.compile: options must be a dict of keyword arguments for the compiler plugin, "
                        f"got {type(options).__name__}")
    opts = dict(options or {})
    if fn is None:
        return lambda f: compile(f, backend=backend, options=opts)
    if not callable(fn):
        raise TypeError(f"bt.compile: expected a function to compile, got {type(fn).__name__}")
    plugin = _backend(backend)
    try:
        return plugin.compile(fn, **opts)
    except TypeError as e:
        if "keyword argument" not in str(e):
            raise
        raise TypeError(f"bt.compile: compiler plugin {getattr(plugin, 'PLUGIN_NAME', plugin.__name__)!r} "
                        f"rejected options {sorted(opts)}: {e}") from None
