"""The Tensor: an ndarray (NumPy or CuPy) plus dtype, device, version counter and autograd state.

Kept thin: every computation goes through :func:`blutensor.ops.dispatch.apply`; methods are
PyTorch-named conveniences over :mod:`blutensor.functional`.

The op methods, their in-place ``_`` forms and the operators (``+``, ``*``, ``**``, ``==``, ``~``, ...) are
generated from the op table's rows (``ops/table.py``, ``api=``) and installed by ``_bind_methods``. Written out
here are the ones with a quirk: ``__rsub__`` (``number - t`` as ``-t + number``), ``__matmul__`` /
``__rmatmul__`` (a non-Tensor operand is refused), ``__iadd__`` & co. (they call the overridable in-place
method), ``div_`` / ``clamp_`` / ``masked_fill_`` (in-place forms of hand-written functions: ``div``'s rounding
modes, ``clamp``'s bound checks, ``masked_fill``'s bool mask), ``view`` (a dtype argument is refused), the
fills (``fill_``, ``zero_``, ``copy_``, ``normal_``, ``uniform_``: storage writes, not ops), indexing, and the
metadata, conversion and autograd methods. Methods bound from hand-written functions are ``_METHOD_NAMES``.
"""

from __future__ import annotations

import numbers

import numpy as np

from blutensor import functional as F
from blutensor.autograd.grad_mode import STATE
from blutensor.autograd.node import AccumulateGrad
from blutensor.autograd.version import Version as _Version
from blutensor.backends import xp_of
from blutensor.device import CPU, as_device, device
from blutensor.dtypes import as_dtype, bfloat16, dtype, float32, float64, from_numpy_dtype, int32, int64
from blutensor.errors import ArgumentError, AutogradError, BluTensorError, DeviceError, DTypeError, ShapeError
from blutensor.ops.dispatch import apply


