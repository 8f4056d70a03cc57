"""CUDA graphs find a graph-capable allocator through the plugin host (blutensor never imports bluallocator)."""

from __future__ import annotations

import contextlib

from blutensor import cuda_graph
from blutensor.plugin.manager import reset_host


class _FakeAlloc:
    def __init__(self):
        self.entered = []

    @contextlib.contextmanager
    def graph_pool(self, pool_id=None):
        self.entered.append(pool_id)
        yield 7


class _Installed:
    PLUGIN_NAME = "fake-graph-alloc"
    ALLOC = _FakeAlloc()

    @classmethod
    def graph_allocator(cls):
        return cls.ALLOC


class _NotInstalled:
    PLUGIN_NAME = "fake-not-installed"

    @classmethod
    def graph_allocator(cls):
        return None


class _Broken:
    PLUGIN_NAME = "fake-broken"

    @classmethod
    def graph_allocator(cls):
        raise RuntimeError("boom")


def test_installed_graph_allocator_is_found_and_broken_ones_are_skipped():
    host = reset_host(autoload=False)
    try:
        reg = host.registry("allocator")
        reg.register(_Broken, "tests")
        reg.register(_NotInstalled, "tests")
        assert cuda_graph._graph_allocator() is None
        reg.register(_Installed, "tests")
        assert cuda_graph._graph_allocator() is _Installed.ALLOC
    finally:
        reset_host()


def test_pool_routes_capture_allocations_to_the_graph_pool():
    host = reset_host(autoload=False)
    try:
        host.registry("allocator").register(_Installed, "tests")
        pool = cuda_graph._Pool(cp=None)
        assert pool.blu is _Installed.ALLOC and pool.cupy_pool is None
        with pool.active():
            pass
        assert pool.pool_id == 7 and _Installed.ALLOC.entered[-1] is None
    finally:
        reset_host()
