"""The ``cuda`` backend: CuPy arrays, the device allocator hook, and the CUDA kernels of the training step (loaders,
op kernel classes, fused optimizer and grad-norm).

:class:`CupyBackend` is what the plugin host registers (``bt.backends.get("cuda")``). CuPy is imported on first
use (:func:`cupy_module`; :func:`require_cuda` raises a DeviceError that says how to install it), never at
blutensor import. Device memory comes from CuPy's pool until an allocator plugin is installed through
:meth:`CupyBackend.install_allocator` (blumodels' ``train.allocator``; bluallocator registers ``caching``).
Kernel sources live in ``kernels/*.cu`` beside this file; nothing here imports CuPy until a kernel is launched.
Kernel classes (registered through blutensor's ``blutrain_register_kernels`` when CuPy is installed):
layer_norm, gelu, cross_entropy (fused classifier), embedding, rms_norm, rope, swiglu, sdpa (flash attention),
cast (fp32 <-> bf16), the widening fp32 + bf16 add and bf16 linear/matmul/bmm (GEMM provider at bf16 precision).
Free functions: ``adamw.multi_tensor_adamw``, ``norm.global_grad_norm``, ``norm.clip_grads_``.
"""

from __future__ import annotations

import importlib.util
import threading
from typing import Any

from blutensor.backends import Backend, is_cuda_array
from blutensor.device import as_device, device
from blutensor.errors import DeviceError

_cupy = None
_cupy_error: str | None = None
INSTALL_HINT = ("install CuPy for your CUDA version: pip install 'blutensor[cuda12]' (CUDA 12) "
                "or 'blutensor[cuda13]' (CUDA 13)")


