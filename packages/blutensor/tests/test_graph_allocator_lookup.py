"""CUDA graphs find a graph-capable allocator through the plugin host (blutensor never imports bluallocator)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from blutensor import cuda_graph
from blutensor.plugin.manager import reset_host

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "testing"))
import fake_cuda  # noqa: E402


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


def test_captures_share_one_default_side_stream(monkeypatch):
    """Graphs sharing a pool reuse each other's blocks only on one stream (the allocator keeps free lists per
    stream), so every capture without an explicit stream uses the device's one capture stream, as PyTorch does."""
    cp = fake_cuda.make_cupy()  # the shared fake device: streams with capture, Device().id, MemoryPool
    monkeypatch.setattr(cuda_graph, "_cp", lambda: cp)
    monkeypatch.setattr(cuda_graph, "_CAPTURE_STREAMS", {})
    reset_host(autoload=False)
    try:
        first, second, own = cuda_graph.CUDAGraph(), cuda_graph.CUDAGraph(), cuda_graph.CUDAGraph()
        with cuda_graph.graph(first):
            inside = cp.device.allocator
        with cuda_graph.graph(second, pool=first.pool()):
            pass
        assert len(cp.device.streams) == 1, "one capture stream for the device, made once"
        explicit = cp.cuda.Stream(non_blocking=True)
        with cuda_graph.graph(own, stream=explicit):
            pass
        assert first._stream is second._stream is cp.device.streams[0]
        assert first._stream.captures == 2 and own._stream is explicit and explicit.captures == 1
        assert inside == first.pool().cupy_pool.malloc, "allocations inside the capture go to its pool"
        assert cp.device.allocator == "cupy-pool" and not first._stream.is_capturing()
    finally:
        reset_host()
