"""The one exception type BluBLAS raises for bad input, so callers can catch it precisely."""

from __future__ import annotations


class GemmError(ValueError):
    """A GEMM call was given something it cannot compute: names the operand and what is wrong."""


class ProviderUnavailable(RuntimeError):
    """A GEMM provider cannot run here (no CuPy, no GPU, no cuBLAS library found)."""
