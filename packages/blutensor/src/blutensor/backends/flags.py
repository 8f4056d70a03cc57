"""PyTorch's backend flags, ``bt.backends.cuda.matmul.allow_tf32``, a view of the execution policy's ``precision``.

As in PyTorch (>= 1.12), the flag and ``bt.set_float32_matmul_precision`` are one setting: ``allow_tf32`` reads
True unless float32 matmuls are 'highest' (blutensor's precision 'fp32'); setting it True selects 'high' ('tf32'),
False 'highest' ('fp32'). Like every setter it writes the innermost policy layer (the active ``bt.policy.scope``,
else the process default), so ``torch.backends.cuda.matmul.allow_tf32 = True`` in PyTorch code run on blutensor
(``blutensor.compat``) turns on TF32 GEMMs.
"""

from __future__ import annotations


class _MatmulFlags:
    """``bt.backends.cuda.matmul``: the CUDA matmul flags."""

    @property
    def allow_tf32(self) -> bool:
        """Whether float32 CUDA matmuls may use the TF32 matrix units (policy precision other than 'fp32')."""
        from blutensor.gemm import get_matmul_precision

        return get_matmul_precision() != "fp32"

    @allow_tf32.setter
    def allow_tf32(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise TypeError(f"backends.cuda.matmul.allow_tf32 must be True or False, got {on!r}")
        from blutensor.gemm import set_matmul_precision

        set_matmul_precision("tf32" if on else "fp32")

    def __setattr__(self, name: str, value: object) -> None:
        if name != "allow_tf32":
            raise AttributeError(f"backends.cuda.matmul has no flag {name!r} (blutensor has: allow_tf32)")
        object.__setattr__(self, name, value)


class _CudaBackend:
    """``bt.backends.cuda``."""

    matmul = _MatmulFlags()


cuda = _CudaBackend()

__all__ = ["cuda"]
