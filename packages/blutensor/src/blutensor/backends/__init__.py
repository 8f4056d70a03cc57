"""Array backends: where a device's arrays, kernels and memory come from.

Each device type has one backend, a plugin of the host's ``backend`` kind (``blutrain_register_backends``), a
subclass of :class:`Backend`:

- ``cpu``, :mod:`blutensor.backends.numpy`: NumPy arrays, the compiled C kernels of the training step
  (``kernels.c``, built at first use); host memory is NumPy's, no allocator plugin;
- ``cuda``, :mod:`blutensor.backends.cupy`: CuPy arrays (CuPy imported on first use), the CUDA kernels
  (``kernels/*.cu``), and the device allocator hook (CuPy's pool, or an allocator plugin such as
  bluallocator's ``caching``).

blutensor registers both through its own ``blutrain_register_backends`` hook exactly as a third-party package
registers one (an entry point in the ``blutrain`` group); ``blutrain plugins`` lists them. :func:`get` finds a
backend by name or device (``bt.backends.get("cuda")``, ``bt.backends.get(t.device)``), :func:`for_array` the one
an array belongs to. The array lookup the ops use on every call (:func:`array_module`, :func:`xp_of`) asks the
two built-in backends directly, without a registry lookup; bfloat16 <-> float32 conversion works on both.
``bt.backends.cuda.matmul.allow_tf32`` is PyTorch's TF32 flag (:mod:`.flags`, a view of the execution policy).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from blutensor.device import as_device, device
from blutensor.errors import ArgumentError, DeviceError


class Backend:
    """What a backend provides, as class methods (a backend is a class, never instantiated; the host registers it).

    Subclasses set ``PLUGIN_NAME`` (the name :func:`get` and ``blutrain plugins`` use) and ``DEVICE_TYPE`` (the
    device type whose arrays it holds) and implement :meth:`is_available`, :meth:`module`, :meth:`owns` and
    :meth:`device_of`; the host refuses a backend class that lacks one of them. :meth:`kernel_classes` lists the
    backend's op kernels (registered through the host's ``kernel`` kind, ``BACKEND`` = ``DEVICE_TYPE``); the
    allocator methods are for backends whose device memory can come from an allocator plugin.
    """

    PLUGIN_NAME: ClassVar[str] = ""
    DEVICE_TYPE: ClassVar[str] = ""

    @classmethod
    def is_available(cls) -> bool:
        """True when this backend can hold arrays here (its library imports and its device exists); never raises."""
        raise NotImplementedError(f"backend {cls.PLUGIN_NAME!r} does not implement is_available()")

    @classmethod
    def module(cls, dev: device | None = None) -> Any:
        """The array module (NumPy's interface) for ``dev`` (this backend's default device when None), imported on
        first use; a :class:`~blutensor.DeviceError` saying what is missing when it cannot be used."""
        raise NotImplementedError(f"backend {cls.PLUGIN_NAME!r} does not implement module()")

    @classmethod
    def owns(cls, arr: Any) -> bool:
        """True when ``arr`` is one of this backend's arrays."""
        raise NotImplementedError(f"backend {cls.PLUGIN_NAME!r} does not implement owns()")

    @classmethod
    def device_of(cls, arr: Any) -> device:
        """The device ``arr`` lives on (an :class:`~blutensor.ArgumentError` when it is not this backend's)."""
        raise NotImplementedError(f"backend {cls.PLUGIN_NAME!r} does not implement device_of()")

    @classmethod
    def kernel_classes(cls) -> list[type]:
        """The backend's op kernel classes (importing them loads no device library)."""
        return []

    @classmethod
    def install_allocator(cls, name: str, **kwargs: Any) -> Any:
        """Make this backend allocate through the allocator plugin ``name``; backends without device allocators
        refuse (NumPy allocates host memory itself)."""
        raise DeviceError(f"backend {cls.PLUGIN_NAME!r} ({cls.DEVICE_TYPE} arrays) takes no allocator plugin; "
                          f"allocator {name!r} not installed")

    @classmethod
    def allocator_plugin(cls) -> type | None:
        """The allocator plugin installed through :meth:`install_allocator` (None: the backend's own memory)."""
        return None

    @classmethod
    def memory_stats(cls, device: int | None = None) -> dict[str, Any] | None:
        """The device memory statistics of device index ``device`` (the current device when None):
        ``allocated_bytes``, ``reserved_bytes``, and ``peak_allocated_bytes`` / ``peak_reserved_bytes`` where the
        allocator keeps peaks; None where the backend keeps none (host memory)."""
        return None

    @classmethod
    def reset_peak_memory_stats(cls, device: int | None = None) -> None:
        """Restart the peaks of :meth:`memory_stats` from the current values; backends that keep no device
        memory statistics refuse."""
        raise DeviceError(f"backend {cls.PLUGIN_NAME!r} ({cls.DEVICE_TYPE} arrays) keeps no device memory "
                          f"statistics to reset")

    @classmethod
    def _not_mine(cls, arr: Any) -> ArgumentError:
        return ArgumentError(f"backend {cls.PLUGIN_NAME!r} holds {cls.DEVICE_TYPE} arrays, not a "
                             f"{type(arr).__module__}.{type(arr).__qualname__}")


def _registry():
    from blutensor.plugin.manager import get_host

    return get_host().registry("backend")


def names() -> list[str]:
    """The names of the registered backends (``["cpu", "cuda"]`` plus any installed backend plugin)."""
    return _registry().names()


