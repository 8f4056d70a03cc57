"""Plugin registration and the import boundary (no blutensor)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pluggy
from bluallocator import hooks


def test_hook_returns_both_allocators_with_the_plugin_interface():
    pm = pluggy.PluginManager("blutrain")
    pm.register(hooks)
    (classes,) = pm.hook.blutrain_register_allocators()
    names = [c.PLUGIN_NAME for c in classes]
    assert names == ["caching", "cupy-default"]
    for c in classes:
        assert isinstance(c.is_available(), bool)
        for method in ("install", "uninstall", "memory_stats", "empty_cache"):
            assert callable(getattr(c, method))


def test_entry_point_points_at_hooks():
    eps = [ep for ep in entry_points(group="blutrain") if ep.name == "bluallocator"]
    assert eps and eps[0].value == "bluallocator.hooks"
    assert eps[0].load() is hooks


def test_importing_bluallocator_does_not_import_blutensor_or_cupy():
    code = ("import sys, bluallocator, bluallocator.hooks; "
            "bad = [m for m in ('blutensor', 'blublas', 'cupy', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
