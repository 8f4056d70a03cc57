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
        from blutensor.backends import cuda_available

        return cuda_available()


@hookimpl
def blutrain_register_backends():
    return [CpuBackend, CudaBackend]


@hookimpl
def blutrain_register_kernels():
    from blutensor.backends.numpy import kernel_classes as cpu_kernel_classes
    from blutensor.backends.cupy import bf16_kernel_classes, kernel_classes
    from blutensor.ops.table import builtin_kernels

    # the CUDA classes import no CuPy and serve only backend 'cuda': registered everywhere, so the
    # kernel set (and `blutrain plugins`) is the same on a CPU-only install
    return builtin_kernels() + cpu_kernel_classes() + kernel_classes() + bf16_kernel_classes()


@hookimpl
def blutrain_register_gemm_providers():
    from blutensor.gemm import XpGemm

    return [XpGemm]