def get(name: str | device) -> type[Backend]:
    """The registered backend named ``name`` (``"cpu"``, ``"cuda"`` or a plugin's ``PLUGIN_NAME``), or the backend
    of a device (``"cuda:1"``, a :class:`~blutensor.device`): blutensor's own for ``cpu`` and ``cuda``. A
    ``PluginError`` lists the registered names when there is none."""
    from blutensor.plugin.registry import PluginError

    reg = _registry()
    if isinstance(name, str) and name in reg:
        return reg.get(name)
    if isinstance(name, device) or (isinstance(name, str) and ":" in name):
        dtype = as_device(name).type  # a malformed device string is a ValueError naming it
    elif isinstance(name, str):
        dtype = name
    else:
        raise ArgumentError(f"backends.get() takes a backend name or a device, got {type(name).__name__} {name!r}")
    for rec in reg:
        if getattr(rec.cls, "DEVICE_TYPE", None) == dtype:
            return rec.cls
    raise PluginError(f"no backend named {name!r} and none for device type {dtype!r}; registered: "
                      + ", ".join(f"{r.name} (device {r.cls.DEVICE_TYPE})" for r in reg))


def for_array(arr: Any) -> type[Backend]:
    """The registered backend ``arr`` belongs to (:meth:`Backend.owns`); an ArgumentError naming its type when no
    backend holds such arrays."""
    reg = _registry()
    for rec in reg:
        if rec.cls.owns(arr):
            return rec.cls
    raise ArgumentError(f"no backend holds arrays of type {type(arr).__module__}.{type(arr).__qualname__}; "
                        f"registered backends: {', '.join(reg.names())}")


def xp_of(dev: device):
    """The array module for a device: NumPy for ``cpu``, else the CuPy backend's module (a DeviceError saying how to
    install CuPy when it cannot be used)."""
    if dev.type == "cpu":
        return np
    return CupyBackend.module(dev)


#: providers of array types other than NumPy's and CuPy's (a tracer's traced arrays): ``(array_type, provider)``
#: pairs, newest last (:func:`blutensor.ext.register_array_provider`); empty: one truthiness test off NumPy's path
array_providers: list = []


def array_provider(*arrays):
    """The newest registered provider whose array type one of ``arrays`` is, else None."""
    for typ, prov in reversed(array_providers):
        for a in arrays:
            if isinstance(a, typ):
                return prov
    return None


def array_module(arr):
    """NumPy or CuPy, whichever owns ``arr`` (a registered provider's module for its array type)."""
    if isinstance(arr, np.ndarray | np.generic):
        return np
    cp = cupy_module()
    if cp is not None and isinstance(arr, cp.ndarray):
        return cp
    if array_providers:
        prov = array_provider(arr)
        if prov is not None:
            return prov.module(arr)
    return np


def is_cuda_array(arr) -> bool:
    """True for a CuPy array (the ``cuda`` backend's; told by its type's module, so CuPy is not imported)."""
    return not isinstance(arr, np.ndarray | np.generic) and type(arr).__module__.startswith("cupy")


# ---- bfloat16 as raw 16-bit storage: exact widening and round-to-nearest-even narrowing ----
# On CuPy arrays each runs as one kernel of kernels/cast.cu (CuPy's integer-op chain is ~10 launches a narrowing);
# elsewhere (NumPy, a provider's arrays) as the integer ops below.

def _cuda_casts(xp):
    """backends/cupy/cast.py when ``xp`` is CuPy itself, else None."""
    if getattr(xp, "__name__", None) != "cupy":
        return None
    from blutensor.backends.cupy import cast

    return cast


def bf16_bits_to_f32(bits, xp):
    """uint16 bfloat16 bits -> float32 values (exact)."""
    k = _cuda_casts(xp)
    if k is not None:
        return k.to_f32(bits)
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def f32_to_bf16_bits(x, xp):
    """float32 values -> uint16 bfloat16 bits, rounding to nearest even (NaN kept NaN)."""
    k = _cuda_casts(xp)
    if k is not None:
        return k.to_bf16(xp.asarray(x, dtype=xp.float32))
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    rounded = (u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16
    nan = (u & xp.uint32(0x7FFFFFFF)) > xp.uint32(0x7F800000)
    out = xp.where(nan, (u >> 16) | xp.uint32(0x40), rounded)
    return out.astype(xp.uint16)


def bf16_add(a, b, xp):
    """bfloat16 bits ``a`` + ``b`` (one shape) added in float32, rounded to nearest even: one kernel on CuPy."""
    k = _cuda_casts(xp)
    if k is not None:
        return k.add_bf16(a, b)
    return f32_to_bf16_bits(bf16_bits_to_f32(a, xp) + bf16_bits_to_f32(b, xp), xp)


def bf16_sum0(parts, xp):
    """bfloat16 bits (G, ...) summed over axis 0 in float32, rounded to nearest even: one kernel on CuPy."""
    k = _cuda_casts(xp)
    if k is not None:
        return k.sum_slices_bf16(parts)
    acc = bf16_bits_to_f32(parts[0], xp) if len(parts) else xp.zeros(parts.shape[1:], dtype=xp.float32)
    for g in range(1, len(parts)):
        acc = acc + bf16_bits_to_f32(parts[g], xp)  # in order, as the kernel adds them
    return f32_to_bf16_bits(acc, xp)


from blutensor.backends import cupy, numpy  # noqa: E402  (the built-in backends; neither imports CuPy here)
from blutensor.backends.cupy import CupyBackend, cupy_module  # noqa: E402
from blutensor.backends.flags import cuda  # noqa: E402  (PyTorch's bt.backends.cuda.matmul.allow_tf32)
from blutensor.backends.numpy import NumpyBackend  # noqa: E402

__all__ = ["Backend", "CupyBackend", "NumpyBackend", "array_module", "bf16_add", "bf16_bits_to_f32", "bf16_sum0",
           "cuda", "cupy", "f32_to_bf16_bits", "for_array", "get", "is_cuda_array", "names", "numpy", "xp_of"]
