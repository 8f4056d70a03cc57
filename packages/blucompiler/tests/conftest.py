import os
import tempfile

import pytest

# every test run compiles into its own cache (no stale shared objects between runs)
os.environ.setdefault("BLU_COMPILER_CACHE", tempfile.mkdtemp(prefix="blucompiler-cache-"))


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA GPU")
    for it in items:
        if "cuda" in it.keywords:
            it.add_marker(skip)


@pytest.fixture(autouse=True)
def _reference_cpu_kernels():
    """Eager steps run blutensor's NumPy reference kernels, the semantics the compiler lowers: the tests compare
    compiled and eager results bit for bit."""
    import blutensor as bt

    with bt.ext.reference_kernels():
        yield
