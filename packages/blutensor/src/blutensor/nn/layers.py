"""Layers: Linear, LayerNorm, RMSNorm, Embedding, Dropout, GELU, ReLU, Sequential, ModuleList, ModuleDict."""

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


class Embedding(Module):
    """A lookup table; ``padding_idx``: that row starts at zero and receives no gradient from the lookup
    (PyTorch's semantics; the row can still be trained through other uses of a tied weight)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, device=None,
                 dtype=None, _weight=None, _freeze: bool = False):
        super().__init__()
        _sizes("Embedding", num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        if padding_idx is not None:
            if isinstance(padding_idx, bool) or not isinstance(padding_idx, numbers.Integral) or not (
                    -num_embeddings <= padding_idx < num_embeddings):
                raise ArgumentError(f"Embedding: padding_idx must be within num_embeddings ({num_embeddings}), got "
                                    f"{padding_idx!r}")
            padding_idx = int(padding_idx) % num_embeddings
        self.padding_idx = padding_idx
        if _weight is not None:
            if tuple(_weight.shape) != (num_embeddings, embedding_dim):
                from blutensor.errors import ShapeError

                raise ShapeError(f"Embedding: _weight has shape {tuple(_weight.shape)}, expected "
                                 f"{(num_embeddings, embedding_dim)}")
            self.weight = Parameter(_weight.detach(), requires_grad=not _freeze)
        else:
            self.weight = Parameter(empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
            init.normal_(self.weight)
            if padding_idx is not None:
                from blutensor.autograd.grad_mode import no_grad

                with no_grad():
                    self.weight[padding_idx] = 0.0

    @classmethod
    def from_pretrained(cls, embeddings, freeze: bool = True, padding_idx: int | None = None) -> Embedding:
        """An Embedding holding a copy of the 2-D ``embeddings``; frozen (no grad) unless ``freeze=False``."""
        if getattr(embeddings, "ndim", None) != 2:
            from blutensor.errors import ShapeError

            raise ShapeError(f"Embedding.from_pretrained: embeddings must be 2-D, got "
                             f"{getattr(embeddings, 'shape', type(embeddings).__name__)}")
        n, d = embeddings.shape
        return cls(n, d, padding_idx=padding_idx, _weight=embeddings.clone(), _freeze=freeze)

    def forward(self, idx):
        out = F.embedding(idx, self.weight)
        if self.padding_idx is None or not self.weight.requires_grad:
            return out
        keep = (idx != self.padding_idx).unsqueeze(-1)
        return F.where(keep, out, F.embedding(idx, self.weight.detach()))

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}"


class Dropout(Module):
    """Zeroes elements with probability p in training (scaling the rest by 1/(1-p)); ``inplace`` is
    accepted and computes the same values out of place."""

    def __init__(self, p: float = 0.5, inplace: bool = False):
        super().__init__()
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= p <= 1.0:
            raise ArgumentError(f"Dropout: p must be in [0, 1], got {p}")
        self.p, self.inplace = p, inplace

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
    """max(x, 0); ``inplace`` is accepted and computes the same values out of place."""

    def __init__(self, inplace: bool = False):
        super().__init__()
        self.inplace = inplace

    def forward(self, x):
        return F.relu(x)


class Sequential(Module):
    """Modules applied in order: ``Sequential(a, b, c)`` or ``Sequential(OrderedDict(name=module, ...))``."""

    def __init__(self, *mods: Module):
        super().__init__()
        if len(mods) == 1 and isinstance(mods[0], dict):
            for k, m in mods[0].items():
                self.add_module(k, m)
        else:
            for i, m in enumerate(mods):
                self.add_module(str(i), m)

    def forward(self, x):
        for m in self._modules.values():
            x = m(x)
        return x

    def __getitem__(self, i):
        if isinstance(i, slice):
            from collections import OrderedDict

            return Sequential(OrderedDict(list(self._modules.items())[i]))
        return list(self._modules.values())[i]

    def __setitem__(self, i: int, m: Module) -> None:
        self.add_module(list(self._modules)[i], m)

    def __delitem__(self, i) -> None:
        keys = list(self._modules)
        for k in keys[i] if isinstance(i, slice) else [keys[i]]:
            del self._modules[k]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def append(self, m: Module) -> Sequential:
        self.add_module(str(len(self._modules)), m)
        return self

    def extend(self, mods) -> Sequential:
        for m in mods:
            self.append(m)
        return self

    def insert(self, index: int, m: Module) -> Sequential:
        mods = list(self._modules.values())
        mods.insert(index, m)
        self._modules.clear()
        for i, x in enumerate(mods):
            self.add_module(str(i), x)
        return self


class ModuleList(Module):
    def __init__(self, mods=()):
        super().__init__()
        for m in mods:
            self.append(m)

    def append(self, m: Module) -> ModuleList:
        self.add_module(str(len(self._modules)), m)
        return self

    def extend(self, mods) -> ModuleList:
        for m in mods:
            self.append(m)
        return self

    def insert(self, index: int, m: Module) -> None:
        mods = list(self._modules.values())
        mods.insert(index, m)
        self._modules.clear()
        for x in mods:
            self.append(x)

    def __iadd__(self, mods) -> ModuleList:
        return self.extend(mods)

    def __setitem__(self, i: int, m: Module) -> None:
        self.add_module(list(self._modules)[i], m)

    def __delitem__(self, i) -> None:
        mods = list(self._modules.values())
        del mods[i]
        self._modules.clear()
        for x in mods:
            self.append(x)

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

    def __delitem__(self, k: str) -> None:
        del self._modules[k]

    def __contains__(self, k) -> bool:
        return k in self._modules

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules)

    def pop(self, k: str) -> Module:
        return self._modules.pop(k)

    def update(self, mods) -> None:
        for k, m in (mods.items() if hasattr(mods, "items") else mods):
            self.add_module(k, m)

    def keys(self):
        return self._modules.keys()

    def items(self):
        return self._modules.items()

    def values(self):
        return self._modules.values()
