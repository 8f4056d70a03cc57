"""The exception types BluBLAS raises, so callers can catch them precisely: GemmError for bad input (and its
subclass EpilogueUnavailable for a fused epilogue no implementation runs for that problem), ProviderUnavailable
when a provider cannot run here."""

from __future__ import annotations


class GemmError(ValueError):
    """A GEMM call was given something it cannot compute: names the operand and what is wrong."""


class ProviderUnavailable(RuntimeError):
    """A GEMM provider cannot run here (no CuPy, no GPU, no cuBLAS library found)."""


class EpilogueUnavailable(GemmError):
    """A valid call whose fused epilogue no implementation here runs for that problem (``epilogue='dgelu'`` on
    BluBLAS's own kernels, or with no cuBLASLt algorithm for it); nothing was written, so the caller may compute
    the same thing unfused."""
