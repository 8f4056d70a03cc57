"""The `blutrain` plugin host: hook specs, registries and the manager."""

from blutensor.plugin.manager import DEFAULTS, PluginHost, get_host, reset_host
from blutensor.plugin.registry import PluginError, PluginRecord, Registry
from blutensor.plugin.specs import KIND_HOOKS, PROJECT, hookimpl, hookspec

__all__ = ["DEFAULTS", "KIND_HOOKS", "PROJECT", "PluginError", "PluginHost", "PluginRecord",
           "Registry", "get_host", "hookimpl", "hookspec", "reset_host"]
