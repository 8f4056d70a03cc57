"""Layers: Linear, LayerNorm, RMSNorm, SiLU, Embedding, Dropout, GELU, Sequential, ModuleList, ModuleDict."""

from __future__ import annotations

import math
import numbers

from blutensor import functional as F
from blutensor.creation import empty, ones, zeros
from blutensor.errors import ArgumentError, DTypeError
from blutensor.nn import init
from blutensor.nn.module import Module
from blutensor.nn.parameter import Parameter


def _sizes(layer: str, **sizes) -> None:
    """Raise unless every named size is a non-negative int (checked before any allocation)."""
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise DTypeError(f"{layer}: {name} must be an int, got {type(v).__name__} {v!r}")
        if v < 0:
            raise ArgumentError(f"{layer}: {name} must be >= 0, got {v}")


class Linear(Module):
    """y = x W^T + b; PyTorch's default init (uniform within 1/sqrt(in_features))."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        _sizes("Linear", in_features=in_features, out_features=out_features)
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(empty(out_features, in_features, device=device, dtype=dtype))
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if bias:
            self.bias = Parameter(empty(out_features, device=device, dtype=dtype))
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
            init.uniform_(self.bias, -bound, bound)
        else:
            self.bias = None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class LayerNorm(Module):
    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        _sizes("LayerNorm", **{f"normalized_shape[{i}]": n for i, n in enumerate(self.normalized_shape)})
        self.eps = eps
        if elementwise_affine:
            self.weight = Parameter(ones(*self.normalized_shape, device=device, dtype=dtype))
            self.bias = Parameter(zeros(*self.normalized_shape, device=device, dtype=dtype)) if bias else None
        else:
            self.weight = self.bias = None

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class RMSNorm(Module):
    """Root-mean-square norm over the trailing ``normalized_shape`` dims (PyTorch's ``nn.RMSNorm``; weight ones)."""

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True, device=None,
                 dtype=None):
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        _sizes("RMSNorm", **{f"normalized_shape[{i}]": n for i, n in enumerate(self.normalized_shape)})
        self.eps = eps
        self.weight = Parameter(ones(*self.normalized_shape, device=device, dtype=dtype)) if elementwise_affine \
            else None

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class SiLU(Module):
    def forward(self, x):
        return F.silu(x)


class Embedding(Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype=None):
        super().__init__()
        _sizes("Embedding", num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = Parameter(empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        init.normal_(self.weight)

    def forward(self, idx):
        return F.embedding(idx, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class Dropout(Module):
    def __init__(self, p: float = 0.5):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ArgumentError(f"Dropout: p must be in [0, 1], got {p}")
        self.p = p

    def forward(self, x):
        return F.dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class GELU(Module):
    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ArgumentError(f"GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x):
        return F.gelu(x, self.approximate)


class ReLU(Module):
    def forward(self, x):
        return F.relu(x)


class Sequential(Module):
    def __init__(self, *mods: Module):
        super().__init__()
        for i, m in enumerate(mods):
            self.add_module(str(i), m)

    def forward(self, x):
        for m in self._modules.values():
            x = m(x)
        return x

    def __getitem__(self, i: int) -> Module:
        return list(self._modules.values())[i]

    def __len__(self) -> int:
        return len(self._modules)


class ModuleList(Module):
    def __init__(self, mods=()):
        super().__init__()
        for m in mods:
            self.append(m)

    def append(self, m: Module) -> ModuleList:
        self.add_module(str(len(self._modules)), m)
        return self

    def __getitem__(self, i):
        vals = list(self._modules.values())
        return ModuleList(vals[i]) if isinstance(i, slice) else vals[i]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


class ModuleDict(Module):
    def __init__(self, mods: dict | None = None):
        super().__init__()
        for k, m in (mods or {}).items():
            self.add_module(k, m)

    def __getitem__(self, k: str) -> Module:
        return self._modules[k]

    def __setitem__(self, k: str, m: Module) -> None:
        self.add_module(k, m)

    def keys(self):
        return self._modules.keys()

    def items(self):
        return self._modules.items()

    def values(self):
        return self._modules.values()
