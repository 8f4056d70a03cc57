"""CUDA kernels of the training step: loaders, op kernel classes, fused optimizer and grad-norm.

Sources live in ``blutensor/kernels/*.cu``; nothing here imports CuPy until a kernel is launched.
Kernel classes (registered through blutensor's ``blutrain_register_kernels`` when CuPy is installed):
layer_norm, gelu, cross_entropy (fused classifier), embedding, rms_norm, rope, swiglu, sdpa (flash attention),
cast (fp32 <-> bf16), the widening fp32 + bf16 add and bf16 linear/matmul/bmm (GEMM provider at bf16 precision).
Free functions: ``adamw.multi_tensor_adamw``, ``norm.global_grad_norm``, ``norm.clip_grads_``.
"""

from __future__ import annotations

import importlib.util


def kernel_classes() -> list[type]:
    """The CUDA op kernel classes (importing them does not import CuPy)."""
    from blutensor.backends.cupy.cross_entropy import CrossEntropyCuda
    from blutensor.backends.cupy.decoder import RmsNormCuda, RopeCuda, SwigluCuda
    from blutensor.backends.cupy.embedding import EmbeddingCuda
    from blutensor.backends.cupy.gelu import GeluCuda
    from blutensor.backends.cupy.layer_norm import LayerNormCuda

    classes = [LayerNormCuda, GeluCuda, CrossEntropyCuda, EmbeddingCuda, RmsNormCuda, RopeCuda, SwigluCuda]
    try:
        from blutensor.backends.cupy.sdpa import SdpaCuda

        classes.append(SdpaCuda)
    except ImportError:
        pass
    return classes


def bf16_kernel_classes() -> list[type]:
    """CUDA kernel classes of the bf16 (autocast) path: fp32 <-> bf16 cast, bf16 linear/matmul/bmm."""
    from blutensor.backends.cupy.cast import AddWidenCuda, CastCuda
    from blutensor.backends.cupy.linalg import BmmCuda, LinearCuda, MatmulCuda

    return [CastCuda, AddWidenCuda, LinearCuda, MatmulCuda, BmmCuda]


def cupy_installed() -> bool:
    """True when CuPy can be imported (checked without importing it)."""
    return importlib.util.find_spec("cupy") is not None
