"""blucompiler: trace a training step, optimise it as the MLIR ``blu`` dialect (xDSL), fuse,
generate C/CUDA, JIT, and run it on live tensor memory.

``step = blucompiler.compile(fn)``; ``step(*args)`` traces on the first call per input signature
(shapes, dtypes, devices, strides) and replays the compiled program afterwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from blucompiler.__about__ import __version__

if TYPE_CHECKING:
    from blucompiler.api import CompiledStep


def compile(fn, *, backend: str = "auto", force_eager=(), dump: str | None = None,  # noqa: A001
            cuda_graph: bool = False) -> CompiledStep:
    """Compile ``fn`` (forward + backward + optimizer step on blutensor) into a :class:`CompiledStep`.

    ``backend``: "auto" (CUDA for CUDA tensors, else C when a C compiler exists, else NumPy), "c",
    "cuda" or "numpy" (kernels interpreted through the array library). ``force_eager``: op names
    that always run eagerly inside the compiled step. ``dump``: directory for the MLIR after every
    pass (default: ``$BLU_COMPILER_DUMP``). ``cuda_graph``: on CUDA, replay the whole compiled step as
    one CUDA graph (see :mod:`blucompiler.cudagraph`; turned off with a reason if capture fails).
    """
    from blucompiler.api import CompiledStep

    return CompiledStep(fn, backend=backend, force_eager=force_eager, dump=dump, cuda_graph=cuda_graph)


def __getattr__(name: str):
    """``CompiledStep`` and ``CompileError`` load on first use: the plugin host imports this package to register
    the backend, and xDSL (the IR) should cost nothing until something is compiled."""
    if name == "CompiledStep":
        from blucompiler.api import CompiledStep

        return CompiledStep
    if name == "CompileError":
        from blucompiler.trace import CompileError

        return CompileError
    raise AttributeError(f"module 'blucompiler' has no attribute {name!r}")


__all__ = ["compile", "CompiledStep", "CompileError", "__version__"]
