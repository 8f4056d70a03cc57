"""blutensor's own plugin registrations (built-in op kernels, CPU/CUDA backends, the xp GEMM)."""

from __future__ import annotations

from blutensor.plugin.specs import hookimpl


class CpuBackend:
    """NumPy backend: always available."""

    PLUGIN_NAME = "cpu"
    DEVICE_TYPE = "cpu"

    @classmethod
    def is_available(cls) -> bool:
        return True


class CudaBackend:
    """CuPy backend: available when CuPy imports and a GPU is present."""

    PLUGIN_NAME = "cuda"
    DEVICE_TYPE = "cuda"

    @classmethod
    def is_available(cls) -> bool:
        from blutensor.backend import cuda_available

        return cuda_available()


@hookimpl
def blutrain_register_backends():
    return [CpuBackend, CudaBackend]


@hookimpl
def blutrain_register_kernels():
    from blutensor.cuda_ops import cupy_installed, kernel_classes
    from blutensor.ops.table import builtin_kernels

    return builtin_kernels() + (kernel_classes() if cupy_installed() else [])


@hookimpl
def blutrain_register_gemm_providers():
    from blutensor.gemm import XpGemm

    return [XpGemm]
