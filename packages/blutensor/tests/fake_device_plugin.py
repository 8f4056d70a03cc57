"""blutensor's CUDA branch on the repository's fake CUDA device (testing/fake_cuda/), on a machine without a GPU.

Importing this module (or loading it as a pytest plugin: ``-p fake_device_plugin``) puts the fake ``cupy`` and
``cupyx`` into ``sys.modules`` before blutensor imports them, turns the fused CUDA kernels off (the fake device runs
no kernels: the generic CUDA branch of every op is what runs) and routes the fake's arrays, which subclass
``numpy.ndarray``, to the fake ``cupy`` module. It checks blutensor's logic (array-module lookup, device moves,
bf16 bit storage, scatter-add, the GEMM provider hook), not CUDA. Used by tests/test_no_host_sync.py, and to run
every ``cuda``-marked core test on the CPU (see the package README).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "testing"))
import fake_cuda  # noqa: E402

cupy = fake_cuda.make_cupy()
sys.modules.update(fake_cuda.modules(cupy))

import blutensor.backends as be  # noqa: E402
import blutensor.backends.cupy as co  # noqa: E402
import blutensor.ops._util as u  # noqa: E402

co.cupy_installed = lambda: False  # the fused kernels need a real GPU; test the generic CUDA branch
_orig = be.array_module


def array_module(arr):
    """The fake ``cupy`` for the fake's device arrays (NumPy subclasses, which blutensor would take for NumPy)."""
    return cupy if isinstance(arr, fake_cuda.ndarray) else _orig(arr)


be.array_module = array_module
u.array_module = array_module
