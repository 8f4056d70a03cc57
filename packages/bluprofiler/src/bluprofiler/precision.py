"""Precision logger: dump every forward output and gradient of one step, and compare two dumps.

Keys (stable across runs of the same code):

* ``"<call index>:<op>"``  every op output, in call order (BluTrain only; from the dispatch observer);
* ``"module:<name>"``       every module's output (``#2``, ``#3`` for later calls of the same module;
  ``.out<i>`` for element ``i > 0`` of a tuple output);
* ``"grad:<name>"``         parameter gradients by ``named_parameters`` name (after backward).

A dump is an ordered mapping key -> float array (bfloat16 widened to float32), saved as
``.safetensors`` or ``.npz`` with the key order kept. :class:`TorchPrecisionLogger` writes the same
``module:``/``grad:`` keys for a PyTorch model (duck-typed: it never imports torch) and an
:class:`Adapter` maps torch names to ours, so BluTrain vs PyTorch is one :func:`compare` call.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

ORDER_KEY = "__order__"


class PrecisionError(ValueError):
    """A dump file is unreadable or a comparison is impossible (unknown format, no common keys)."""


def _np_of(t: Any) -> np.ndarray | None:
    """A float64/float32/int host copy of a blutensor Tensor (None for non-tensors)."""
    if not hasattr(t, "_data") or not hasattr(t, "dtype"):
        return None
    a = t.numpy()
    if a.dtype.name == "bfloat16" or a.dtype == np.float16:
        a = a.astype(np.float32)
    return np.array(a, copy=True)


class _Dump:
    """Ordered key -> array store shared by the two loggers."""

    def __init__(self):
        self.tensors: OrderedDict[str, np.ndarray] = OrderedDict()
        self._module_calls: dict[str, int] = {}

    def put(self, key: str, arr: np.ndarray | None) -> None:
        if arr is not None:
            self.tensors[key] = arr

    def put_module(self, name: str, out: Any, to_np) -> None:
        c = self._module_calls[name] = self._module_calls.get(name, 0) + 1
        key = f"module:{name}" + (f"#{c}" if c > 1 else "")
        outs = out if isinstance(out, tuple | list) else (out,)
        for i, o in enumerate(outs):
            self.put(key if i == 0 else f"{key}.out{i}", to_np(o))

    def save(self, path: str | Path) -> Path:
        return save_dump(self.tensors, path)


class PrecisionLogger(_Dump):
    """``with PrecisionLogger(model) as log: loss = step(); loss.backward(); log.capture_grads(model)``.

    ops: record every op output under ``"<i>:<op>"``; modules: wrap each submodule's forward to
    record ``"module:<name>"`` (model required). Everything is restored on exit.
    """

    def __init__(self, model: Any = None, ops: bool = True, modules: bool = True):
        super().__init__()
        self.model, self.ops, self.modules = model, ops, modules
        self._index = 0
        self._wrapped: list[Any] = []

    def __enter__(self) -> PrecisionLogger:
        from blutensor import ext

        if self.ops:
            ext.add_op_observer(self._observe)
        if self.modules and self.model is not None:
            for name, m in self.model.named_modules():
                self._wrap(m, name or "<root>")
        return self

    def __exit__(self, *exc) -> None:
        from blutensor import ext

        ext.remove_op_observer(self._observe)
        for m in self._wrapped:
            m.__dict__.pop("forward", None)
        self._wrapped.clear()

    def _observe(self, op, inputs, attrs, run):
        i = self._index
        self._index += 1
        res = run()
        self.put(f"{i}:{op}", _np_of(res))
        return res

    def _wrap(self, m: Any, name: str) -> None:
        fwd = m.forward  # bound method of the class

        def forward(*args, **kwargs):
            out = fwd(*args, **kwargs)
            self.put_module(name, out, _np_of)
            return out

        m.__dict__["forward"] = forward
        self._wrapped.append(m)

    def capture_grads(self, model: Any, prefix: str = "grad:") -> None:
        """Record ``.grad`` of every parameter by name (call after backward)."""
        for n, p in model.named_parameters():
            if p.grad is not None:
                self.put(prefix + n, _np_of(p.grad))

    def capture(self, key: str, tensor: Any) -> None:
        """Record any tensor (a loss, an activation) under ``key``."""
        self.put(key, _np_of(tensor))


def _torch_np(t: Any) -> np.ndarray | None:
    if not hasattr(t, "detach") or not hasattr(t, "dtype"):
        return None
    t = t.detach().cpu()
    if str(t.dtype) in ("torch.bfloat16", "torch.float16"):
        t = t.float()
    return np.array(t.numpy(), copy=True)


class TorchPrecisionLogger(_Dump):
    """The same ``module:``/``grad:`` dump for a PyTorch model, via forward hooks (torch is never
    imported here: the model brings it)."""

    def __init__(self, model: Any):
        super().__init__()
        self.model = model
        self._handles: list[Any] = []

    def __enter__(self) -> TorchPrecisionLogger:
        for name, m in self.model.named_modules():
            n = name or "<root>"
            self._handles.append(m.register_forward_hook(
                lambda mod, inp, out, n=n: self.put_module(n, out, _torch_np)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def capture_grads(self, model: Any = None, prefix: str = "grad:") -> None:
        for n, p in (model or self.model).named_parameters():
            if p.grad is not None:
                self.put(prefix + n, _torch_np(p.grad))

    def capture(self, key: str, tensor: Any) -> None:
        self.put(key, _torch_np(tensor))


# ---- files ----

def _safetensors():
    try:
        import safetensors
        import safetensors.numpy  # noqa: F401
    except ImportError:
        raise PrecisionError("writing/reading .safetensors dumps needs safetensors: pip install "
                             "'bluprofiler[safetensors]' (or use a .npz path)") from None
    return safetensors

def save_dump(tensors: dict, path: str | Path) -> Path:
    """Write a dump as ``.safetensors`` (order in the metadata) or ``.npz`` (order in ``__order__``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    if path.suffix == ".safetensors":
        save_file = _safetensors().numpy.save_file

        save_file(arrays, str(path), metadata={ORDER_KEY: json.dumps(list(arrays))})
    elif path.suffix == ".npz":
        np.savez(path, **arrays, **{ORDER_KEY: np.array(list(arrays), dtype=str)})
    else:
        raise PrecisionError(f"save_dump: {path} must end in .safetensors or .npz")
    return path


def load_dump(path: str | Path) -> OrderedDict:
    """Read a dump written by :func:`save_dump`, in recording order."""
    path = Path(path)
    if not path.exists():
        raise PrecisionError(f"load_dump: {path} does not exist")
    if not path.is_file():
        raise PrecisionError(f"load_dump: {path} is not a file")
    if path.suffix not in (".safetensors", ".npz"):
        raise PrecisionError(f"load_dump: {path} is neither .safetensors nor .npz")
    try:
        return _load_dump(path)
    except PrecisionError:
        raise
    except Exception as e:  # noqa: BLE001 - NumPy/zipfile/safetensors each raise their own: name the file
        raise PrecisionError(f"load_dump: {path} ({path.stat().st_size} bytes) is not a readable "
                             f"{path.suffix[1:]} dump (empty, truncated or another format?): "
                             f"{type(e).__name__}: {e}") from None


def _load_dump(path: Path) -> OrderedDict:
    if path.suffix == ".safetensors":
        safe_open = _safetensors().safe_open

        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            keys = json.loads(meta[ORDER_KEY]) if ORDER_KEY in meta else list(f.keys())
            return OrderedDict((k, f.get_tensor(k)) for k in keys)
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            keys = [str(k) for k in z[ORDER_KEY]] if ORDER_KEY in z.files else [k for k in z.files]
            return OrderedDict((k, z[k]) for k in keys)
    raise PrecisionError(f"load_dump: {path} is neither .safetensors nor .npz")
