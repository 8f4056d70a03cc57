"""Module: parameters, buffers and submodules; state_dict with strict key and shape checks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import NamedTuple

from blutensor._tensor import Tensor
from blutensor.autograd.grad_mode import no_grad
from blutensor.errors import BluTensorError, DTypeError, ShapeError
from blutensor.nn.parameter import Parameter


class _IncompatibleKeys(NamedTuple):
    """What ``load_state_dict`` returns: the model's keys the state lacked, and the state's extra keys."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class Module:
    """Base class of layers and models (PyTorch's semantics for the common surface)."""

    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "training", True)

    # ---- registration ----
    def __setattr__(self, name, value):
        if "_parameters" not in self.__dict__:
            raise BluTensorError(f"{type(self).__name__}: call super().__init__() before assigning attributes")
        if name in self._buffers and (value is None or isinstance(value, Tensor)):
            self._buffers[name] = value
            return
        if name in self._parameters and value is not None and not isinstance(value, Tensor):
            raise DTypeError(f"{type(self).__name__}: cannot assign a {type(value).__name__} to parameter '{name}' "
                             f"(a Parameter or None expected)")
        for d in (self._parameters, self._buffers, self._modules):
            d.pop(name, None)
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        else:
            object.__setattr__(self, name, value)
            return
        self.__dict__.pop(name, None)

    def __getattr__(self, name):
        d = self.__dict__
        for store in ("_parameters", "_buffers", "_modules"):
            s = d.get(store)
            if s is not None and name in s:
                return s[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name):
        for d in (self._parameters, self._buffers, self._modules):
            if name in d:
                del d[name]
                return
        object.__delattr__(self, name)

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        if param is not None and not isinstance(param, Parameter):
            raise DTypeError(f"{type(self).__name__}.register_parameter: '{name}' must be a Parameter or None, got "
                             f"{type(param).__name__}")
        self._parameters[name] = param

    def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
        if tensor is not None and not isinstance(tensor, Tensor):
            raise DTypeError(f"{type(self).__name__}.register_buffer: '{name}' must be a Tensor or None, got "
                             f"{type(tensor).__name__}")
        self._buffers[name] = tensor
        if not persistent:
            self.__dict__.setdefault("_non_persistent", set()).add(name)

    def register_module(self, name: str, module: Module | None) -> None:
        self.add_module(name, module)

    def add_module(self, name: str, module: Module) -> None:
        if module is not None and not isinstance(module, Module):
            raise DTypeError(f"{type(self).__name__}: submodule '{name}' must be a Module or None, got "
                             f"{type(module).__name__}")
        self._modules[name] = module

    # ---- traversal ----
    def named_modules(self, prefix: str = "", memo=None) -> Iterator[tuple[str, Module]]:
        memo = set() if memo is None else memo
        if id(self) in memo:
            return
        memo.add(id(self))
        yield prefix, self
        for name, m in self._modules.items():
            if m is not None:
                yield from m.named_modules(f"{prefix}.{name}" if prefix else name, memo)

    def get_submodule(self, target: str) -> Module:
        """The submodule at dotted path ``target`` ('' is the module itself)."""
        mod = self
        for i, part in enumerate(target.split(".") if target else []):
            sub = mod._modules.get(part)
            if sub is None:
                raise AttributeError(f"{type(mod).__name__} has no submodule '{part}' (in '{target}', at "
                                     f"'{'.'.join(target.split('.')[:i + 1])}')")
            mod = sub
        return mod

    def get_parameter(self, target: str) -> Parameter:
        path, _, name = target.rpartition(".")
        mod = self.get_submodule(path)
        if name not in mod._parameters or mod._parameters[name] is None:
            raise AttributeError(f"{type(mod).__name__} has no parameter '{name}' (in '{target}')")
        return mod._parameters[name]

    def get_buffer(self, target: str) -> Tensor:
        path, _, name = target.rpartition(".")
        mod = self.get_submodule(path)
        if name not in mod._buffers or mod._buffers[name] is None:
            raise AttributeError(f"{type(mod).__name__} has no buffer '{name}' (in '{target}')")
        return mod._buffers[name]

    def modules(self) -> Iterator[Module]:
        for _, m in self.named_modules():
            yield m

    def children(self) -> Iterator[Module]:
        yield from (m for m in self._modules.values() if m is not None)

    def named_children(self):
        yield from ((n, m) for n, m in self._modules.items() if m is not None)

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, Parameter]]:
        seen = set()
        mods = self.named_modules(prefix) if recurse else [(prefix, self)]
        for mp, m in mods:
            for n, p in m._parameters.items():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))  # tied parameters are listed once
                yield (f"{mp}.{n}" if mp else n), p

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
        for mp, m in self.named_modules(prefix):
            for n, b in m._buffers.items():
                if b is not None:
                    yield (f"{mp}.{n}" if mp else n), b

    def buffers(self) -> Iterator[Tensor]:
        for _, b in self.named_buffers():
            yield b

    # ---- modes, devices ----
    def train(self, mode: bool = True) -> Module:
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> Module:
        return self.train(False)

    def apply(self, fn) -> Module:
        for m in self.children():
            m.apply(fn)
        fn(self)
        return self

    def to(self, *args, **kwargs) -> Module:
        """Move/cast parameters and buffers in place (Parameter objects keep their identity)."""
        for m in self.modules():
            for d in (m._parameters, m._buffers):
                for t in d.values():
                    if t is None:
                        continue
                    new = t.detach().to(*args, **kwargs)
                    if not t.dtype.is_floating_point and new.dtype is not t.dtype:
                        new = t.detach().to(*[a for a in args if not _is_dtype(a)],
                                            **{kk: v for kk, v in kwargs.items() if kk != "dtype"})
                    t._data, t.dtype, t.device = new._data, new.dtype, new.device
                    if t.grad is not None:
                        g = t.grad.to(new.device).to(new.dtype)
                        t.grad = g
        return self

    def cuda(self, index: int = 0) -> Module:
        return self.to(f"cuda:{index}")

    def cpu(self) -> Module:
        return self.to("cpu")

    def float(self) -> Module:
        return self.to("float32")

    def double(self) -> Module:
        return self.to("float64")

    def bfloat16(self) -> Module:
        return self.to("bfloat16")

    def half(self) -> Module:
        return self.to("float16")

    def requires_grad_(self, requires_grad: bool = True) -> Module:
        """Set ``requires_grad`` on every parameter (e.g. to freeze a pretrained part)."""
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad._data.fill(0)

    # ---- state ----
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False) -> OrderedDict:
        """Parameters and persistent buffers by dotted name (tied tensors under each name), detached unless
        ``keep_vars``; added to ``destination`` when one is given."""
        if args:  # state_dict(prefix) positionally, as earlier versions took it
            prefix = args[0]
        out = OrderedDict() if destination is None else destination
        for mp, m in self.named_modules(prefix, memo=None):
            np_ = m.__dict__.get("_non_persistent", set())
            for n, p in m._parameters.items():
                if p is not None:
                    out[f"{mp}.{n}" if mp else n] = p if keep_vars else p.detach()
            for n, b in m._buffers.items():
                if b is not None and n not in np_:
                    out[f"{mp}.{n}" if mp else n] = b if keep_vars else b.detach()
        return out

    def load_state_dict(self, state: dict, strict: bool = True):
        """Copy tensors into parameters/buffers; strict: exact key set; shapes must match. Returns
        ``(missing_keys, unexpected_keys)`` as a NamedTuple, as PyTorch does."""
        if not hasattr(state, "keys") or not hasattr(state, "items"):
            raise DTypeError(f"load_state_dict({type(self).__name__}): expected a dict of name -> Tensor, got "
                             f"{type(state).__name__}")
        own = self.state_dict()
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict({type(self).__name__}): missing keys {missing}, "
                           f"unexpected keys {unexpected}")
        pairs = [(own[k], v) for k, v in state.items() if k in own]
        for k, v in state.items():  # every entry checked before the first copy: a bad one changes nothing
            if k not in own:
                continue
            dst = own[k]
            if not hasattr(v, "shape"):
                raise DTypeError(f"load_state_dict({type(self).__name__}): '{k}' is a {type(v).__name__}, expected "
                                 f"a Tensor or an array")
            shape = tuple(v.shape)
            if shape != tuple(dst.shape):
                raise ShapeError(f"load_state_dict({type(self).__name__}): '{k}' has shape {shape} in the state "
                                 f"dict but {tuple(dst.shape)} in the model")
        with no_grad():
            for dst, v in pairs:
                dst.copy_(v if isinstance(v, Tensor) else Tensor(v, dtype=dst.dtype))
        return _IncompatibleKeys(missing, unexpected)

    # ---- call ----
    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} does not implement forward()")

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for n, m in self._modules.items():
            lines.append(f"  ({n}): " + repr(m).replace("\n", "\n  "))
        return lines[0] + (")" if len(lines) == 1 else "\n" + "\n".join(lines[1:]) + "\n)")

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _is_dtype(a) -> bool:
    from blutensor.dtypes import dtype

    return isinstance(a, dtype) or (isinstance(a, str) and a not in ("cpu",) and not a.startswith("cuda"))
