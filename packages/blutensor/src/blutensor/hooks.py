"""blutensor's own plugin registrations (the NumPy and CuPy backends, their op kernels, the xp GEMM).

They go through the same hooks a third-party package implements; the host registers this module first and
cannot block it.
"""

from __future__ import annotations

from blutensor.plugin.specs import hookimpl


@hookimpl
def blutrain_register_backends():
    from blutensor.backends.cupy import CupyBackend
    from blutensor.backends.numpy import NumpyBackend

    return [NumpyBackend, CupyBackend]


@hookimpl
def blutrain_register_kernels():
    from blutensor.backends.cupy import CupyBackend
    from blutensor.backends.numpy import NumpyBackend
    from blutensor.ops.table import builtin_kernels

    # the CUDA classes import no CuPy and serve only backend 'cuda': registered everywhere, so the
    # kernel set (and `blutrain plugins`) is the same on a CPU-only install
    return builtin_kernels() + NumpyBackend.kernel_classes() + CupyBackend.kernel_classes()


@hookimpl
def blutrain_register_gemm_providers():
    from blutensor.gemm import XpGemm

    return [XpGemm]
