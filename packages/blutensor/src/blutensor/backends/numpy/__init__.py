"""The ``cpu`` backend: NumPy arrays, host memory from NumPy, and the compiled CPU kernels of the training step
(``kernels.c``), the CPU counterpart of the CUDA kernels in :mod:`blutensor.backends.cupy`.

:class:`NumpyBackend` is what the plugin host registers (``bt.backends.get("cpu")``); :func:`status`,
:func:`available` and :func:`reference_kernels` are about the compiled kernels.

The kernels are fused and threaded the way the CUDA kernels are, float32 throughout: tanh-GELU forward/backward
(also the recompute of GPT-2's GELU + c_proj), LayerNorm forward/backward (dweight/dbias from fixed row blocks), softmax
cross-entropy whose backward writes the logits gradient in one pass, flash-style attention (one score row at a
time, log-sum-exp saved, no L x S buffer), embedding backward, AdamW and the gradient norm over all parameters.

The C source is compiled at first use with the system C compiler and cached (``_build``). The NumPy kernels in
``blutensor.ops`` stay the reference: every kernel here is tested against them, calls these kernels do not cover
(other dtypes, masks, dropout, the erf GELU) run them, and they run everywhere when the library cannot be built
(``BLUTRAIN_CPU_KERNELS=0`` forces that; a warning says so once). Per op, ``BLUTRAIN_KERNELS=gelu=blutensor.gelu``
selects the reference as for any kernel plugin. Thread count: :func:`blutensor.set_num_threads`. The host
GEMMs' row blocks (``gemm``), the transposing copies around attention and linear's bias gradient (``strided``)
run on the same OpenMP threads, so the step's CPU work uses one thread pool.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from blutensor.backends import Backend
from blutensor.device import CPU, device
from blutensor.errors import DeviceError


def kernel_classes() -> list[type]:
    """The CPU op kernel classes (importing them builds nothing: the library is built at the first call)."""
    from blutensor.backends.numpy.nn import CrossEntropyCpu, EmbeddingCpu, GeluCpu, LayerNormCpu, RmsNormCpu, SdpaCpu

    return [GeluCpu, LayerNormCpu, CrossEntropyCpu, EmbeddingCpu, SdpaCpu, RmsNormCpu]


def available() -> bool:
    """True when the compiled kernels are in use (building them on the first call if needed)."""
    from blutensor.backends.numpy._build import lib

    return lib() is not None


def status() -> dict:
    """``available``, ``reason`` (why not), ``path`` of the cached library, ``build_s`` (None: loaded from cache)."""
    from blutensor.backends.numpy._build import status as st

    return st()


@contextlib.contextmanager
def reference_kernels():
    """Run the NumPy reference kernels (and unsplit single-thread host GEMMs) inside the block, whatever is
    installed: for comparing against the reference bit for bit (blucompiler's interpreter, a new kernel)."""
    from blutensor.backends.numpy import _build
    from blutensor.ops import linalg

    _build._reference_depth[0] += 1
    threads, linalg._threads[0] = linalg._threads[0], 1
    try:
        yield
    finally:
        _build._reference_depth[0] -= 1
        linalg._threads[0] = threads


class NumpyBackend(Backend):
    """NumPy arrays on the host (device ``cpu``): always available; memory comes from NumPy, so no allocator plugin
    is installed; op kernels: the compiled C kernels (:func:`kernel_classes`), the NumPy references everywhere
    else."""

    PLUGIN_NAME = "cpu"
    DEVICE_TYPE = "cpu"

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def module(cls, dev: device | None = None) -> Any:
        """NumPy (``dev`` must be the CPU when given)."""
        if dev is not None and dev.type != "cpu":
            raise DeviceError(f"the cpu backend holds no arrays of device {dev}")
        return np

    @classmethod
    def owns(cls, arr: Any) -> bool:
        return isinstance(arr, np.ndarray | np.generic)

    @classmethod
    def device_of(cls, arr: Any) -> device:
        if not cls.owns(arr):
            raise cls._not_mine(arr)
        return CPU

    @classmethod
    def kernel_classes(cls) -> list[type]:
        """The compiled CPU kernels' op classes (registered for backend ``cpu``; nothing is built here)."""
        return kernel_classes()
