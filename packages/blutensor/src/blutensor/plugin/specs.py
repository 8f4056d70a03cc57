"""Hook specifications of the `blutrain` plugin host.

Every registration hook returns a class or a list of classes that carry ``PLUGIN_NAME``;
event hooks receive plain values. Built-in packages implement these exactly as a
third-party package would, through ``[project.entry-points.blutrain]``.
"""

from __future__ import annotations

from typing import Any

import pluggy

PROJECT = "blutrain"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class BlutrainSpecs:
    """The hooks a plugin may implement (all optional)."""

    # --- registration hooks: each returns a class or list of classes with PLUGIN_NAME ---
    @hookspec
    def blutrain_register_backends(self) -> list[type]:
        """Array backends: subclasses of ``blutensor.backends.Backend`` (PLUGIN_NAME, DEVICE_TYPE; ``is_available()``,
        ``module(dev)``, ``owns(arr)``, ``device_of(arr)``; optional ``kernel_classes()`` and allocator hooks)."""

    @hookspec
    def blutrain_register_kernels(self) -> list[type]:
        """Op kernels: PLUGIN_NAME, OP (op name), BACKEND ('cpu'|'cuda'), DTYPES (names or
        ('*',)), ``forward(ctx, *arrays, **attrs)`` and ``backward(ctx, grad)`` static methods."""

    @hookspec
    def blutrain_register_gemm_providers(self) -> list[type]:
        """GEMM providers: PLUGIN_NAME, ``is_available()``, ``matmul(a, b, ...)`` on raw arrays."""

    @hookspec
    def blutrain_register_allocators(self) -> list[type]:
        """Device allocators: PLUGIN_NAME, ``is_available()``, ``install()`` / ``uninstall()``; optional
        ``graph_allocator()`` -> the installed allocator with ``graph_pool()`` (private pools for graph capture);
        optional ``memory_stats(device=None)`` (``allocated_bytes``, ``reserved_bytes``, ``peak_allocated_bytes``,
        ``peak_reserved_bytes`` of one device; without a ``device`` parameter it is called with that device
        current), ``reset_peak_stats(device=None)`` and ``is_installed()`` (CuPy allocates through it now, however
        it was installed): what ``bt.cuda.memory_allocated`` and the other memory functions read."""

    @hookspec
    def blutrain_register_parallel_strategies(self) -> list[type]:
        """Parallel strategies (DDP, FSDP, TP, CP): PLUGIN_NAME, ``apply(model, mesh, ...)``."""

    @hookspec
    def blutrain_register_compiler_backends(self) -> list[type]:
        """Compiler backends and pass sets: PLUGIN_NAME, ``compile(fn, **options)``."""

    @hookspec
    def blutrain_register_profiler_sinks(self) -> list[type]:
        """Profiler sinks (where events go): PLUGIN_NAME, ``write(events, out_dir)``."""

    @hookspec
    def blutrain_register_model_families(self) -> list[type]:
        """Model families: PLUGIN_NAME, ``presets()`` and ``build(config)``."""

    # --- event hooks ---
    @hookspec
    def blutrain_on_step_begin(self, step: int, state: dict[str, Any]) -> None:
        """Called by trainers before an optimisation step."""

    @hookspec
    def blutrain_on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        """Called by trainers after an optimisation step with its metrics."""

    @hookspec
    def blutrain_on_checkpoint_saved(self, path: str, step: int) -> None:
        """Called after a checkpoint is durably written."""

    @hookspec
    def blutrain_on_checkpoint_loaded(self, path: str, step: int) -> None:
        """Called after a checkpoint was verified and loaded."""

    @hookspec
    def blutrain_on_train_end(self, status: str, step: int, error: BaseException | None) -> None:
        """Called by trainers when a run ends: status "ok", "preempted" (SIGTERM, checkpoint saved) or "failed"
        (``error`` is the exception, for an orchestrator to classify)."""

    @hookspec
    def blutrain_kernel_cache(self, cache: Any) -> None:
        """Called once per plugin when the host loads it, with :mod:`blutensor.kernel_cache`: the integrity checks
        a plugin that keeps compiled kernels on disk applies before loading one (for plugins that do not import
        blutensor, such as blublas)."""

    @hookspec
    def blutrain_tma_encoder(self, tma: Any) -> None:
        """Called once per plugin when the host loads it, with ``blutensor.ext.tma``: the TMA tensor-map encoder
        (``cuTensorMapEncodeTiled`` specs, checks, cached 128-byte kernel arguments) for plugins that launch sm_90a
        kernels and do not import blutensor (blublas's TMA GEMMs)."""


#: plugin kind -> the registration hook that provides it
KIND_HOOKS: dict[str, str] = {
    "backend": "blutrain_register_backends",
    "kernel": "blutrain_register_kernels",
    "gemm": "blutrain_register_gemm_providers",
    "allocator": "blutrain_register_allocators",
    "parallel": "blutrain_register_parallel_strategies",
    "compiler": "blutrain_register_compiler_backends",
    "profiler_sink": "blutrain_register_profiler_sinks",
    "model": "blutrain_register_model_families",
}
