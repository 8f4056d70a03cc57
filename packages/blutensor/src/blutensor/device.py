"""Devices: ``cpu`` (NumPy) and ``cuda[:N]`` (CuPy)."""

from __future__ import annotations

from functools import lru_cache


class device:  # noqa: N801 - PyTorch's name
    """A device: type 'cpu' or 'cuda' and an index for CUDA."""

    __slots__ = ("type", "index")

    def __init__(self, spec="cpu", index: int | None = None):
        if isinstance(spec, device):
            self.type, self.index = spec.type, spec.index
            return
        s = str(spec)
        if ":" in s:
            s, idx = s.split(":", 1)
            try:
                index = int(idx)
            except ValueError:
                raise ValueError(f"bad device {spec!r}: expected 'cpu', 'cuda' or 'cuda:N'") from None
        if s not in ("cpu", "cuda") or (index is not None and index < 0):
            raise ValueError(f"bad device {spec!r}: expected 'cpu', 'cuda' or 'cuda:N' with N >= 0")
        self.type = s
        self.index = (index or 0) if s == "cuda" else None

    def __repr__(self) -> str:
        return f"device(type='{self.type}'" + (f", index={self.index})" if self.index is not None else ")")

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __eq__(self, other) -> bool:
        if isinstance(other, str):
            other = as_device(other)
        return isinstance(other, device) and self.type == other.type and self.index == other.index

    def __hash__(self) -> int:
        return hash((self.type, self.index))


@lru_cache(maxsize=64)
def _parse(spec: str) -> device:
    return device(spec)


CPU = device("cpu")


def as_device(d) -> device:
    """Turn 'cpu', 'cuda', 'cuda:1', an int or a device into a device (cached)."""
    if d is None:
        return CPU
    if isinstance(d, device):
        return d
    if isinstance(d, int):
        return _parse(f"cuda:{d}")
    return _parse(str(d))
