"""Plugin registration: the two GEMM providers BluBLAS offers to the ``blutrain`` plugin host."""

from __future__ import annotations

from typing import Any

import pluggy

from .__about__ import __version__

hookimpl = pluggy.HookimplMarker("blutrain")


class _ProviderBase:
    """Common ``matmul`` of both providers: raw NumPy/CuPy arrays in, the output array back."""

    PLUGIN_NAME = ""
    VERSION = __version__
    #: capability: ``matmul`` takes NumPy arrays too (not only CuPy arrays)
    HOST_ARRAYS = False
    PROVIDER = ""
    #: precisions ``matmul`` accepts; '3xtf32' is fp32-accurate split-TF32 on the tensor cores (not TF32)
    PRECISIONS = ("fp32", "tf32", "bf16", "3xtf32")
    #: capability: both providers launch on the current stream through handles they own, so a CUDA graph can
    #: record them (the Trainer's captured step relies on it)
    CAPTURE_SAFE = True
    #: capability: ``matmul(..., out=C, beta=1.0)`` adds into ``C`` (blutensor accumulates weight gradients so)
    ACCUMULATE = True
    #: capability: the epilogues ``matmul`` fuses into the GEMM: 'gelu' (tanh GELU after the bias, the
    #: pre-activation written to ``save_preact``) and, where listed, 'dgelu' (the product times gelu'(``preact``),
    #: the column sums written to ``bias_grad``); a 'dgelu' call the provider cannot fuse for that problem returns
    #: None, having written nothing (blutensor then computes it unfused)
    EPILOGUES = ("none", "gelu")

    @classmethod
    def matmul(
        cls,
        a: Any,
        b: Any,
        *,
        trans_a: bool = False,
        trans_b: bool = False,
        out: Any = None,
        alpha: float = 1.0,
        beta: float = 0.0,
        bias: Any = None,
        epilogue: str = "none",
        precision: str = "fp32",
        save_preact: Any = None,
        stream: Any = None,
        preact: Any = None,
        bias_grad: Any = None,
    ) -> Any:
        """out = epi(alpha * op(a) @ op(b) + beta * out + bias); 3-D operands run as a strided batch. With
        ``epilogue='dgelu'`` (2-D, see :func:`blublas.gemm`): None when no fused algorithm exists for it."""
        from .api import gemm, gemm_batched
        from .errors import EpilogueUnavailable

        if epilogue == "dgelu":
            try:
                return gemm(a, b, out, trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta, bias=bias,
                            epilogue=epilogue, save_preact=save_preact, precision=precision, stream=stream,
                            provider=cls.PROVIDER, preact=preact, bias_grad=bias_grad)
            except EpilogueUnavailable:
                return None
        fn = gemm_batched if max(a.ndim, b.ndim) == 3 else gemm
        return fn(
            a,
            b,
            out,
            trans_a=trans_a,
            trans_b=trans_b,
            alpha=alpha,
            beta=beta,
            bias=bias,
            epilogue=epilogue,
            save_preact=save_preact,
            precision=precision,
            stream=stream,
            provider=cls.PROVIDER,
        )


class BluBLASProvider(_ProviderBase):
    """Our own kernels (SIMT fp32, mma.sync tf32/bf16) with fused epilogues; NumPy reference on CPU."""

    PLUGIN_NAME = "blublas"
    PROVIDER = "blublas"
    #: capability: ``matmul`` also takes NumPy arrays (the float64-checked reference of every kernel)
    HOST_ARRAYS = True

    @classmethod
    def is_available(cls) -> bool:
        """True with NumPy always (CPU reference); GPU kernels additionally need CuPy and sm_80+."""
        return True

    @classmethod
    def cuda_available(cls) -> bool:
        """True when CuPy sees a GPU of compute capability >= 8.0."""
        try:
            import cupy

            return cupy.cuda.runtime.getDeviceCount() > 0 and int(cupy.cuda.Device().compute_capability) >= 80
        except Exception:  # noqa: BLE001
            return False


class CuBLASProvider(_ProviderBase):
    """cuBLASLt through ctypes with our own handle: fused epilogues, usable inside CUDA graph capture."""

    PLUGIN_NAME = "cublas"
    PROVIDER = "cublas"
    #: capability: also 'dgelu' (cuBLASLt's DGELU / DGELU_BGRAD epilogues)
    EPILOGUES = ("none", "gelu", "dgelu")

    @classmethod
    def is_available(cls) -> bool:
        """True when CuPy sees a GPU and libcublasLt can be loaded."""
        from .cublas import is_available

        return is_available()


@hookimpl
def blutrain_register_gemm_providers() -> list[type]:
    """BluBLAS kernels ('blublas') and the capture-safe vendor provider ('cublas')."""
    return [BluBLASProvider, CuBLASProvider]


@hookimpl
def blutrain_kernel_cache(cache: Any) -> None:
    """blutensor's kernel-cache checks (blutensor.kernel_cache): BLUBLAS_CACHE_DIR's cubins are verified with them."""
    from .loader import use_kernel_cache

    use_kernel_cache(cache)


@hookimpl
def blutrain_tma_encoder(tma: Any) -> None:
    """blutensor's TMA tensor-map encoder (blutensor.ext.tma): the sm_90a GEMMs encode their operand maps with it."""
    from .tma import use_encoder

    use_encoder(tma)
