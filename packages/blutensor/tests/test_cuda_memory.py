"""``bt.cuda.memory_allocated`` / ``max_memory_allocated`` / ``memory_reserved`` / ``max_memory_reserved`` /
``reset_peak_memory_stats`` mean what torch.cuda's mean: allocated = the blocks of live arrays, reserved = what the
allocator holds from the driver (its cache included), peaks per device until reset.

The same allocation sequence runs on the shared fake CUDA device (two GPUs, bluallocator's caching allocator over
simulated memory) and, marked ``cuda``, on a real GPU; both must read the numbers the caching rules give."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import blutensor as bt
import blutensor.backends.cupy as cb
import numpy as np
import pytest
from blutensor.backends.cupy import CupyBackend
from blutensor.plugin.manager import reset_host
from conftest import HAS_CUDA

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "testing"))
import fake_cuda  # noqa: E402

MiB = 1 << 20

#: (reading, allocated, peak allocated, reserved, peak reserved) on device 0, in MiB, after each step of
#: _sequence under bluallocator's rules: requests under 10 MiB share one 20 MiB segment, freed blocks stay cached
EXPECTED = [
    ("4 MiB live", 4, 4, 20, 20),
    ("+6 MiB live", 10, 10, 20, 20),
    ("both freed", 0, 10, 20, 20),
    ("peaks reset", 0, 0, 20, 20),
    ("2 MiB live", 2, 2, 20, 20),
]
#: device 1 after one 1 MiB request (a small block: one 2 MiB small segment), device 0 unchanged
EXPECTED_DEVICE1 = (1, 1, 2, 2)


def _read(device=None) -> tuple[int, int, int, int]:
    return tuple(f(device) // MiB for f in (bt.cuda.memory_allocated, bt.cuda.max_memory_allocated,
                                            bt.cuda.memory_reserved, bt.cuda.max_memory_reserved))


def _sequence(empty, device_ctx, two_devices: bool) -> tuple[list, tuple | None, tuple]:
    """Allocate and free the known sequence; ``empty(nbytes)`` makes a device buffer, ``device_ctx(i)`` makes GPU i
    current. Returns the readings of device 0 after each step, of device 1, and of device 0 at the end."""
    out = []
    x = empty(4 * MiB)
    out.append(("4 MiB live", *_read()))
    y = empty(6 * MiB)
    out.append(("+6 MiB live", *_read(0)))
    del x, y
    gc.collect()
    out.append(("both freed", *_read("cuda")))
    bt.cuda.reset_peak_memory_stats()
    out.append(("peaks reset", *_read(bt.device("cuda:0"))))
    z = empty(2 * MiB)
    out.append(("2 MiB live", *_read("cuda:0")))
    dev1 = None
    if two_devices:
        with device_ctx(1):
            w = empty(MiB)
        dev1 = _read(1)
        assert _read("cuda:1") == _read(bt.device("cuda:1")) == dev1
    end = _read(0)
    del z
    if two_devices:
        del w
    gc.collect()
    return out, dev1, end


@pytest.fixture
def fake_gpus(monkeypatch):
    """Two fake GPUs over simulated memory, bluallocator installed directly (as blumodels' train.allocator="blu"
    installs it), found through the plugin host."""
    bluallocator = pytest.importorskip("bluallocator")
    from bluallocator import hooks

    cp = fake_cuda.install(monkeypatch, memory=bluallocator.FakeDeviceBackend(256 * MiB), device_count=2)
    monkeypatch.setattr(cb, "_cupy", cp)
    monkeypatch.setattr(cb, "_cupy_error", None)
    host = reset_host(autoload=False)
    host.register(hooks, name="bluallocator")
    bluallocator.uninstall()
    for i in range(2):  # fresh allocators on this fake device
        bluallocator.install(bluallocator.CachingAllocator(bluallocator.CudaBackend(i)))
    try:
        yield cp
    finally:
        gc.collect()
        bluallocator.uninstall()
        reset_host()


def test_peaks_of_allocated_and_reserved_follow_the_caching_rules_per_device(fake_gpus):
    cp = fake_gpus
    readings, dev1, end = _sequence(lambda n: cp.empty(n, dtype=np.uint8), cp.cuda.Device, True)
    assert readings == EXPECTED
    assert dev1 == EXPECTED_DEVICE1 and end == EXPECTED[-1][1:]
    assert bt.cuda.max_memory_allocated(0) < bt.cuda.max_memory_reserved(0), "the cache holds freed blocks"
    bt.cuda.reset_peak_memory_stats(1)  # device 1's peaks restart from its current values, device 0's stay
    assert _read(1) == (0, 0, 2, 2) and _read(0) == (0, 2, 20, 20)


def test_the_device_argument_is_checked(fake_gpus):
    for bad, err, msg in ((2, bt.DeviceError, "memory_allocated: device 2 does not exist .*2 CUDA device"),
                          ("cpu", bt.ArgumentError, "memory_allocated: expected a CUDA device, got cpu"),
                          ("gpu:0", bt.ArgumentError, "memory_allocated: bad device 'gpu:0'"),
                          (1.0, bt.DTypeError, "memory_allocated: device must be None, an int"),
                          (True, bt.DTypeError, "memory_allocated: device must be")):
        with pytest.raises(err, match=msg):
            bt.cuda.memory_allocated(bad)
    with pytest.raises(bt.DeviceError, match="reset_peak_memory_stats: device -1 does not exist"):
        bt.cuda.reset_peak_memory_stats(-1)


def test_cupy_pool_reports_current_bytes_and_refuses_peaks(monkeypatch):
    cp = fake_cuda.install(monkeypatch)
    monkeypatch.setattr(cb, "_cupy", cp)
    monkeypatch.setattr(cb, "_cupy_error", None)
    reset_host(autoload=False)
    try:
        cp.device.pool_used_bytes = 3 * MiB
        assert bt.cuda.memory_allocated() == bt.cuda.memory_reserved() == 3 * MiB
        for fn in (bt.cuda.max_memory_allocated, bt.cuda.max_memory_reserved, bt.cuda.reset_peak_memory_stats):
            with pytest.raises(bt.DeviceError, match="CuPy's memory pool keeps no peak.*install_allocator.'caching'"):
                fn()
    finally:
        reset_host()


class _PerDevicePlugin:
    """A third-party allocator whose memory_stats() takes no device: it reports the current device's numbers."""

    PLUGIN_NAME = "per-device"
    CP = None
    resets: list[int] = []

    @classmethod
    def is_available(cls):
        return True

    @classmethod
    def install(cls, **kwargs):
        return None

    @classmethod
    def memory_stats(cls):
        d = cls.CP.cuda.runtime.getDevice()
        return {"allocated_bytes": 100 + d, "reserved_bytes": 200 + d, "peak_allocated_bytes": 300 + d,
                "peak_reserved_bytes": 400 + d}

    @classmethod
    def reset_peak_stats(cls):
        cls.resets.append(cls.CP.cuda.runtime.getDevice())