def cupy_module():
    """CuPy, imported on first use; None when it is not installed."""
    global _cupy, _cupy_error
    if _cupy is None and _cupy_error is None:
        try:
            import cupy

            _cupy = cupy
        except Exception as e:  # ImportError, or a broken CUDA install
            _cupy_error = f"{type(e).__name__}: {e}"
    return _cupy


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one GPU."""
    cp = cupy_module()
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def require_cuda(dev: device | None = None):
    """CuPy, or a DeviceError that says how to install it."""
    cp = cupy_module()
    if cp is None:
        raise DeviceError(f"device {dev or 'cuda'} requested but CuPy is not available ({_cupy_error}); "
                          f"{INSTALL_HINT}")
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as e:
        raise DeviceError(f"device {dev or 'cuda'} requested but no CUDA driver/GPU is usable: {e}") from None
    if n == 0:
        raise DeviceError(f"device {dev or 'cuda'} requested but this machine has no CUDA GPU")
    if dev is not None and dev.index is not None and dev.index >= n:
        raise DeviceError(f"device {dev} requested but only {n} CUDA device(s) exist")
    return cp


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


_alloc_lock = threading.Lock()
_installed: list = []  # the allocator plugin class installed through CupyBackend.install_allocator (0 or 1 entry)


def _uninstall(plugin: type) -> None:
    undo = getattr(plugin, "uninstall", None)
    if undo is not None:
        undo()


#: how to get an allocator that keeps peaks (what the DeviceErrors about missing peaks suggest)
PEAKS_HINT = ("install one that does: bt.backends.get('cuda').install_allocator('caching') (bluallocator's "
              "caching allocator, which blumodels' train.allocator = 'blu' installs)")


def allocator_name(plugin: type | None) -> str:
    """How the errors name an allocator plugin (None: CuPy's own pool)."""
    return "CuPy's memory pool" if plugin is None else f"allocator plugin {getattr(plugin, 'PLUGIN_NAME', plugin)!r}"


def _on_device(cp: Any, fn: Any, device: int | None) -> Any:
    """``fn(device=device)`` when ``fn`` takes a ``device`` argument, else ``fn()`` with device index ``device``
    current (switched only when it is not already: a switch may create that GPU's context)."""
    import inspect

    try:
        takes_device = "device" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes_device = False
    if takes_device:
        return fn(device=device)
    if device is None or device == cp.cuda.runtime.getDevice():
        return fn()
    with cp.cuda.Device(device):
        return fn()


class CupyBackend(Backend):
    """CuPy arrays on NVIDIA GPUs (devices ``cuda:N``): available when CuPy imports and a GPU is present; device
    memory from CuPy's pool or an allocator plugin (:meth:`install_allocator`); op kernels: the fused CUDA kernels
    (:func:`kernel_classes`, :func:`bf16_kernel_classes`), registered everywhere (they import no CuPy), so the
    kernel set and ``blutrain plugins`` are the same on a CPU-only install."""

    PLUGIN_NAME = "cuda"
    DEVICE_TYPE = "cuda"

    @classmethod
    def is_available(cls) -> bool:
        return cuda_available()

    @classmethod
    def module(cls, dev: device | None = None) -> Any:
        """CuPy, checked to see ``dev`` (a DeviceError saying how to install CuPy, or that the GPU is missing)."""
        if dev is not None and dev.type != "cuda":
            raise DeviceError(f"the cuda backend holds no arrays of device {dev}")
        return require_cuda(dev)

    @classmethod
    def owns(cls, arr: Any) -> bool:
        return is_cuda_array(arr)

    @classmethod
    def device_of(cls, arr: Any) -> device:
        if not cls.owns(arr):
            raise cls._not_mine(arr)
        return as_device(f"cuda:{arr.device.id}")

    @classmethod
    def kernel_classes(cls) -> list[type]:
        """The CUDA op kernel classes, the bf16 (autocast) ones included (importing them imports no CuPy)."""
        return kernel_classes() + bf16_kernel_classes()

    @classmethod
    def memory_pool(cls) -> Any:
        """CuPy's default device memory pool (what allocates until an allocator plugin is installed)."""
        return require_cuda().get_default_memory_pool()

    @classmethod
    def install_allocator(cls, name: str, **kwargs: Any) -> Any:
        """Allocate CuPy's device memory through the allocator plugin ``name`` (``blutrain_register_allocators``;
        bluallocator's ``caching`` and ``cupy-default``): its ``install(**kwargs)`` runs and its result is returned
        (bluallocator's caching allocator, CuPy's pool). A plugin installed here before is uninstalled first. A
        PluginError names the plugin when it is not installed or not available on this machine."""
        from blutensor.plugin.manager import get_host

        plugin = get_host().registry("allocator").select(name)  # PluginError naming it when missing/unavailable
        with _alloc_lock:
            if _installed and _installed[0] is not plugin:
                _uninstall(_installed.pop())
            result = plugin.install(**kwargs)
            _installed[:] = [plugin]
        return result

    @classmethod
    def uninstall_allocator(cls) -> None:
        """Uninstall the allocator plugin installed through :meth:`install_allocator` (CuPy's pool again)."""
        with _alloc_lock:
            if _installed:
                _uninstall(_installed.pop())

    @classmethod
    def allocator_plugin(cls) -> type | None:
        return _installed[0] if _installed else None

    @classmethod
    def stats_plugin(cls) -> type | None:
        """The allocator plugin CuPy allocates through now: the one installed through :meth:`install_allocator`,
        else a registered plugin whose ``is_installed()`` says so (bluallocator installed directly, as blumodels'
        ``train.allocator = "blu"`` does); None: CuPy's own pool."""
        plugin = cls.allocator_plugin()
        if plugin is not None:
            return plugin
        from blutensor.plugin.manager import get_host

        for rec in get_host().registry("allocator"):
            probe = getattr(rec.cls, "is_installed", None)
            try:
                if probe is not None and probe():
                    return rec.cls
            except Exception:  # noqa: BLE001 - a broken plugin is not the one allocating
                continue
        return None

    @classmethod
    def memory_stats(cls, device: int | None = None) -> dict[str, Any] | None:
        """Statistics of device index ``device`` (the current device when None): the allocating plugin's
        ``memory_stats()`` (:meth:`stats_plugin`; bluallocator's has ``peak_allocated_bytes`` and
        ``peak_reserved_bytes``), else CuPy's pool: ``allocated_bytes`` (in use) and ``reserved_bytes`` (held from
        the driver), no peaks."""
        cp = require_cuda()
        plugin = cls.stats_plugin()
        if plugin is not None and hasattr(plugin, "memory_stats"):
            return _on_device(cp, plugin.memory_stats, device)

        def pool_stats() -> dict[str, Any]:
            pool = cp.get_default_memory_pool()
            return {"allocated_bytes": int(pool.used_bytes()), "reserved_bytes": int(pool.total_bytes())}

        return _on_device(cp, pool_stats, device)

    @classmethod
    def reset_peak_memory_stats(cls, device: int | None = None) -> None:
        """Restart the allocating plugin's peaks of device index ``device`` (current when None) from the current
        values (its ``reset_peak_stats()``); CuPy's pool keeps no peaks, and a DeviceError says so."""
        cp = require_cuda()
        plugin = cls.stats_plugin()
        reset = getattr(plugin, "reset_peak_stats", None) if plugin is not None else None
        if reset is None:
            raise DeviceError(f"reset_peak_memory_stats: {allocator_name(plugin)} keeps no peak memory statistics; "
                              f"{PEAKS_HINT}")
        _on_device(cp, reset, device)

    @classmethod
    def graph_allocator(cls) -> Any:
        """An installed allocator plugin's graph-capable allocator (``graph_pool()``: private pools for CUDA-graph
        capture), found through the plugin host (bluallocator's ``caching``); None when none is installed."""
        from blutensor.plugin.manager import get_host

        for rec in get_host().registry("allocator"):
            get = getattr(rec.cls, "graph_allocator", None)
            if get is None:
                continue
            try:
                alloc = get()
            except Exception:  # noqa: BLE001 - a broken plugin must not break capture: a private CuPy pool instead
                alloc = None
            if alloc is not None and hasattr(alloc, "graph_pool"):
                return alloc
        return None
