"""Array backends (blutensor.backends): registered through the plugin host's ``backend`` kind and found there by
name, device or array; their device predicates, kernels and the cuda backend's allocator hook (on the fake CUDA
device here, on a GPU in the ``cuda``-marked twin)."""

from __future__ import annotations

import sys
from pathlib import Path

import blutensor as bt
import numpy as np
import pytest
from blutensor.backends import Backend
from blutensor.backends.cupy import CupyBackend
from blutensor.backends.numpy import NumpyBackend
from blutensor.plugin import PluginError, hookimpl, reset_host

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "testing"))
import fake_cuda  # noqa: E402


@pytest.fixture
def host():
    """A fresh plugin host with blutensor's own plugins only; the process-wide one is rebuilt afterwards."""
    h = reset_host(autoload=False)
    yield h
    CupyBackend.uninstall_allocator()
    reset_host()


def test_builtin_backends_are_registered_through_the_plugin_host(host):
    recs = {r.name: r for r in host.registry("backend")}
    assert set(recs) == {"cpu", "cuda"}
    assert recs["cpu"].cls is NumpyBackend and recs["cuda"].cls is CupyBackend
    assert {r.package for r in recs.values()} == {"blutensor"}
    assert all(issubclass(r.cls, Backend) for r in recs.values())
    assert bt.backends.names() == ["cpu", "cuda"]
    assert bt.backends.get("cpu") is NumpyBackend and bt.backends.get("cuda") is CupyBackend
    assert bt.backends.get("cuda:1") is CupyBackend and bt.backends.get(bt.device("cpu")) is NumpyBackend
    assert NumpyBackend.is_available() and NumpyBackend.module() is np


def test_each_backends_kernels_are_registered_for_its_device_type(host):
    kernels = {r.cls for r in host.registry("kernel")}
    for backend in (NumpyBackend, CupyBackend):
        classes = backend.kernel_classes()
        assert classes and set(classes) <= kernels
        assert {c.BACKEND for c in classes} == {backend.DEVICE_TYPE}


class ToyArray:
    """A third-party backend's array type: a host buffer in a wrapper."""

    def __init__(self, a):
        self.a = np.asarray(a)


class ToyBackend(Backend):
    PLUGIN_NAME = "toy"
    DEVICE_TYPE = "cpu"

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def module(cls, dev=None):
        return np

    @classmethod
    def owns(cls, arr) -> bool:
        return isinstance(arr, ToyArray)

    @classmethod
    def device_of(cls, arr):
        if not cls.owns(arr):
            raise cls._not_mine(arr)
        return bt.device("cpu")


class ToyPlugin:
    @hookimpl
    def blutrain_register_backends(self):
        return [ToyBackend]


def test_a_third_party_backend_is_found_by_name_and_by_its_arrays(host):
    host.register(ToyPlugin(), name="toy-backend", package="toy-pkg", version="1.2")
    rec = next(r for r in host.records() if r.kind == "backend" and r.name == "toy")
    assert (rec.cls, rec.package, rec.version) == (ToyBackend, "toy-pkg", "1.2")
    assert bt.backends.names() == ["cpu", "cuda", "toy"]
    assert bt.backends.get("toy") is ToyBackend
    assert bt.backends.get("cpu") is NumpyBackend  # a device type still maps to blutensor's own backend
    assert bt.backends.for_array(ToyArray([1.0])) is ToyBackend
    assert bt.backends.for_array(np.zeros(2)) is NumpyBackend
    with pytest.raises(bt.ArgumentError, match="'toy' holds cpu arrays, not a numpy.ndarray"):
        ToyBackend.device_of(np.zeros(2))


def test_malformed_backends_and_names_are_refused_by_name(host):
    class NoOwns:
        PLUGIN_NAME = "broken"
        DEVICE_TYPE = "cpu"

        @classmethod
        def is_available(cls):
            return True

    class Bad:
        @hookimpl
        def blutrain_register_backends(self):
            return [NoOwns]

    with pytest.raises(PluginError, match=r"backend plugin .*NoOwns.* from bad-pkg lacks module, owns, device_of"):
        host.register(Bad(), name="bad", package="bad-pkg")
    with pytest.raises(PluginError, match=r"no backend named 'tpu' and none for device type 'tpu'; registered: "
                                          r"cpu \(device cpu\), cuda \(device cuda\)"):
        bt.backends.get("tpu")
    with pytest.raises(ValueError, match="bad device 'cuda:x'"):
        bt.backends.get("cuda:x")
    with pytest.raises(bt.ArgumentError, match="takes a backend name or a device, got int 3"):
        bt.backends.get(3)
    with pytest.raises(bt.ArgumentError, match="no backend holds arrays of type builtins.list"):
        bt.backends.for_array([1, 2])
    with pytest.raises(bt.DeviceError, match="backend 'cpu' .* takes no allocator plugin; allocator 'caching'"):
        NumpyBackend.install_allocator("caching")
    with pytest.raises(bt.DeviceError, match="the cpu backend holds no arrays of device cuda:0"):
        NumpyBackend.module(bt.device("cuda"))


