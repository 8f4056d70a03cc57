"""The plugin manager: loads ``blutrain`` entry points into per-kind registries.

``BLUTRAIN_DISABLE_PLUGIN_AUTOLOAD=1`` loads only what is registered by hand;
``BLUTRAIN_BLOCK_PLUGINS=a,b`` blocks entry points (and hand registrations) by name; blutensor's
own registrations cannot be blocked.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pluggy

from blutensor.plugin.registry import BackendRegistry, KernelRegistry, PluginError, PluginRecord, Registry
from blutensor.plugin.specs import KIND_HOOKS, PROJECT, BlutrainSpecs

#: documented "best available" defaults per kind
DEFAULTS: dict[str, tuple[str, ...]] = {
    # cuBLAS (capture-safe, through blublas's provider) first: measured faster end to end than our own GEMM
    # kernels (GPT-2 124M fp32: benchmarks/results/e2e_gpt2_h200.json)
    "gemm": ("cublas", "blublas", "xp"),
    "allocator": ("caching", "cupy-default"),
    "compiler": ("blucompiler",),
}


class PluginHost:
    """One pluggy manager plus one registry per plugin kind."""

    def __init__(self, autoload: bool | None = None, blocked: tuple[str, ...] | None = None):
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(BlutrainSpecs)
        if blocked is None:
            blocked = tuple(b for b in os.environ.get("BLUTRAIN_BLOCK_PLUGINS", "").split(",") if b)
        for name in blocked:
            if name != "blutensor":  # the host's own pieces cannot be blocked
                self.pm.set_blocked(name)
        if autoload is None:
            autoload = os.environ.get("BLUTRAIN_DISABLE_PLUGIN_AUTOLOAD", "") not in ("1", "true", "yes")
        self.autoload = autoload
        self.registries: dict[str, Registry] = {
            kind: (KernelRegistry(kind) if kind == "kernel" else BackendRegistry(kind) if kind == "backend"
                   else Registry(kind, DEFAULTS.get(kind, ())))
            for kind in KIND_HOOKS
        }
        self._collected: set[int] = set()
        self._dists: dict[int, tuple[str, str]] = {}
        # blutensor's own pieces are always present: blutensor is the host.
        from blutensor import hooks as own_hooks

        self.register(own_hooks, name="blutensor")
        #: entry points that failed to load: (entry point name, package, error); the rest still load
        self.broken: list[tuple[str, str, str]] = []
        if autoload:
            self._load_entry_points()
        self._collect()

    def _load_entry_points(self) -> None:
        """Load every ``blutrain`` entry point; one that fails is reported, not fatal to the others."""
        import importlib.metadata as md
        import warnings

        for dist in md.distributions():
            for ep in dist.entry_points:
                if ep.group != PROJECT or self.pm.has_plugin(ep.name) or self.pm.is_blocked(ep.name):
                    continue
                pkg = dist.metadata["name"]
                try:
                    plugin = ep.load()
                except Exception as e:  # noqa: BLE001 - a broken plugin must not take the framework down
                    self.broken.append((ep.name, pkg, f"{type(e).__name__}: {e}"))
                    warnings.warn(f"blutrain plugin {ep.name!r} from package {pkg} failed to load and is "
                                  f"ignored: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)
                    continue
                if self.pm.is_registered(plugin):
                    continue
                self.pm.register(plugin, name=ep.name)
                self._dists[id(plugin)] = (pkg, dist.version)

    def register(self, plugin: Any, name: str | None = None, package: str | None = None,
                 version: str | None = None) -> None:
        """Register a module or object implementing hooks (a third-party plugin by hand)."""
        if name is not None and self.pm.has_plugin(name):
            return
        if self.pm.is_registered(plugin):
            return
        if self.pm.register(plugin, name=name) is None:
            return  # blocked by name
        if package:
            self._dists[id(plugin)] = (package, version or "?")
        self._collect()
        from blutensor.ops import dispatch

        dispatch.clear_cache()  # a new kernel may now win for some op

    def _collect(self) -> None:
        for plugin in self.pm.get_plugins():
            if id(plugin) in self._collected:
                continue
            self._collected.add(id(plugin))
            pkg, ver = self._dists.get(id(plugin), (None, None))
            if pkg is None:
                pkg, ver = _package_of(plugin)
            give_cache = getattr(plugin, "blutrain_kernel_cache", None)
            if give_cache is not None:  # the kernel-cache checks, for plugins that cannot import blutensor
                from blutensor import kernel_cache

                give_cache(cache=kernel_cache)
            give_tma = getattr(plugin, "blutrain_tma_encoder", None)
            if give_tma is not None:  # the one TMA tensor-map encoder, for plugins that cannot import blutensor
                from blutensor import ext

                give_tma(tma=ext.tma)
            for kind, hook in KIND_HOOKS.items():
                impl = getattr(plugin, hook, None)
                if impl is None:
                    continue
                result = impl()
                classes = result if isinstance(result, list | tuple) else [result]
                for cls in classes:
                    if cls is not None:
                        self.registries[kind].register(cls, pkg, ver)

    def records(self) -> list[PluginRecord]:
        return [rec for reg in self.registries.values() for rec in reg]

    def registry(self, kind: str) -> Registry:
        try:
            return self.registries[kind]
        except KeyError:
            raise PluginError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KIND_HOOKS)}") from None

    @property
    def hook(self) -> Any:
        return self.pm.hook


def _package_of(plugin: Any) -> tuple[str, str]:
    mod = getattr(plugin, "__name__", type(plugin).__module__).split(".")[0]
    try:
        from importlib.metadata import version

        return mod, version(mod)
    except Exception:
        return mod, "?"


_host: PluginHost | None = None
_lock = threading.Lock()


def get_host() -> PluginHost:
    """The process-wide plugin host, created on first use."""
    global _host
    if _host is None:
        with _lock:
            if _host is None:
                _host = PluginHost()
    return _host


def reset_host(**kwargs: Any) -> PluginHost:
    """Recreate the host (tests; after installing or blocking plugins)."""
    global _host
    with _lock:
        _host = PluginHost(**kwargs)
    from blutensor.ops import dispatch

    dispatch.clear_cache()
    return _host
