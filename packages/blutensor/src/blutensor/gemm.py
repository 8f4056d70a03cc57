"""GEMM provider selection for CUDA matmuls.

Providers register through ``blutrain_register_gemm_providers``; ``BLUTRAIN_GEMM`` or
:func:`set_gemm_provider` choose one; default order: blublas, cublas, xp (CuPy's matmul). Each
provider's ``matmul(a, b)`` works on 2-D or 3-D (same batch) raw arrays.
"""

from __future__ import annotations

_provider = None
_precision = "fp32"


class XpGemm:
    """Built-in provider: ``cupy.matmul`` (cuBLAS through CuPy; not capture-safe)."""

    PLUGIN_NAME = "xp"

    @classmethod
    def is_available(cls) -> bool:
        return True

    @staticmethod
    def matmul(a, b, *, precision: str = "fp32", **_):
        import cupy

        return cupy.matmul(a, b)


def set_gemm_provider(name: str | None) -> None:
    """Choose the CUDA GEMM provider by plugin name (None: the documented default)."""
    global _provider
    from blutensor.plugin import get_host

    _provider = get_host().registry("gemm").select(name) if name else None


def get_gemm_provider():
    global _provider
    if _provider is None:
        from blutensor.plugin import get_host

        _provider = get_host().registry("gemm").select()
    return _provider


def set_matmul_precision(mode: str) -> None:
    """'fp32' (strict), 'tf32' (matrix units for fp32) or 'bf16' for CUDA GEMMs."""
    global _precision
    if mode not in ("fp32", "tf32", "bf16"):
        raise ValueError(f"matmul precision must be 'fp32', 'tf32' or 'bf16', got {mode!r}")
    _precision = mode


def get_matmul_precision() -> str:
    return _precision


def cuda_matmul(a, b):
    """Broadcasting matmul of CuPy arrays through the selected provider."""
    prov = get_gemm_provider()
    if prov is XpGemm:
        return XpGemm.matmul(a, b)
    if a.ndim <= 3 and b.ndim <= 3 and (a.ndim < 3 or b.ndim < 3 or a.shape[0] == b.shape[0]):
        if a.ndim == 3 and b.ndim == 2:
            out = prov.matmul(a.reshape(-1, a.shape[-1]), b, precision=_precision)
            return out.reshape(a.shape[0], a.shape[1], b.shape[-1])
        if a.ndim == 2 and b.ndim == 3:
            import cupy

            a = cupy.broadcast_to(a, (b.shape[0],) + a.shape)
        return prov.matmul(a, b, precision=_precision)
    import cupy

    batch = cupy.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = cupy.broadcast_to(a, batch + a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b3 = cupy.broadcast_to(b, batch + b.shape[-2:]).reshape(-1, *b.shape[-2:])
    return prov.matmul(a3, b3, precision=_precision).reshape(*batch, a.shape[-2], b.shape[-1])
