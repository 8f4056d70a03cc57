"""BluBLAS: GEMM kernels per GPU architecture with fused epilogues, a capture-safe cuBLAS provider and a
NumPy reference. Works on raw NumPy/CuPy arrays; imports neither blutensor nor any other BluTrain package."""

from .__about__ import __version__
from .api import EPILOGUES, PRECISIONS, PROVIDERS, gemm, gemm_batched
from .errors import EpilogueUnavailable, GemmError, ProviderUnavailable
from .reference import gemm_reference

__all__ = [
    "EPILOGUES",
    "EpilogueUnavailable",
    "PRECISIONS",
    "PROVIDERS",
    "GemmError",
    "ProviderUnavailable",
    "__version__",
    "gemm",
    "gemm_batched",
    "gemm_reference",
]
