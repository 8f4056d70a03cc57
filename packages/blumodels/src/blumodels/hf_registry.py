"""Hugging Face export/import functions keyed by ``model.family``.

A family registers two functions: ``to_hf(model) -> (state dict of HF names -> float32 arrays, config.json dict)``
and ``from_hf(state, config, device=None, **model_overrides) -> model``. ``save_hf``/``load_hf`` write and read a
Hugging Face model directory (``model.safetensors`` + ``config.json``) through them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from blumodels.config import ConfigError

_EXPORT: dict[str, Callable] = {}
_IMPORT: dict[str, Callable] = {}
_ARCH: dict[str, str] = {}  # Hugging Face architecture name -> family


def register(family: str, to_hf: Callable, from_hf: Callable, architecture: str) -> None:
    """Register a family's pair; ``architecture`` is the Hugging Face class its config.json names."""
    if family in _EXPORT and (_EXPORT[family] is not to_hf or _IMPORT[family] is not from_hf):
        raise ConfigError(f"hf_registry: family {family!r} is already registered with other functions")
    _EXPORT[family], _IMPORT[family], _ARCH[architecture] = to_hf, from_hf, family


def _builtin() -> None:
    if "llama" not in _EXPORT:
        from blumodels.llama.hf import ARCHITECTURE, from_hf, to_hf

        register("llama", to_hf, from_hf, ARCHITECTURE)


def families() -> list[str]:
    _builtin()
    return sorted(_EXPORT)


def exporter(family: str) -> Callable:
    _builtin()
    if family not in _EXPORT:
        raise ConfigError(f"no Hugging Face export for model.family={family!r} (families with one: "
                          f"{', '.join(sorted(_EXPORT))})")
    return _EXPORT[family]


def importer(config: dict[str, Any]) -> Callable:
    """The import function for a Hugging Face config.json dict (by its ``architectures``)."""
    _builtin()
    for arch in config.get("architectures") or []:
        if arch in _ARCH:
            return _IMPORT[_ARCH[arch]]
    raise ConfigError(f"no importer for Hugging Face architectures {config.get('architectures')} (known: "
                      f"{', '.join(sorted(_ARCH))})")


def save_hf(model, directory: str | Path) -> Path:
    """Write ``model`` as a Hugging Face model directory (model.safetensors, config.json); returns it."""
    from safetensors.numpy import save_file

    state, config = exporter(model.config.family)(model)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return d


_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "BF16": "<u2", "I64": "<i8", "I32": "<i4"}


def read_safetensors(path: str | Path) -> dict[str, Any]:
    """Every tensor of a safetensors file as a float32 (or integer) NumPy array; bfloat16 widened exactly (NumPy
    has no bfloat16, which is how Hugging Face ships most Llama weights)."""
    import numpy as np

    p = Path(path)
    raw = p.read_bytes()
    try:
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
    except ValueError as e:
        raise ConfigError(f"{p} is not a safetensors file: {e}") from None
    body = memoryview(raw)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _DTYPES.get(info.get("dtype"))
        if dt is None:
            raise ConfigError(f"{p}: tensor {name!r} has dtype {info.get('dtype')!r}, which is not read here")
        lo, hi = info["data_offsets"]
        a = np.frombuffer(body[lo:hi], dtype=dt).reshape(info["shape"])
        if info["dtype"] == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        out[name] = a.astype(np.float32) if a.dtype.kind == "f" else a
    return out


def load_hf(directory: str | Path, device: Any = None, **model_overrides: Any):
    """A model from a Hugging Face model directory (config.json + model*.safetensors shards)."""
    d = Path(directory)
    try:
        config = json.loads((d / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"{d} is not a Hugging Face model directory (no config.json)") from None
    except ValueError as e:
        raise ConfigError(f"{d / 'config.json'} is not readable JSON: {e}") from None
    shards = sorted(d.glob("model*.safetensors"))
    if not shards:
        raise ConfigError(f"{d} holds no model*.safetensors weights")
    state: dict[str, Any] = {}
    for s in shards:
        state.update(read_safetensors(s))
    return importer(config)(state, config, device=device, **model_overrides)
