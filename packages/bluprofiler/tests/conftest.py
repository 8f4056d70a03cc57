"""Shared fixtures: a clean plugin host, GPU detection for the cuda-marked twins."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "testing"))  # the shared fake CUDA device


def _gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAS_GPU = _gpu()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA GPU")
    for it in items:
        if "cuda" in it.keywords and not HAS_GPU:
            it.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    """Run a test on CPU and, as a cuda-marked twin, on the GPU."""
    return request.param


@pytest.fixture(autouse=True)
def _no_leftover_observers():
    from bluprofiler import memory
    from blutensor import ext
    from blutensor.ext import Node

    before, before_bwd = list(ext.op_observers()), list(ext.backward_observers())
    apply_fn = Node.apply
    yield
    assert list(ext.op_observers()) == before, "a test left a dispatch observer installed"
    assert list(ext.backward_observers()) == before_bwd, "a test left a backward observer installed"
    assert Node.apply is apply_fn, "a test patched Node.apply"
    assert memory.OWNER == "other", "a test left the memory owner set"
