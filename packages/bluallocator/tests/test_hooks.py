"""Plugin registration and the import boundary (no blutensor)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution, entry_points

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
    import pytest
    try:
        distribution("bluallocator")
    except PackageNotFoundError:
        pytest.skip("bluallocator is on sys.path but not installed (no entry-point metadata)")
    eps = [ep for ep in entry_points(group="blutrain") if ep.name == "bluallocator"]
    assert eps and eps[0].value == "bluallocator.hooks"
    assert eps[0].load() is hooks


def test_importing_bluallocator_does_not_import_blutensor_or_cupy():
    code = ("import sys, bluallocator, bluallocator.hooks; "
            "bad = [m for m in ('blutensor', 'blublas', 'cupy', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_step_hooks_profile_step0_and_flush(monkeypatch):
    from bluallocator import CachingAllocator, FakeDeviceBackend, cupy_glue
    a = CachingAllocator(FakeDeviceBackend())
    monkeypatch.setitem(cupy_glue._state, "installed", True)
    monkeypatch.setattr(cupy_glue, "_allocators", {0: a})
    pm = pluggy.PluginManager("blutrain")
    pm.register(hooks)
    startup = a.malloc(30 << 20, 0)  # e.g. a checkpoint staging buffer
    a.free(startup)
    pm.hook.blutrain_on_step_begin(step=0, state={})
    assert a.profiling
    ptrs = [a.malloc((3 << 20) + 4096 * k + 7, 0) for k in range(32)]
    for p in ptrs:
        a.free(p)
    pm.hook.blutrain_on_step_end(step=0, metrics={})
    assert not a.profiling and a.startup_flushed and a.alignment_choice.num_requests == 32
    assert a.memory_stats()["reserved_bytes"] == 0
    pm.hook.blutrain_on_step_begin(step=1, state={})
    assert not a.profiling


def test_step_hooks_do_nothing_when_not_installed(monkeypatch):
    from bluallocator import CachingAllocator, FakeDeviceBackend, cupy_glue
    a = CachingAllocator(FakeDeviceBackend())
    monkeypatch.setitem(cupy_glue._state, "installed", False)
    monkeypatch.setattr(cupy_glue, "_allocators", {0: a})
    hooks.blutrain_on_step_begin(step=0, state={})
    assert not a.profiling


def test_install_refuses_a_non_cuda_allocator():
    import pytest
    from bluallocator import CachingAllocator, FakeDeviceBackend, cupy_glue
    pytest.importorskip("cupy")
    with pytest.raises(TypeError, match="CudaBackend"):
        cupy_glue.install(CachingAllocator(FakeDeviceBackend()))
    assert not cupy_glue.is_installed()


def test_graph_allocator_is_none_until_installed(monkeypatch):
    """blutensor's CUDA graphs ask the plugin for the installed allocator (graph_pool) through the host."""
    from bluallocator import cupy_glue
    from bluallocator.hooks import CachingAllocatorPlugin

    monkeypatch.setattr(cupy_glue, "is_installed", lambda: False)
    assert CachingAllocatorPlugin.graph_allocator() is None
    sentinel = object()
    monkeypatch.setattr(cupy_glue, "is_installed", lambda: True)
    monkeypatch.setattr(cupy_glue, "get_allocator", lambda device=None: sentinel)
    assert CachingAllocatorPlugin.graph_allocator() is sentinel
