"""Shared fixtures: the same allocator tests run on the fake backend (CPU) and on a real GPU."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from bluallocator import CachingAllocator, FakeDeviceBackend
from bluallocator.cuda_backend import cuda_available

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "testing"))  # the shared fake CUDA device
CUDA = cuda_available()
MiB = 1 << 20


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not CUDA:
            item.add_marker(skip)


class FakeEnv:
    """Fake device: streams are ints, queued work completes when the test releases it."""

    name = "fake"

    def __init__(self, capacity: int = 512 * MiB) -> None:
        self.backend = FakeDeviceBackend(capacity)
        self._next = 100
        self.allocators: list[CachingAllocator] = []

    def allocator(self, **kw: object) -> CachingAllocator:
        a = CachingAllocator(self.backend, **kw)
        self.allocators.append(a)
        return a

    def new_stream(self) -> int:
        self._next += 1
        return self._next

    def block(self, stream: int) -> Callable[[], None]:
        """Queue work on ``stream`` that does not finish until the returned function is called."""
        self.backend.enqueue(stream)
        return lambda: self.backend.synchronize(stream)

    def close(self) -> None:
        pass


class CudaEnv:
    """Real GPU: CudaBackend, cupy streams; blocking work is a host function waiting on a threading.Event."""

    name = "cuda"

    def __init__(self) -> None:
        import cupy
        from bluallocator import CudaBackend
        self.cupy = cupy
        self.backend = CudaBackend()
        self.streams: list[object] = []
        self.allocators: list[CachingAllocator] = []
        self.gates: list[threading.Event] = []

    def allocator(self, **kw: object) -> CachingAllocator:
        a = CachingAllocator(self.backend, **kw)
        self.allocators.append(a)
        return a

    def new_stream(self) -> int:
        s = self.cupy.cuda.Stream(non_blocking=True)
        self.streams.append(s)
        return int(s.ptr)

    def block(self, stream: int) -> Callable[[], None]:
        s = next(x for x in self.streams if int(x.ptr) == stream)
        gate = threading.Event()
        self.gates.append(gate)
        s.launch_host_func(lambda _arg: gate.wait(30), None)

        def release() -> None:
            gate.set()
            s.synchronize()
        return release

    def close(self) -> None:
        for g in self.gates:
            g.set()
        self.cupy.cuda.Device().synchronize()
        for a in self.allocators:
            a.synchronize_pending()
            for ptr in list(a._allocated):
                a.free(ptr)
            a.synchronize_pending()
            a.empty_cache()


@pytest.fixture(params=["fake", pytest.param("cuda", marks=pytest.mark.cuda)])
def env(request: pytest.FixtureRequest) -> Iterator[FakeEnv | CudaEnv]:
    e: FakeEnv | CudaEnv = FakeEnv() if request.param == "fake" else CudaEnv()
    yield e
    e.close()
