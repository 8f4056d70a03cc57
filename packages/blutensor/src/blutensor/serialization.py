"""``blutensor.save`` / ``blutensor.load``: tensors and plain values in a safetensors file, never pickle.

A saved object is a Tensor, a number, str, bool, None, a ``blutensor.dtype``/``device``, or a dict, list or
tuple of those (nested to any depth): a model's ``state_dict()``, an optimizer's (int keys, tuples of
betas), a scheduler's, a generator's state, a checkpoint dict holding all of them and a step count. The
tensors go into the safetensors tensor table (a flat ``{name: Tensor}`` dict keeps its names, so the file
opens as an ordinary state dict in any safetensors reader); the structure around them is JSON in the
header's metadata under ``"blutensor"``. Loading runs no code from the file, so ``weights_only`` is always
in effect. Anything else (a Module, a NumPy array, a set, an arbitrary object) is refused by name, with
its position in the object, before a byte is written.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import struct
from typing import Any

import numpy as np

from blutensor.errors import BluTensorError, DTypeError

_META_KEY = "blutensor"
_FORMAT = 1
_ST_DTYPES = {"F32": "float32", "F64": "float64", "F16": "float16", "BF16": "bfloat16", "I32": "int32",
              "I64": "int64", "U16": "uint16", "BOOL": "bool"}


def _where(path: list) -> str:
    return "obj" + "".join(f"[{p!r}]" for p in path)


class _Encoder:
    """Walks an object, collecting host arrays by tensor name and the JSON skeleton around them."""

    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}

    def tensor(self, t, name: str) -> dict:
        from blutensor.dtypes import bfloat16

        host = t.detach().cpu()._data
        if t.dtype is bfloat16 and host.dtype != bfloat16.np:
            host = host.view(bfloat16.np)
        if name in self.arrays:  # a key that collides with a generated path name
            name = f"{name}#{len(self.arrays)}"
        self.arrays[name] = host if host.flags.c_contiguous else host.copy(order="C")  # (keeps 0-d)
        return {"tensor": name, "dtype": t.dtype.name, "device": str(t.device), "requires_grad": t.requires_grad}

    def value(self, v: Any, path: list, flat_key: str | None = None):
        from blutensor._tensor import Tensor
        from blutensor.device import device
        from blutensor.dtypes import dtype

        if isinstance(v, Tensor):
            return self.tensor(v, flat_key if flat_key is not None else "/".join(map(str, path)) or "tensor")
        if v is None or isinstance(v, bool | str):
            return v
        if isinstance(v, numbers.Integral):
            return int(v)
        if isinstance(v, numbers.Real):
            f = float(v)
            return f if math.isfinite(f) else {"float": repr(f)}
        if isinstance(v, dtype):
            return {"dtype": v.name}
        if isinstance(v, device):
            return {"device": str(v)}
        if isinstance(v, dict):
            items = []
            for k, x in v.items():
                if not (k is None or isinstance(k, bool | str | numbers.Integral)
                        or (isinstance(k, numbers.Real) and math.isfinite(k))):
                    raise DTypeError(f"blutensor.save: {_where(path)} has a key of type {type(k).__name__} "
                                     f"({k!r:.40}); dict keys must be str, int, float, bool or None")
                key = int(k) if isinstance(k, numbers.Integral) and not isinstance(k, bool) else k
                items.append([key, self.value(x, [*path, k])])
            return {"dict": items}
        if isinstance(v, list | tuple):
            kind = "tuple" if isinstance(v, tuple) else "list"
            return {kind: [self.value(x, [*path, i]) for i, x in enumerate(v)]}
        raise DTypeError(f"blutensor.save: {_where(path)} is a {type(v).__module__}.{type(v).__qualname__}; save "
                         f"stores Tensors, numbers, str, bool, None, dtypes, devices and dicts/lists/tuples of "
                         f"them (for a Module save its state_dict(); wrap arrays with blutensor.tensor())")


def save(obj: Any, f, metadata: dict[str, str] | None = None) -> None:
    """Write ``obj`` (see the module docstring) to ``f``: a path (written to a temporary file in the same
    folder, then renamed, so an interrupted save never leaves a truncated checkpoint) or a binary file
    object. ``metadata``: extra str -> str entries for the safetensors header."""
    from safetensors.numpy import save as st_save

    from blutensor._tensor import Tensor

    enc = _Encoder()
    flat = (isinstance(obj, dict) and obj and all(isinstance(k, str) for k in obj)
            and all(isinstance(v, Tensor) for v in obj.values()))
    if flat:  # a plain state dict: tensors keep their own names in the file
        skeleton = {"dict": [[k, enc.value(v, [k], flat_key=k)] for k, v in obj.items()]}
    else:
        skeleton = enc.value(obj, [])
    meta = {}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str) or k == _META_KEY:
            raise DTypeError(f"blutensor.save: metadata must map str to str (and not use the key '{_META_KEY}'), "
                             f"got {k!r:.40}: {type(v).__name__}")
        meta[k] = v
    meta[_META_KEY] = json.dumps({"format": _FORMAT, "obj": skeleton}, separators=(",", ":"))
    data = st_save(enc.arrays, metadata=meta)
    if isinstance(f, str | os.PathLike):
        path = os.fspath(f)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    elif hasattr(f, "write"):
        f.write(data)
    else:
        raise DTypeError(f"blutensor.save: f must be a path or a binary file object, got {type(f).__name__}")


def _header(data: bytes, src: str) -> dict:
    if len(data) < 8:
        raise BluTensorError(f"blutensor.load: {src} is not a safetensors file ({len(data)} bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise BluTensorError(f"blutensor.load: {src} is not a safetensors file (header of {n} bytes in a file of "
                             f"{len(data)})")
    try:
        return json.loads(data[8:8 + n])
    except ValueError:
        raise BluTensorError(f"blutensor.load: {src} is not a safetensors file (unreadable header)") from None


def load(f, map_location=None, weights_only: bool = True) -> Any:
    """Read what :func:`save` wrote. ``map_location``: None (each tensor back on the device it was saved
    from), a device (``"cpu"``, ``"cuda:0"``, ``bt.device``) or a dict {saved device: new device}. A
    safetensors file written by another tool loads as a flat ``{name: Tensor}`` dict on the CPU.
    ``weights_only`` is accepted for PyTorch compatibility; nothing is ever unpickled."""
    import safetensors

    from blutensor.creation import tensor as _tensor_of
    from blutensor.device import device
    from blutensor.dtypes import as_dtype

    src = repr(os.fspath(f)) if isinstance(f, str | os.PathLike) else type(f).__name__
    if isinstance(f, str | os.PathLike):
        with open(f, "rb") as fh:
            data = fh.read()
    elif hasattr(f, "read"):
        data = f.read()
    else:
        raise DTypeError(f"blutensor.load: f must be a path or a binary file object, got {type(f).__name__}")
    header = _header(data, src)
    try:
        entries = safetensors.deserialize(data)
    except Exception as e:  # the Rust reader's own error type
        raise BluTensorError(f"blutensor.load: {src} is not a valid safetensors file: {e}") from None
    arrays = {}
    for name, spec in entries:
        dt_name = _ST_DTYPES.get(spec["dtype"])
        if dt_name is None:
            raise DTypeError(f"blutensor.load: tensor '{name}' in {src} has dtype {spec['dtype']}, which blutensor "
                             f"does not have (it has {', '.join(_ST_DTYPES)})")
        dt = as_dtype(dt_name)
        arrays[name] = (np.frombuffer(bytes(spec["data"]), dtype=dt.np).reshape(spec["shape"]).copy(), dt)

    def where_to(saved: str):
        if map_location is None:
            return saved
        if isinstance(map_location, dict):
            return map_location.get(saved, saved)
        if callable(map_location):
            raise DTypeError("blutensor.load: map_location must be None, a device or a dict, not a function")
        return str(device(map_location)) if not isinstance(map_location, device) else str(map_location)

    def make(name: str, saved_dev: str = "cpu", requires_grad: bool = False):
        if name not in arrays:
            raise BluTensorError(f"blutensor.load: {src} names a tensor '{name}' that is not in its tensor table")
        arr, dt = arrays[name]
        out = _tensor_of(arr, dtype=dt)
        dev = where_to(saved_dev)
        if dev != "cpu":
            out = out.to(dev)
        return out.requires_grad_(True) if requires_grad and dt.is_floating_point else out

    meta = (header.get("__metadata__") or {}).get(_META_KEY)
    if meta is None:  # a foreign safetensors file: its tensors, by name
        return {name: make(name) for name in arrays}
    doc = json.loads(meta)
    if doc.get("format") != _FORMAT:
        raise BluTensorError(f"blutensor.load: {src} was written in format {doc.get('format')!r}; this blutensor "
                             f"reads format {_FORMAT}")

    def decode(node):
        if node is None or isinstance(node, bool | int | float | str):
            return node
        if "tensor" in node:
            return make(node["tensor"], node.get("device", "cpu"), node.get("requires_grad", False))
        if "dict" in node:
            return {k: decode(v) for k, v in node["dict"]}
        if "list" in node:
            return [decode(v) for v in node["list"]]
        if "tuple" in node:
            return tuple(decode(v) for v in node["tuple"])
        if "float" in node:
            return float(node["float"])
        if "dtype" in node:
            return as_dtype(node["dtype"])
        if "device" in node:
            return device(node["device"])
        raise BluTensorError(f"blutensor.load: {src} holds an entry this blutensor cannot read: {node!r:.80}")

    return decode(doc["obj"])