def test_device_predicates_tell_numpy_from_cupy_arrays(monkeypatch):
    cp = fake_cuda.make_cupy(distinct_arrays=True)
    d = cp.asarray(np.arange(3.0))
    h = np.arange(3.0)
    assert NumpyBackend.owns(h) and not NumpyBackend.owns(d) and NumpyBackend.owns(np.float32(1))
    assert CupyBackend.owns(d) and not CupyBackend.owns(h)
    assert CupyBackend.device_of(d) == bt.device("cuda:0") and NumpyBackend.device_of(h) == bt.device("cpu")
    with pytest.raises(bt.ArgumentError, match="'cuda' holds cuda arrays, not a numpy.ndarray"):
        CupyBackend.device_of(h)
    with pytest.raises(bt.ArgumentError, match="'cpu' holds cpu arrays, not a cupy.DistinctArray"):
        NumpyBackend.device_of(d)
    assert bt.backends.for_array(d) is CupyBackend and bt.backends.for_array(h) is NumpyBackend


def test_cupy_backend_without_cupy_says_how_to_install_it(monkeypatch):
    import blutensor.backends.cupy as cb

    monkeypatch.setattr(cb, "_cupy", None)
    monkeypatch.setattr(cb, "_cupy_error", "ImportError: No module named 'cupy'")
    assert not CupyBackend.is_available()
    with pytest.raises(bt.DeviceError,
                       match=r"device cuda:0 requested but CuPy is not available .*blutensor\[cuda12\]"):
        CupyBackend.module(bt.device("cuda"))
    with pytest.raises(bt.DeviceError, match="CuPy is not available"):
        bt.zeros(2, device="cuda")


class _Recorder:
    events: list[str] = []


def _allocator(name: str, available: bool = True):
    class Alloc:
        PLUGIN_NAME = name

        @classmethod
        def is_available(cls):
            return available

        @classmethod
        def install(cls, **kwargs):
            _Recorder.events.append(f"{name}.install{sorted(kwargs)}")
            return f"{name}-allocator"

        @classmethod
        def uninstall(cls):
            _Recorder.events.append(f"{name}.uninstall")

        @classmethod
        def memory_stats(cls):
            return {"allocated_bytes": len(name), "reserved_bytes": 100}

    return Alloc


def test_cupy_backend_installs_allocator_plugins_in_order(host, monkeypatch):
    import blutensor.backends.cupy as cb

    cp = fake_cuda.install(monkeypatch)
    monkeypatch.setattr(cb, "_cupy", cp)
    monkeypatch.setattr(cb, "_cupy_error", None)
    a, b, off = _allocator("alloc-a"), _allocator("alloc-bb"), _allocator("alloc-off", available=False)

    class Allocs:
        @hookimpl
        def blutrain_register_allocators(self):
            return [a, b, off]

    host.register(Allocs(), name="allocs")
    _Recorder.events.clear()
    assert CupyBackend.allocator_plugin() is None
    cp.device.pool_used_bytes = 4096
    assert CupyBackend.memory_stats() == {"allocated_bytes": 4096, "reserved_bytes": 4096}  # CuPy's pool
    assert CupyBackend.install_allocator("alloc-a", rounding=1) == "alloc-a-allocator"
    assert CupyBackend.install_allocator("alloc-a") == "alloc-a-allocator"  # the same plugin: not uninstalled
    assert CupyBackend.install_allocator("alloc-bb") == "alloc-bb-allocator"
    assert CupyBackend.allocator_plugin() is b and CupyBackend.memory_stats()["allocated_bytes"] == len("alloc-bb")
    with pytest.raises(PluginError, match="no allocator plugin named 'alloc-c'"):
        CupyBackend.install_allocator("alloc-c")
    with pytest.raises(PluginError, match="allocator plugin 'alloc-off' is installed but not available"):
        CupyBackend.install_allocator("alloc-off")
    assert CupyBackend.allocator_plugin() is b  # a refused name leaves the installed one in place
    CupyBackend.uninstall_allocator()
    assert CupyBackend.allocator_plugin() is None
    assert _Recorder.events == ["alloc-a.install['rounding']", "alloc-a.install[]", "alloc-a.uninstall",
                                "alloc-bb.install[]", "alloc-bb.uninstall"]


def _roundtrip(backend, dev):
    """Values through the backend's own module and back, against a NumPy float64 reference."""
    x = np.random.default_rng(0).standard_normal((4, 5))
    xp = backend.module(dev)
    arr = xp.asarray(x.astype(np.float32))
    assert backend.owns(arr) and backend.device_of(arr) == dev and bt.backends.for_array(arr) is backend
    got = (xp.sum(arr * arr, axis=1)).astype(np.float64)
    got = got.get() if hasattr(got, "get") else got
    np.testing.assert_allclose(got, (x * x).sum(1), rtol=1e-5)
    t = bt.tensor(x.astype(np.float32), device=str(dev))
    assert bt.backends.for_array(t._data) is backend and backend.device_of(t._data) == t.device


def test_numpy_backend_roundtrip():
    _roundtrip(NumpyBackend, bt.device("cpu"))


@pytest.mark.cuda
def test_cupy_backend_roundtrip_and_pool_on_a_gpu():
    if not CupyBackend.is_available():
        pytest.skip("needs CuPy and a CUDA GPU")
    if issubclass(CupyBackend.module().ndarray, np.ndarray):
        pytest.skip("the fake CUDA device's arrays are NumPy arrays (tests/fake_device_plugin.py): needs real CuPy")
    _roundtrip(CupyBackend, bt.device("cuda:0"))
    xp = CupyBackend.module()
    keep = xp.ones(1 << 20, dtype=xp.float32)
    st, pool = CupyBackend.memory_stats(), CupyBackend.memory_pool()
    assert CupyBackend.memory_pool() is xp.get_default_memory_pool() and keep.nbytes == 4 << 20
    assert (st["allocated_bytes"], st["reserved_bytes"]) == (pool.used_bytes(), pool.total_bytes())