def test_a_plugin_without_a_device_argument_is_asked_with_that_device_current(monkeypatch):
    cp = fake_cuda.install(monkeypatch, device_count=2)
    monkeypatch.setattr(cb, "_cupy", cp)
    monkeypatch.setattr(cb, "_cupy_error", None)
    monkeypatch.setattr(_PerDevicePlugin, "CP", cp)
    monkeypatch.setattr(_PerDevicePlugin, "resets", [])
    host = reset_host(autoload=False)
    try:
        host.registry("allocator").register(_PerDevicePlugin, "tests")
        CupyBackend.install_allocator("per-device")
        assert [bt.cuda.memory_allocated(i) for i in (0, 1)] == [100, 101]
        assert (bt.cuda.max_memory_allocated(1), bt.cuda.memory_reserved(1), bt.cuda.max_memory_reserved(1)) == (
            301, 201, 401)
        bt.cuda.reset_peak_memory_stats("cuda:1")
        bt.cuda.reset_peak_memory_stats()
        assert _PerDevicePlugin.resets == [1, 0] and cp.cuda.runtime.getDevice() == 0
        monkeypatch.setattr(_PerDevicePlugin, "memory_stats", classmethod(lambda cls: {}))
        with pytest.raises(bt.DeviceError, match="memory_reserved: allocator plugin 'per-device' reports no "
                                                 "allocated/reserved bytes .no reserved_bytes"):
            bt.cuda.memory_reserved()
    finally:
        CupyBackend.uninstall_allocator()
        reset_host()


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CuPy and a CUDA GPU")
def test_the_sequence_gives_the_same_numbers_on_a_gpu():
    import bluallocator
    import cupy

    if issubclass(cupy.ndarray, np.ndarray):
        pytest.skip("the fake CUDA device's arrays are NumPy arrays: needs real CuPy")
    cupy.cuda.Device(0).synchronize()
    two = cupy.cuda.runtime.getDeviceCount() > 1
    bluallocator.uninstall()
    fresh = [bluallocator.CachingAllocator(bluallocator.CudaBackend(i)) for i in range(2 if two else 1)]
    for a in fresh:
        bluallocator.install(a)
    try:
        with cupy.cuda.Device(0):
            readings, dev1, end = _sequence(lambda n: cupy.empty(n, dtype=cupy.uint8), cupy.cuda.Device, two)
        assert readings == EXPECTED and end == EXPECTED[-1][1:]
        if two:
            assert dev1 == EXPECTED_DEVICE1
    finally:
        cupy.cuda.Device(0).synchronize()
        gc.collect()
        bluallocator.uninstall()
        for a in fresh:
            a.synchronize_pending()
            a.empty_cache()