class Tensor:
    """An n-dimensional array with a dtype, a device and optional autograd history."""

    # Hot attributes live in slots; autograd state that most tensors never set is a class-level
    # default (an instance writes it into its __dict__ only when it has one), so creating a tensor
    # on the dispatch hot path sets five attributes.
    __slots__ = ("_data", "dtype", "device", "_version", "_base", "__weakref__", "__dict__")
    requires_grad = False
    grad = None
    grad_fn = None
    _hooks = None
    _post_hooks = None
    _acc = None
    __array_priority__ = 1000  # NumPy scalars defer to Tensor's operators

    def __init__(self, data, dtype=None, device=None, requires_grad: bool = False):
        src = tensor(data, dtype=dtype, device=device)
        self._init(src._data, src.dtype, src.device)
        self.requires_grad = bool(requires_grad)

    def _init(self, data, dt: dtype, dev: device) -> None:
        self._data = data
        self.dtype = dt
        self.device = dev
        self._version = _Version()
        self._base = None

    @classmethod
    def _from_data(cls, data, dt: dtype | None, dev: device) -> Tensor:
        """Wrap a raw NumPy/CuPy array without copying (dtype inferred when None)."""
        t = object.__new__(cls)
        t._data = data
        t.dtype = from_numpy_dtype(data.dtype) if dt is None else dt
        t.device = dev
        t._version = _Version()
        t._base = None
        return t

    @staticmethod
    def _wrap_grad(g, node) -> Tensor:
        """A gradient array as a Tensor (for hooks); uint16 gradients are bfloat16 bits on CUDA."""
        if type(g) is np.ndarray:
            return Tensor._from_data(g, None, CPU)
        return Tensor._from_data(g, bfloat16 if g.dtype == np.uint16 else None, as_device(f"cuda:{g.device.id}"))

    # ---- metadata ----
    @property
    def shape(self) -> tuple[int, ...]:
        return self._data.shape

    def size(self, dim: int | None = None):
        """The shape as a :class:`Size` (a tuple), or the size of ``dim``."""
        if dim is None:
            return Size(self._data.shape)
        if not -max(self.ndim, 1) <= dim < max(self.ndim, 1) or self.ndim == 0:
            raise ShapeError(f"size: dim {dim} out of range for {self._desc()}")
        return self._data.shape[dim]

    @property
    def ndim(self) -> int:
        return self._data.ndim

    def dim(self) -> int:
        return self._data.ndim

    def numel(self) -> int:
        return int(self._data.size)

    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the elements (numel * element_size), as PyTorch's ``Tensor.nbytes``."""
        return self.numel() * self.dtype.itemsize

    def stride(self, dim: int | None = None):
        st = tuple(s // self._data.itemsize for s in self._data.strides)
        return st if dim is None else st[dim]

    def is_contiguous(self) -> bool:
        return bool(self._data.flags.c_contiguous)

    @property
    def is_leaf(self) -> bool:
        return self.grad_fn is None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def data(self) -> Tensor:
        return self.detach()

    @data.setter
    def data(self, value: Tensor) -> None:
        if not isinstance(value, Tensor):
            raise TypeError(f"Tensor.data must be set to a Tensor, got {type(value).__name__}")
        self._data, self.dtype, self.device = value._data, value.dtype, value.device
        self._version.v += 1

    def _version_value(self) -> int:
        return self._version.v

    def _desc(self) -> str:
        return f"Tensor(shape={tuple(self.shape)}, dtype={self.dtype.name}, device={self.device})"

    def __repr__(self) -> str:
        body = np.array2string(self.numpy(), separator=", ", precision=4, threshold=50)
        extra = f", dtype={self.dtype.name}" if self.dtype is not float32 else ""
        if self.device.type != "cpu":
            extra += f", device='{self.device}'"
        if self.grad_fn is not None:
            extra += f", grad_fn={self.grad_fn!r}"
        elif self.requires_grad:
            extra += ", requires_grad=True"
        return f"tensor({body}{extra})"

    def __len__(self) -> int:
        if self.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError(f"iteration over a 0-d tensor ({self._desc()}); use .item()")
        for i in range(len(self)):
            yield self[i]

    def __bool__(self) -> bool:
        if self.numel() != 1:
            raise BluTensorError(f"the truth value of a tensor with {self.numel()} elements is ambiguous")
        return bool(self.item())

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __index__(self) -> int:
        return int(self.item())

    def __hash__(self) -> int:
        return id(self)

    def __format__(self, spec: str) -> str:
        """``f"{loss:.4f}"`` formats a one-element tensor's value; otherwise the repr."""
        if spec and self.numel() == 1:
            return format(self.item(), spec)
        return format(repr(self), spec)

    def __array__(self, dtype=None, copy=None):
        """``np.asarray(t)``: the values on the host (shared memory for CPU tensors, like numpy())."""
        a = self.numpy()
        if dtype is not None and np.dtype(dtype) != a.dtype:
            return a.astype(dtype)
        return a.copy() if copy else a

    # ---- conversion ----
    def numpy(self) -> np.ndarray:
        """The values as a NumPy array (a copy for CUDA tensors; shares memory on CPU)."""
        d = self._data
        if self.device.type == "cpu":
            return d
        host = d.get()
        if self.dtype is bfloat16:
            import ml_dtypes

            host = host.view(ml_dtypes.bfloat16)
        return host

    def item(self):
        if self.numel() != 1:
            raise ShapeError(f"item(): only one-element tensors can be converted, got shape {tuple(self.shape)}")
        v = self.numpy().reshape(-1)[0]
        return v.item() if hasattr(v, "item") and self.dtype is not bfloat16 else float(v)

    def tolist(self):
        return self.numpy().tolist() if self.dtype is not bfloat16 else self.numpy().astype(np.float32).tolist()

    def to(self, *args, **kwargs) -> Tensor:
        """Move and/or cast: ``to(device)``, ``to(dtype)``, ``to(device, dtype)``, ``to(other)``."""
        dev, dt = kwargs.get("device"), kwargs.get("dtype")
        for a in args:
            if isinstance(a, Tensor):
                dev, dt = a.device, a.dtype
            elif isinstance(a, dtype) or (isinstance(a, str) and a not in ("cpu",) and not a.startswith("cuda")):
                try:
                    dt = as_dtype(a)
                except DTypeError as e:
                    raise DTypeError(f"to: {a!r} is neither a device ('cpu', 'cuda', 'cuda:N') nor a dtype: "
                                     f"{e}") from None
            elif isinstance(a, np.dtype):
                dt = as_dtype(a)
            else:
                dev = a
        out = self
        if dt is not None and as_dtype(dt) is not self.dtype:
            out = F.cast(out, as_dtype(dt))
        if dev is not None and as_device(dev) != out.device:
            out = F.to_device(out, as_device(dev))
        return out

    def cpu(self) -> Tensor:
        return self.to("cpu")

    def cuda(self, index: int = 0) -> Tensor:
        return self.to(f"cuda:{index}")

    def float(self) -> Tensor:
        return self.to(float32)

    def double(self) -> Tensor:
        return self.to(float64)

    def bfloat16(self) -> Tensor:
        return self.to(bfloat16)

    def long(self) -> Tensor:
        return self.to(int64)

    def int(self) -> Tensor:
        return self.to(int32)

    def type_as(self, other: Tensor) -> Tensor:
        return self.to(other.dtype)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    # ---- autograd ----
    def backward(self, gradient: Tensor | None = None, retain_graph: bool = False) -> None:
        """Accumulate d(self)/d(leaf) into every leaf's ``.grad``."""
        from blutensor.autograd.engine import run_backward

        run_backward([self], [Tensor._default_grad(self, gradient)], retain_graph=retain_graph)

    @staticmethod
    def _default_grad(t: Tensor, gradient):
        if gradient is None:
            if t.numel() != 1:
                raise AutogradError(f"grad can be implicitly created only for scalar outputs; backward() on "
                                    f"{t._desc()} needs a gradient argument of the same shape")
            from blutensor.creation import ones

            return ones(*t.shape, dtype=t.dtype, device=t.device)._data
        if not isinstance(gradient, Tensor):
            gradient = tensor(gradient, dtype=t.dtype, device=t.device)
        if tuple(gradient.shape) != tuple(t.shape):
            raise ShapeError(f"backward: gradient {gradient._desc()} does not match the shape of {t._desc()}")
        if gradient.device != t.device or gradient.dtype is not t.dtype:
            raise DTypeError(f"backward: gradient {gradient._desc()} must have the dtype and device of "
                             f"{t._desc()}")
        return gradient._data

    def _acc_node(self) -> AccumulateGrad:
        if self._acc is None:
            self._acc = AccumulateGrad(self)
        return self._acc

    def detach(self) -> Tensor:
        """A tensor sharing storage (and version counter) with no autograd history."""
        t = Tensor._from_data(self._data, self.dtype, self.device)
        t._version = self._version
        return t

    def detach_(self) -> Tensor:
        self.grad_fn = None
        self.requires_grad = False
        return self

    def requires_grad_(self, requires_grad: bool = True) -> Tensor:
        if requires_grad and not self.dtype.is_floating_point:
            raise AutogradError(f"only floating-point tensors can require grad, got {self._desc()}")
        if self.grad_fn is not None and not requires_grad:
            raise AutogradError("requires_grad_(False) on a non-leaf tensor; use detach()")
        self.requires_grad = requires_grad
        return self

    def register_hook(self, hook):
        """Call ``hook(grad) -> Tensor | None`` whenever this tensor's gradient is computed."""
        if not callable(hook):
            raise DTypeError(f"register_hook: hook must be callable, got {type(hook).__name__}")
        if not self.requires_grad:
            raise AutogradError(f"cannot register a hook on {self._desc()}: it does not require grad")
        if self.grad_fn is not None:
            if self.grad_fn.hooks is None:
                self.grad_fn.hooks = []
            self.grad_fn.hooks.append(hook)
            lst = self.grad_fn.hooks
        else:
            if self._hooks is None:
                self._hooks = []
            self._hooks.append(hook)
            lst = self._hooks
        return _Handle(lst, hook)

    def register_post_accumulate_grad_hook(self, hook):
        """Call ``hook(tensor)`` on a leaf once its ``.grad`` for this backward is complete
        ("gradient ready"; distributed data parallel hangs its buckets on it)."""
        if not callable(hook):
            raise DTypeError(f"register_post_accumulate_grad_hook: hook must be callable, got {type(hook).__name__}")
        if self.grad_fn is not None:
            raise AutogradError("post-accumulate-grad hooks can only be registered on leaf tensors")
        if self._post_hooks is None:
            self._post_hooks = []
        self._post_hooks.append(hook)
        return _Handle(self._post_hooks, hook)

    def retain_grad(self) -> None:
        import weakref

        if self.grad_fn is not None:
            self.grad_fn.retained = weakref.ref(self)

    # ---- in-place ----
    def _inplace(self, op: str, *others, **attrs) -> Tensor:
        """Run ``op`` out of place and write the result into this tensor's storage; when the graph
        is being recorded, this tensor takes the result's grad_fn (PyTorch's rebase)."""
        graph = STATE.enabled and (self.requires_grad or any(isinstance(o, Tensor) and o.requires_grad
                                                                for o in others))
        if graph:
            if self.requires_grad and self.grad_fn is None:
                raise AutogradError(f"a leaf tensor that requires grad ({self._desc()}) is used in an in-place "
                                    f"op '{op}'; wrap it in no_grad() or clone() it first")
            if self._base is not None:
                raise AutogradError(f"in-place op '{op}' that needs a gradient on a view ({self._desc()}) is not "
                                    f"supported: the base would not see the graph; clone() the view, or write "
                                    f"into the base tensor directly")
            alias = Tensor._from_data(self._data.copy(), self.dtype, self.device)
            alias.grad_fn, alias.requires_grad = self.grad_fn, self.requires_grad
            res = apply(op, alias, *others, **attrs)
            self._write(res._data)
            self.grad_fn, self.requires_grad = res.grad_fn, res.requires_grad
        else:
            prev, STATE.enabled = STATE.enabled, False
            try:
                res = apply(op, self, *others, **attrs)
            finally:
                STATE.enabled = prev
            self._write(res._data)
        self._version.v += 1
        return self

    def _write(self, arr) -> None:
        if arr.shape != self._data.shape:
            raise ShapeError(f"in-place result of shape {tuple(arr.shape)} cannot be written into "
                             f"{self._desc()}")
        self._data[...] = arr

    def div_(self, other, *, rounding_mode: str | None = None) -> Tensor:
        """In-place ``div`` (``rounding_mode`` None, "trunc" or "floor"): the result is written into this tensor."""
        return _inplace_call(self, "div_", F.div, other, rounding_mode=rounding_mode)

    def clamp_(self, min=None, max=None) -> Tensor:  # noqa: A002
        """In-place ``clamp``: the result is written into this tensor."""
        return _inplace_call(self, "clamp_", F.clamp, min, max)

    def masked_fill_(self, mask, value) -> Tensor:
        F.bool_mask("masked_fill_", mask)
        return self._inplace("masked_fill", mask, value=_scalar(value))

    def zero_(self) -> Tensor:
        return self.fill_(0)

    def fill_(self, value) -> Tensor:
        self._check_plain_inplace("fill_")
        if isinstance(value, Tensor):
            value = value.item()
        elif not isinstance(value, numbers.Real | np.bool_):
            raise DTypeError(f"fill_: value must be a real number, got {type(value).__name__} {value!r:.40} "
                             f"(filling {self._desc()})")
        self._data[...] = _storage_scalar(value, self.dtype, self.device)
        self._version.v += 1
        return self

    def copy_(self, src: Tensor) -> Tensor:
        self._check_plain_inplace("copy_")
        if (isinstance(src, Tensor) and src.device.type == "cpu" and self.device.type == "cuda"
                and src.dtype == self.dtype and src.shape == self.shape and self._data.flags.c_contiguous):
            # host to device straight into this tensor's memory: one copy, no device temporary (a checkpoint
            # restore of a large model copies every parameter this way); bf16's host ml_dtypes storage goes as the
            # device's raw 16-bit storage
            self._data.set(np.ascontiguousarray(src._data).view(self._data.dtype))
            self._version.v += 1
            return self
        s = src.to(self.device).to(self.dtype) if isinstance(src, Tensor) else tensor(src, dtype=self.dtype,
                                                                                        device=self.device)
        try:
            self._data[...] = s._data
        except ValueError:
            raise ShapeError(f"copy_: cannot copy {s._desc()} into {self._desc()}") from None
        self._version.v += 1
        return self

    def normal_(self, mean: float = 0.0, std: float = 1.0, generator=None) -> Tensor:
        self._check_plain_inplace("normal_")
        if not std >= 0:
            raise ArgumentError(f"normal_: std must be >= 0, got {std} (filling {self._desc()})")
        from blutensor.creation import _normal_array

        self._data[...] = _normal_array(self.shape, self.dtype, self.device, generator, mean, std)
        self._version.v += 1
        return self

    def uniform_(self, a: float = 0.0, b: float = 1.0, generator=None) -> Tensor:
        self._check_plain_inplace("uniform_")
        if not a <= b:
            raise ArgumentError(f"uniform_: needs a <= b, got a={a}, b={b} (filling {self._desc()})")
        from blutensor.creation import _uniform_array

        self._data[...] = _uniform_array(self.shape, self.dtype, self.device, generator, a, b)
        self._version.v += 1
        return self

    def _check_plain_inplace(self, op: str) -> None:
        if STATE.enabled and self.requires_grad:
            raise AutogradError(f"{op} on {self._desc()} which requires grad; do it under no_grad()")

    def __setitem__(self, index, value) -> None:
        index = _index(index)
        if STATE.enabled and (self.requires_grad or (isinstance(value, Tensor) and value.requires_grad)):
            self._inplace("setitem", value if isinstance(value, Tensor) else _scalar(value),
                          index=_device_index(index, self.device))
            return
        if isinstance(value, Tensor):
            if value.device != self.device:
                raise DeviceError(f"setitem: value {value._desc()} is not on the device of {self._desc()}")
            v = value.to(self.dtype)._data
        else:
            v = _storage_scalar(value, self.dtype, self.device)
        try:
            split = _split_ints(index)
            if split is not None:  # ints select first, as in __getitem__: write through the basic view
                self._data[split[0]][_device_index(split[1], self.device)] = v
            else:
                self._data[_device_index(index, self.device)] = v
        except (IndexError, ValueError, TypeError) as e:
            vdesc = value._desc() if isinstance(value, Tensor) else repr(value)
            raise ShapeError(f"setitem: cannot assign {vdesc} to the selection {index!r} of {self._desc()}: "
                             f"{e}") from None
        self._version.v += 1

    def __getitem__(self, index) -> Tensor:
        """Basic indexing (ints, slices, None, ...) is a view; advanced indexing copies. Integers mixed with
        index arrays select first (PyTorch's order), so ``x[0, :, [1, 2]]`` is ``x[0][:, [1, 2]]``."""
        index = _index(index)
        if _is_basic(index):
            return apply("getitem", self, index=index)
        split = _split_ints(index)
        if split is not None:
            return apply("getitem", self, index=split[0])[split[1]]
        return apply("index", self, index=_device_index(index, self.device))

    # ---- operators: most are generated from the op table's rows (``_bind_methods``); these have a quirk ----
    def __rsub__(self, o):
        return apply("sub", _scalar(o), self) if isinstance(o, Tensor) else apply("add", apply("neg", self), o)

    def __matmul__(self, o):
        return apply("matmul", self, o if isinstance(o, Tensor) else _operand("matmul", o))

    def __rmatmul__(self, o):
        return apply("matmul", o if isinstance(o, Tensor) else _operand("matmul", o), self)

    def __iadd__(self, o):
        return self.add_(o)

    def __isub__(self, o):
        return self.sub_(o)

    def __imul__(self, o):
        return self.mul_(o)

    def __itruediv__(self, o):
        return self.div_(o)

    def __and__(self, o):
        return Tensor._from_data(self._data & _raw(o), None, self.device)

    def __or__(self, o):
        return Tensor._from_data(self._data | _raw(o), None, self.device)

    # ---- methods delegating to functional are bound below (_bind_methods) ----

    def view(self, *shape) -> Tensor:
        """A view with a new shape (no copy; errors when the strides do not allow one)."""
        if len(shape) == 1 and type(shape[0]) is not int:
            if isinstance(shape[0], dtype):
                raise DTypeError(f"view: reinterpreting {self._desc()} as {shape[0].name} is not supported; "
                                 f"use .to({shape[0].name}) to convert")
            shape = tuple(shape[0])
        return apply("view", self, shape=shape)

    @property
    def T(self) -> Tensor:  # noqa: N802
        return F.permute(self, tuple(reversed(range(self.ndim))))

    @property
    def mT(self) -> Tensor:  # noqa: N802
        return F.transpose(self, -2, -1)


class _Handle:
    """Removes a registered hook."""

    def __init__(self, lst, hook):
        self.lst, self.hook = lst, hook

    def remove(self) -> None:
        if self.hook in self.lst:
            self.lst.remove(self.hook)


def _scalar(o):
    if type(o) is float or type(o) is int or isinstance(o, Tensor):
        return o
    if isinstance(o, bool):
        return o
    if isinstance(o, numbers.Integral):
        return int(o)
    if isinstance(o, numbers.Real):
        return float(o)
    if isinstance(o, np.ndarray | list | tuple):
        raise DTypeError(f"operand {type(o).__name__} is not a Tensor or a Python number; wrap it with "
                         f"blutensor.tensor()")
    if isinstance(o, str | bytes | numbers.Complex | dict | set):
        raise DTypeError(f"operand {type(o).__name__} {o!r:.40} is not a Tensor or a real number")
    return o


def _operand(op: str, o):
    """Raise for a non-Tensor operand of an op that takes only tensors (matmul)."""
    raise DTypeError(f"{op}: expected a Tensor operand, got {type(o).__name__}; wrap it with blutensor.tensor()")


def _raw(o):
    return o._data if isinstance(o, Tensor) else o


def _index(index):
    if isinstance(index, Tensor):
        return index._data
    if isinstance(index, tuple):
        return tuple(i._data if isinstance(i, Tensor) else (np.asarray(i) if isinstance(i, list) else i)
                     for i in index)
    if isinstance(index, list):
        return np.asarray(index)
    return index


def _split_ints(index):
    """For a tuple mixing integer scalars with index arrays: (the basic part with the ints, the rest without
    them); None otherwise. NumPy would move the advanced dims to the front when a slice separates the int from
    the array; PyTorch applies the ints as selections first."""
    if not isinstance(index, tuple):
        return None
    ints = [isinstance(i, int | np.integer) and not isinstance(i, bool) for i in index]
    if not True in ints or all(ints):  # noqa: E713
        return None
    basic, rest = [], []
    for i, is_int in zip(index, ints):
        if is_int:
            basic.append(i)
        elif i is None or type(i) is slice:
            basic.append(i)
            rest.append(slice(None))
        elif i is Ellipsis:
            basic.append(i)
            rest.append(i)
        else:
            nd = getattr(i, "ndim", 1) if getattr(getattr(i, "dtype", None), "kind", "") == "b" else 1
            basic.extend([slice(None)] * nd)
            rest.append(i)
    return tuple(basic), tuple(rest)


def _is_basic(index) -> bool:
    """True for indices made only of ints, slices, None and Ellipsis (the result is a view)."""
    if type(index) is int or type(index) is slice:
        return True
    items = index if isinstance(index, tuple) else (index,)
    for i in items:
        if not (i is None or i is Ellipsis or type(i) is slice or isinstance(i, int | np.integer)
                and not isinstance(i, bool)):
            return False
    return True


def _device_index(index, dev):
    """Move NumPy index arrays to the GPU for CUDA tensors."""
    if dev.type == "cpu":
        return index
    xp = xp_of(dev)
    if isinstance(index, np.ndarray):
        return xp.asarray(index)
    if isinstance(index, tuple):
        return tuple(xp.asarray(i) if isinstance(i, np.ndarray) else i for i in index)
    return index


def _storage_scalar(value, dt: dtype, dev):
    """A Python scalar as it is stored for dtype ``dt`` on ``dev`` (bfloat16 bits on CUDA)."""
    if dt is bfloat16 and dev.type == "cuda":
        return int(np.asarray(value, dtype=bfloat16.np).view(np.uint16))
    return value


#: Tensor methods that are hand-written functions of ``functional`` / ``reshaping`` / ``sorting`` (argument logic
#: a table row does not express); the op table's rows generate the rest (``functional._generated_methods``)
_METHOD_NAMES = (
    "sum max min var std clamp reshape permute expand expand_as contiguous flatten split chunk masked_fill softmax "
    "log_softmax where tril triu gelu norm div view_as square prod allclose true_divide divide flip roll diagonal "
    "repeat repeat_interleave unbind movedim t sort topk cumsum cumprod cummax cummin scatter"
).split()


class Size(tuple):
    """A tensor's shape (PyTorch's torch.Size): a tuple of ints with ``numel()``."""

    __slots__ = ()

    def numel(self) -> int:
        n = 1
        for s in self:
            n *= s
        return n

    def __repr__(self) -> str:
        return f"blutensor.Size({list(self)})"


def _new_like(name):
    from blutensor import creation

    fn = getattr(creation, name)

    def method(self, *size, dtype=None, device=None, requires_grad: bool = False):
        return fn(*size, dtype=dtype or self.dtype, device=device or self.device, requires_grad=requires_grad)

    method.__name__ = f"new_{name}"
    method.__doc__ = f"A new {name} tensor of ``size`` with this tensor's dtype and device (unless given)."
    return method


def _new_full(self, size, fill_value, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """A new tensor of ``size`` filled with ``fill_value``, with this tensor's dtype and device."""
    from blutensor.creation import full

    return full(size, fill_value, dtype=dtype or self.dtype, device=device or self.device,
                requires_grad=requires_grad)


def _new_tensor(self, data, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """A new tensor from ``data`` with this tensor's dtype and device (unless given)."""
    return tensor(data, dtype=dtype or self.dtype, device=device or self.device, requires_grad=requires_grad)


def _inplace_call(self, op_name: str, fn, *args, **kwargs) -> Tensor:
    """``self.<op_name>(*args, **kwargs)``: ``fn(self, *args, **kwargs)`` written into this tensor's storage. With
    the graph recorded, ``fn`` runs on a copy and this tensor takes the result's grad_fn (PyTorch's rebase); a
    result type that cannot be cast to this tensor's dtype (float into int) raises, as in PyTorch."""
    graph = STATE.enabled and (self.requires_grad or any(isinstance(o, Tensor) and o.requires_grad
                                                            for o in args))
    if graph:
        if self.requires_grad and self.grad_fn is None:
            raise AutogradError(f"a leaf tensor that requires grad ({self._desc()}) is used in an in-place "
                                f"op '{op_name}'; wrap it in no_grad() or clone() it first")
        if self._base is not None:
            raise AutogradError(f"in-place op '{op_name}' that needs a gradient on a view ({self._desc()}) is "
                                f"not supported; clone() the view, or write into the base tensor directly")
        alias = Tensor._from_data(self._data.copy(), self.dtype, self.device)
        alias.grad_fn, alias.requires_grad = self.grad_fn, self.requires_grad
        res = fn(alias, *args, **kwargs)
    else:
        prev, STATE.enabled = STATE.enabled, False
        try:
            res = fn(self, *args, **kwargs)
        finally:
            STATE.enabled = prev
    if res.dtype is not self.dtype:
        from blutensor.dtypes import _category

        if _category(res.dtype) > _category(self.dtype):
            raise DTypeError(f"{op_name}: result type {res.dtype.name} cannot be cast to the in-place "
                             f"output {self._desc()}")
        res = res.to(self.dtype)
    self._write(res._data)
    if graph:
        self.grad_fn, self.requires_grad = res.grad_fn, res.requires_grad
    self._version.v += 1
    return self


def _inplace_method(op_name, fn_name):
    fn = getattr(F, fn_name)

    def method(self, *args, **kwargs):
        return _inplace_call(self, op_name, fn, *args, **kwargs)

    method.__name__ = op_name
    method.__qualname__ = f"Tensor.{op_name}"
    method.__doc__ = f"In-place ``{fn_name}``: the result is written into this tensor."
    return method


def _bind_methods() -> None:
    from blutensor import reshaping

    for name, fn in F._generated_methods.items():
        setattr(Tensor, name, fn)
    for name in _METHOD_NAMES:
        setattr(Tensor, name, getattr(F, name, None) or getattr(reshaping, name))
    for name in ("zeros", "ones", "empty"):
        setattr(Tensor, f"new_{name}", _new_like(name))
    Tensor.new_full = _new_full
    Tensor.new_tensor = _new_tensor
    Tensor.scatter_ = _inplace_method("scatter_", "scatter")


from blutensor.creation import tensor  # noqa: E402  (creation imports Tensor lazily)
from blutensor.ops import surface as _surface  # noqa: E402

_surface.bind(Tensor=Tensor, _scalar=_scalar, _inplace=_inplace_call)
_bind_methods()
