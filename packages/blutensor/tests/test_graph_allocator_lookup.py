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


class _FakeStream:
    def __init__(self):
        self.captures = 0

    def wait_event(self, ev):
        pass

    def record(self):
        return object()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def begin_capture(self, mode=None):
        self.captures += 1

    def end_capture(self):
        return object()

    def synchronize(self):
        pass


class _FakeCuda:
    class runtime:  # noqa: N801 - CuPy's name
        streamCaptureModeRelaxed = 2  # noqa: N815

    def __init__(self):
        self.made = []
        self.current = _FakeStream()

    def Stream(self, non_blocking=False):  # noqa: N802 - CuPy's name
        s = _FakeStream()
        self.made.append(s)
        return s

    def Device(self):  # noqa: N802 - CuPy's name
        return type("Dev", (), {"id": 0})()

    def get_current_stream(self):
        return self.current

    def MemoryPool(self):  # noqa: N802 - CuPy's name
        return type("Pool", (), {"malloc": None, "total_bytes": lambda self: 0})()

    @contextlib.contextmanager
    def using_allocator(self, fn):
        yield


def test_captures_share_one_default_side_stream(monkeypatch):
    """Graphs sharing a pool reuse each other's blocks only on one stream (the allocator keeps free lists per
    stream), so every capture without an explicit stream uses the device's one capture stream, as PyTorch does."""
    fake = type("cp", (), {})()
    fake.cuda = _FakeCuda()
    monkeypatch.setattr(cuda_graph, "_cp", lambda: fake)
    monkeypatch.setattr(cuda_graph, "_CAPTURE_STREAMS", {})
    host = reset_host(autoload=False)
    try:
        first, second, own = cuda_graph.CUDAGraph(), cuda_graph.CUDAGraph(), cuda_graph.CUDAGraph()
        with cuda_graph.graph(first):
            pass
        with cuda_graph.graph(second, pool=first.pool()):
            pass
        explicit = _FakeStream()
        with cuda_graph.graph(own, stream=explicit):
            pass
        assert len(fake.cuda.made) == 1, "one capture stream for the device, made once"
        assert first._stream is second._stream is fake.cuda.made[0]
        assert first._stream.captures == 2 and own._stream is explicit and explicit.captures == 1
    finally:
        reset_host()
