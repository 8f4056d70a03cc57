"""One fake CUDA device behind CuPy's interface, for every package's CPU tests of its CUDA code paths.

A test builds a fresh ``cupy`` stand-in with :func:`make_cupy` (or puts one into ``sys.modules`` for the test's
duration with :func:`install`) and drives the package's CUDA branch on the CPU: device arrays are NumPy arrays of the
:class:`ndarray` subclass whose ``.data.ptr`` is their host address (so code that passes raw pointers, such as NCCL
calls or kernel launches, reads and writes real memory), or with ``distinct_arrays=True`` :class:`DistinctArray`
objects, which are not NumPy arrays (as CuPy's are not) for code that tells host from device arrays by type; streams
run queued work in order and only when an event recorded after it is waited on or synchronized (the null stream runs
it at once); events carry their stream, sequence number and a wall-clock time; kernels come from ``RawModule`` and run
the emulator a test registered for their entry-point name (``kernels={"blu_x": fn}``, or a function of (module, name)
choosing one), else only record the launch (``device.launches``: name, grid, block, argument count, shared memory,
argument kinds) after checking CuPy's launch-argument rules; NCCL communicators (``cupy.cuda.nccl``) run each
collective at call time across thread ranks; memory comes from a simulated device when ``memory=`` is given (e.g.
bluallocator's ``FakeDeviceBackend``: malloc, free, memGetInfo, events and capture state delegate to it); memory
hooks, NVTX ranges and the pool's used bytes are recorded for profilers.

Nothing here imports a BluTrain package, so every package's tests can use it. Import it as ``fake_cuda`` with the
repository's ``testing/`` directory on ``sys.path`` (each package's ``tests/conftest.py`` puts it there). What it
checks is the Python side (pointers, counts, dtypes, launch arguments, ordering); the CUDA code itself is checked by
NVRTC and by the ``cuda``-marked tests on a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import struct
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import numpy as np

from .nccl import nccl_module

__all__ = ["DeviceBuffer", "DeviceState", "DistinctArray", "Event", "Graph", "Stream", "TensorMapDriver", "host_view",
           "install", "installed", "make_cupy", "modules", "ndarray"]


# ------------------------------------------------------------------ arrays
class _Ptr:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class _DeviceId:
    def __init__(self, i: int = 0) -> None:
        self.id = i


class ndarray(np.ndarray):  # noqa: N801 - mirrors cupy.ndarray
    """A 'device' array in host memory: ``.data.ptr`` is its address, ``.device.id`` 0, ``.get()`` a NumPy copy,
    ``.set(a, stream)`` a copy that runs when ``stream`` does. NumPy operations on it give device arrays again."""

    @property
    def data(self) -> _Ptr:
        return _Ptr(self.__array_interface__["data"][0])

    @property
    def device(self) -> _DeviceId:
        return _DeviceId(0)

    def get(self, stream: Any = None, *a: Any, **k: Any) -> np.ndarray:
        return np.asarray(self).view(np.ndarray).copy()

    def set(self, arr: Any, stream: Any = None) -> None:
        """Copy ``arr`` in when ``stream`` (default: the current one) runs the copy, like cudaMemcpyAsync."""
        target = np.asarray(self).view(np.ndarray)
        st = stream if stream is not None else _current_stream()
        st.enqueue(lambda: np.copyto(target, arr))

    for _m in ("sum", "max", "min", "mean", "argmax", "argmin", "all", "any", "prod", "std", "var", "astype",
               "copy", "reshape", "__getitem__", "take", "swapaxes", "transpose", "squeeze", "view", "ravel"):

        def _mk(name: str) -> Callable:
            base = getattr(np.ndarray, name)

            def f(self: ndarray, *a: Any, **k: Any) -> Any:
                return _wrap(base(self, *[_unwrap(x) for x in a], **k))

            f.__name__ = name
            return f

        locals()[_m] = _mk(_m)
    del _m, _mk

    def __array_wrap__(self, obj: Any, context: Any = None, return_scalar: bool = False) -> Any:
        out = np.ndarray.__array_wrap__(self, obj, context, False)
        return out if isinstance(out, ndarray) else _wrap(out)


ndarray.__module__ = "cupy"


class DistinctArray:
    """A 'device' array that is not a NumPy array, as CuPy's are not (``make_cupy(distinct_arrays=True)``), for code
    that tells host from device arrays with ``isinstance(x, numpy.ndarray)``. It wraps a NumPy array: ``.data.ptr``
    is its host address, ``.get()`` a copy; indexing, views, ``astype``, ``fill`` and arithmetic give device arrays;
    there is no implicit conversion to NumPy (``numpy.asarray`` of one is an object array, as a mistake shows)."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    shape = property(lambda self: self._a.shape)
    strides = property(lambda self: self._a.strides)
    ndim = property(lambda self: self._a.ndim)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    device = property(lambda self: _DeviceId(0))
    data = property(lambda self: _Ptr(self._a.__array_interface__["data"][0]))
    T = property(lambda self: DistinctArray(self._a.T))

    def get(self, stream: Any = None) -> np.ndarray:
        return self._a.copy()

    def __getitem__(self, k: Any) -> DistinctArray:
        return DistinctArray(self._a[k])

    def __setitem__(self, k: Any, v: Any) -> None:
        self._a[k] = v._a if isinstance(v, DistinctArray) else v

    def fill(self, v: Any) -> None:
        self._a.fill(v)

    def astype(self, dt: Any) -> DistinctArray:
        return DistinctArray(self._a.astype(dt))

    def view(self, dt: Any) -> DistinctArray:
        return DistinctArray(self._a.view(dt))

    def copy(self) -> DistinctArray:
        return DistinctArray(self._a.copy())

    def _bin(self, other: Any, op: Callable) -> DistinctArray:
        return DistinctArray(op(self._a, other._a if isinstance(other, DistinctArray) else other))

    def __mul__(self, o: Any) -> DistinctArray:
        return self._bin(o, np.multiply)

    def __sub__(self, o: Any) -> DistinctArray:
        return self._bin(o, np.subtract)

    def __add__(self, o: Any) -> DistinctArray:
        return self._bin(o, np.add)

    def __truediv__(self, o: Any) -> DistinctArray:
        return self._bin(o, np.divide)

    def __rshift__(self, o: Any) -> DistinctArray:
        return self._bin(o, np.right_shift)

    def __lshift__(self, o: Any) -> DistinctArray:
        return self._bin(o, np.left_shift)

    def __float__(self) -> float:
        return float(self._a)


DistinctArray.__module__ = "cupy"


def _distinct_functions(cp: types.ModuleType) -> None:
    """The module functions of a ``distinct_arrays`` fake: on :class:`DistinctArray`, NumPy's values inside."""

    def unw(x: Any) -> Any:
        return x._a if isinstance(x, DistinctArray) else x

    def empty(shape: Any, dtype: Any = np.float32) -> DistinctArray:
        dt = np.dtype(dtype)
        return DistinctArray(np.full(shape, np.nan, dt) if dt.kind == "f" else np.zeros(shape, dt))

    cp.ndarray = DistinctArray
    cp.asarray = lambda x, dtype=None: DistinctArray(np.array(unw(x), dtype=dtype, copy=True))
    cp.array = lambda x, copy=True, dtype=None: cp.asarray(x, dtype)
    cp.zeros = lambda shape, dtype=np.float32: DistinctArray(np.zeros(shape, dtype))
    cp.empty = empty
    cp.empty_like = lambda x, dtype=None: empty(x.shape, dtype or x.dtype)
    cp.abs = lambda x: DistinctArray(np.abs(unw(x)))
    cp.max = lambda x: DistinctArray(np.asarray(np.max(unw(x))))
    cp.matmul = lambda a, b: DistinctArray(unw(a) @ unw(b))
    cp.asnumpy = lambda a, *x, **k: unw(a).copy()
    cp.random = types.SimpleNamespace(
        standard_normal=lambda shape, dtype=np.float32: DistinctArray(
            np.random.default_rng(0).standard_normal(shape).astype(dtype)))


def _wrap(x: Any) -> Any:
    if isinstance(x, ndarray):
        return x
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x).view(ndarray)
    if isinstance(x, tuple):
        return tuple(_wrap(i) for i in x)
    if isinstance(x, list):
        return [_wrap(i) for i in x]
    return x


def _unwrap(x: Any) -> Any:
    if isinstance(x, ndarray):
        return x.view(np.ndarray)
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(i) for i in x)
    return x


def _wrapped(f: Callable) -> Callable:
    def g(*a: Any, **k: Any) -> Any:
        return _wrap(f(*[_unwrap(x) for x in a], **{kk: _unwrap(v) for kk, v in k.items()}))

    g.__name__ = getattr(f, "__name__", "f")
    return g


def host_view(ptr: int, dtype: Any, shape: tuple, strides_el: tuple | None = None) -> np.ndarray:
    """A NumPy view of the memory at ``ptr`` (element strides; C order when None): what a kernel emulator or a
    collective reads and writes through the raw pointers it was given."""
    dt = np.dtype(dtype)
    shape = tuple(int(s) for s in shape)
    if strides_el is None:
        strides_el = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    if any(s == 0 for s in shape):
        return np.zeros(shape, dt)
    span = (sum((n - 1) * s for n, s in zip(shape, strides_el, strict=True)) + 1) * dt.itemsize
    base = np.frombuffer((ctypes.c_byte * span).from_address(ptr), dtype=dt)
    return np.lib.stride_tricks.as_strided(base, shape=shape, strides=tuple(s * dt.itemsize for s in strides_el))


# ------------------------------------------------------------------ streams, events, graphs
class Stream:
    """Work queued with :meth:`enqueue` runs in order, when an event recorded after it is synchronized or waited
    on by another stream (``immediate``: at once, as the null stream does). While capturing, kernel launches are
    recorded into the graph instead of run."""

    def __init__(self, non_blocking: bool = False, *, immediate: bool = False, ptr: int | None = None) -> None:
        self.ptr = id(self) if ptr is None else ptr
        self.pending: list[tuple[int, Callable]] = []
        self.seq, self.immediate = 0, immediate
        self.capture: list | None = None
        self.captures = 0  # how many captures began on this stream
        self._prev: list = []

    def enqueue(self, fn: Callable) -> None:
        if self.immediate:
            fn()
        else:
            self.seq += 1
            self.pending.append((self.seq, fn))

    def run_until(self, seq: int) -> None:
        while self.pending and self.pending[0][0] <= seq:
            self.pending.pop(0)[1]()

    def synchronize(self) -> None:
        self.run_until(self.seq)

    def wait_event(self, ev: Event) -> None:
        ev.waited = True
        if ev.stream is not None:
            ev.stream.run_until(ev.seq)

    def record(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one when None) at this stream's current position, as CuPy's ``Stream.record``."""
        ev = event if event is not None else Event()
        ev.record(self)
        return ev

    def is_capturing(self) -> bool:
        return self.capture is not None

    def begin_capture(self, mode: Any = None) -> None:
        self.captures += 1
        self.capture = []

    def end_capture(self) -> Graph:
        g, self.capture = Graph(self.capture or []), None
        return g

    def use(self) -> Stream:
        _STATE.current = self
        return self

    def __enter__(self) -> Stream:
        self._prev.append(_STATE.current)
        _STATE.current = self
        return self

    def __exit__(self, *a: Any) -> bool:
        _STATE.current = self._prev.pop()
        return False


class Graph:
    """The kernel launches a capturing stream recorded; :meth:`launch` runs them again in order."""

    def __init__(self, launches: list) -> None:
        self.launches = launches

    def launch(self, stream: Any = None) -> None:
        for fn, grid, block, args, smem in self.launches:
            fn(grid, block, args, shared_mem=smem)


class Event:
    """Records its stream and that stream's position; :meth:`synchronize` runs the stream's work up to it."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
        self.stream: Stream | None = None
        self.recorded_on: Stream | None = None
        self.seq, self.time, self.waited = 0, 0.0, False

    def record(self, stream: Stream | None = None) -> None:
        st = stream if stream is not None else _current_stream()
        self.stream = self.recorded_on = st
        self.seq, self.time = st.seq, time.perf_counter()

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.seq)

    def query(self) -> bool:
        return self.stream is None or not any(s <= self.seq for s, _ in self.stream.pending)

    @property
    def done(self) -> bool:
        return self.recorded_on is not None and self.query()


def _elapsed(a: Event, b: Event) -> float:
    return (b.time - a.time) * 1e3


class _State(threading.local):
    current: Stream | None = None
    device: int = 0  # the thread's current device (switched only on a device made with device_count > 1)


_STATE = _State()


def _current_stream() -> Stream:
    return _STATE.current if _STATE.current is not None else DeviceState.active.null_stream


# ------------------------------------------------------------------ kernels
class Kernel:
    """An entry point of a ``RawModule``: checks CuPy's launch-argument rules, records the launch, and runs the
    emulator registered for its name (inside a capture: recorded into the graph instead)."""

    max_dynamic_shared_size_bytes = 0

    def __init__(self, state: DeviceState, name: str, emulator: Callable | None = None) -> None:
        self.state, self.name, self.emulator = state, name, emulator
        self.attributes = {"num_regs": 0, "local_size_bytes": 0, "max_threads_per_block": 1024}

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0, stream: Any = None) -> None:
        if not (isinstance(grid, tuple) and isinstance(block, tuple)):
            raise TypeError(f"{self.name}: grid and block must be tuples, got {grid!r}, {block!r}")
        kinds = []
        for a in args:
            if isinstance(a, (ndarray, DistinctArray)):
                kinds.append("ptr")
            elif isinstance(a, np.generic):
                kinds.append(a.dtype.name)
            elif isinstance(a, np.ndarray) and self.state.host_array_args:
                kinds.append("host")  # a __grid_constant__ struct passed by value (CuPy packs its bytes)
            else:
                raise TypeError(f"{self.name}: kernel argument of type {type(a).__name__} (CuPy takes device arrays "
                                "and NumPy scalars)")
        self.state.launches.append((self.name, grid, block, len(args), shared_mem, tuple(kinds)))
        st = _current_stream()
        if st.capture is not None:
            st.capture.append((self, grid, block, args, shared_mem))
            return
        if self.emulator is not None:
            self.emulator(self, grid, block, args, shared_mem)


def _raw_module_class(state: DeviceState) -> type:
    class RawModule:
        def __init__(self, code: str | None = None, options: tuple = (), path: str | None = None,
                     backend: str = "nvrtc", **kw: Any) -> None:
            self.code, self.options, self.path = code or "", tuple(options), path
            self.names = set(re.findall(r"(blu_\w+)", self.code))
            state.modules.append(self)

        def get_function(self, name: str) -> Kernel:
            k = state.kernels
            return Kernel(state, name, k(self, name) if callable(k) else k.get(name))

    return RawModule


# ------------------------------------------------------------------ memory
class CUDARuntimeError(RuntimeError):
    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"cudaError {status}")


class UnownedMemory:
    def __init__(self, ptr: int, size: int, owner: object, device_id: int = -1) -> None:
        self.ptr, self.size, self._owner, self.device_id = ptr, size, owner, device_id


class MemoryPointer:
    def __init__(self, mem: UnownedMemory, offset: int) -> None:
        self.mem, self.ptr = mem, mem.ptr + offset


class MemoryHook:
    """Registered in ``device.hooks`` while entered (CuPy calls the hook's methods; the fake records the hook)."""

    def __enter__(self) -> MemoryHook:
        DeviceState.active.hooks.append(self)
        return self

    def __exit__(self, *a: Any) -> None:
        DeviceState.active.hooks.remove(self)


class MemoryPool:
    """CuPy MemoryPool look-alike: with a simulated device, blocks come from it (freed when the last pointer to
    them goes); without one, ``malloc`` is not expected to be called. ``used_bytes`` adds the preset baseline."""

    def __init__(self, state: DeviceState | None = None) -> None:
        self.state = state or DeviceState.active
        self.used = 0

    def malloc(self, n: int) -> MemoryPointer:
        mem = self.state.memory
        if mem is None:
            raise AssertionError("this fake device has no simulated memory (make_cupy(memory=...))")
        n = max(512, -(-n // 512) * 512)
        ptr = mem.malloc(n)
        self.used += n
        pool = self

        class Owner:
            def __del__(self) -> None:
                mem.free(ptr)
                pool.used -= n

        return MemoryPointer(UnownedMemory(ptr, n, Owner()), 0)

    def used_bytes(self) -> int:
        return self.used + self.state.pool_used_bytes

    total_bytes = used_bytes

    def n_free_blocks(self) -> int:
        return 0

    def free_all_blocks(self) -> None:
        return None


class DeviceBuffer:
    """An array in simulated device memory (``make_cupy(memory=...)``): the allocator's ``MemoryPointer`` and the
    byte count, no values (the simulated device has no storage); views share the pointer, as CuPy's do."""

    def __init__(self, data: MemoryPointer, nbytes: int, shape: tuple, dtype: Any) -> None:
        self.data, self.nbytes, self.shape, self.dtype = data, nbytes, shape, np.dtype(dtype)
        self.device = _DeviceId(0)

    def view(self, dtype: Any = None) -> DeviceBuffer:
        return DeviceBuffer(self.data, self.nbytes, self.shape, self.dtype if dtype is None else dtype)


class TensorMapDriver:
    """The driver's ``cuTensorMapEncodeTiled`` on this device, called as a ctypes binding of libcuda calls it (the
    map's address, then dtype, rank, global address, dims, strides, box, element strides, interleave, swizzle, L2
    promotion, OOB fill): records each call as Python values in ``calls`` and writes a 128-byte descriptor made of
    them (dtype, rank, address, sum of dims as four little-endian u64, then bytes 0..95); returns ``result`` (the
    CUresult, 0: success). An encoder that loads libcuda is pointed at it in place of the real entry point."""

    def __init__(self, result: int = 0) -> None:
        self.calls: list[dict] = []
        self.result = result

    def __call__(self, out: int, dtype: int, rank: int, addr: Any, dims: Any, strides: Any, box: Any, estr: Any,
                 il: int, sw: int, l2: int, oob: int) -> int:
        call = dict(out=out, dtype=dtype, rank=rank, addr=getattr(addr, "value", addr), dims=tuple(dims),
                    strides=tuple(strides), box=tuple(box), estr=tuple(estr), flags=(il, sw, l2, oob))
        self.calls.append(call)
        raw = self.pack(call)
        assert len(raw) == 128, len(raw)
        ctypes.memmove(out, raw, 128)
        return self.result

    def pack(self, call: dict) -> bytes:
        """The 128 descriptor bytes of one recorded call (a subclass may write what its kernel emulators read)."""
        return struct.pack("<4Q", call["dtype"], call["rank"], call["addr"], sum(call["dims"])) + bytes(range(96))


# ------------------------------------------------------------------ the device
class DeviceState:
    """What one fake device records and is configured with (``cupy.device``)."""

    active: DeviceState

    def __init__(self, *, memory: Any = None, compute_capability: int = 90, sms: int = 132,
                 smem_optin: int = 232448, name: str = "fake device", null_stream_ptr: int = 0,
                 pool_used_bytes: int = 0, kernels: dict[str, Callable] | Callable | None = None,
                 host_array_args: bool = False, runtime_version: int = 12080, distinct_arrays: bool = False,
                 device_count: int = 1) -> None:
        self.memory, self.compute_capability, self.sms, self.smem_optin = memory, compute_capability, sms, smem_optin
        self.name, self.pool_used_bytes, self.host_array_args = name, pool_used_bytes, host_array_args
        #: emulators by entry-point name, or a function (module, name) -> emulator or None (KeyError: no such entry)
        self.kernels: dict[str, Callable] | Callable = kernels if callable(kernels) else dict(kernels or {})
        self.runtime_version, self.distinct_arrays = runtime_version, distinct_arrays
        #: GPUs the runtime reports; with more than one, ``Device(i).use()`` / ``with Device(i)`` switch the calling
        #: thread's current device (``runtime.getDevice()``), as CUDA's per-thread current device
        self.device_count = device_count
        #: the driver's tensor-map encoder (``cuTensorMapEncodeTiled``) of this device, recording its calls
        self.tensor_map_driver = TensorMapDriver()
        self.launches: list[tuple] = []
        self.modules: list = []
        self.streams: list[Stream] = []  # every stream made through cupy.cuda.Stream, in order
        self.hooks: list = []
        self.nvtx_ranges: list[str | None] = []  # RangePush names, None for each RangePop
        self.null_stream = Stream(immediate=True, ptr=null_stream_ptr)
        self.allocator: Any = "cupy-pool"
        self.event_times: dict[int, float] = {}
        self.event_streams: dict[int, int] = {}
        self.events_created = 0
        self.events_recorded = 0
        self.event_flags: list[int] = []


DeviceState.active = DeviceState()


class _Device:
    def __init__(self, i: int | None = None) -> None:
        st = DeviceState.active
        self.id = _STATE.device if i is None else int(i)
        if st.device_count > 1 and not 0 <= self.id < st.device_count:
            raise CUDARuntimeError(101)  # cudaErrorInvalidDevice
        self.compute_capability = str(st.compute_capability)
        self.attributes = {"MultiProcessorCount": st.sms}
        self._prev: list[int] = []

    def synchronize(self) -> None:
        pass

    def use(self) -> None:
        if DeviceState.active.device_count > 1:
            _STATE.device = self.id

    def __enter__(self) -> _Device:
        self._prev.append(_STATE.device)
        self.use()
        return self

    def __exit__(self, *a: Any) -> bool:
        _STATE.device = self._prev.pop()
        return False


class Runtime:
    """``cupy.cuda.runtime``: device queries; raw events (ints: with simulated memory its events, else a recorded
    wall-clock time per event, ``records``/``created`` counting them and ``device.event_flags`` their flags);
    malloc/free/memGetInfo and capture state from the simulated memory."""

    CUDARuntimeError = CUDARuntimeError
    eventDisableTiming = 2  # noqa: N815 - CuPy's name
    streamCaptureModeGlobal, streamCaptureModeThreadLocal, streamCaptureModeRelaxed = 0, 1, 2  # noqa: N815

    def __init__(self, state: DeviceState) -> None:
        self._s = state
        mem = state.memory
        if mem is not None:
            self.free, self.memGetInfo = mem.free, mem.mem_get_info
            self.eventSynchronize, self.eventDestroy = mem.event_synchronize, mem.event_destroy
            self.streamIsCapturing = mem.is_capturing

    records = property(lambda self: self._s.events_recorded)
    created = property(lambda self: self._s.events_created)

    def getDeviceCount(self) -> int:  # noqa: N802
        return self._s.device_count

    def getDevice(self) -> int:  # noqa: N802
        return _STATE.device

    def getDeviceProperties(self, i: int) -> dict:  # noqa: N802
        s = self._s
        return {"name": s.name.encode(), "multiProcessorCount": s.sms, "sharedMemPerBlockOptin": s.smem_optin,
                "major": s.compute_capability // 10, "minor": s.compute_capability % 10}

    def runtimeGetVersion(self) -> int:  # noqa: N802
        return self._s.runtime_version

    driverGetVersion = runtimeGetVersion  # noqa: N815

    def eventCreateWithFlags(self, flags: int = 0) -> int:  # noqa: N802
        s = self._s
        s.event_flags.append(flags)
        if s.memory is not None:
            return s.memory.event_create()
        s.events_created += 1
        return 0x1000 + s.events_created

    def eventRecord(self, ev: int, stream: int) -> None:  # noqa: N802
        s = self._s
        if s.memory is not None:
            return s.memory.event_record(ev, stream)
        s.events_recorded += 1
        s.event_times[ev] = time.perf_counter()
        s.event_streams[ev] = stream

    def eventElapsedTime(self, a: int, b: int) -> float:  # noqa: N802
        return (self._s.event_times[b] - self._s.event_times[a]) * 1e3

    def eventQuery(self, e: int) -> int:  # noqa: N802
        mem = self._s.memory
        return 0 if mem is None or mem.event_query(e) else 600

    def eventSynchronize(self, e: int) -> None:  # noqa: N802
        return None

    def eventDestroy(self, e: int) -> None:  # noqa: N802
        return None

    def streamIsCapturing(self, s: int) -> int:  # noqa: N802
        return 0

    def malloc(self, n: int) -> int:
        mem = self._s.memory
        if mem is None:
            raise CUDARuntimeError(2)
        try:
            return mem.malloc(n)
        except Exception as e:  # the simulated device's out-of-memory: cudaErrorMemoryAllocation
            if "memory" in type(e).__name__.lower():
                raise CUDARuntimeError(2) from None
            raise

    def free(self, p: int) -> None:
        return None


def make_cupy(**device: Any) -> types.ModuleType:
    """A fresh fake ``cupy`` module on a fresh fake device (keyword arguments: :class:`DeviceState`'s).

    ``cupy.device`` is the device's record (launches, hooks, NVTX ranges, events); ``cupy.cuda`` holds Stream,
    Event, Device, runtime, nvtx, MemoryPool/MemoryHook, the allocator setting and ``cupy.cuda.nccl``; every other
    attribute is NumPy's, returning device arrays."""
    state = DeviceState(**device)
    DeviceState.active = state
    _STATE.current = None
    _STATE.device = 0

    cuda = types.ModuleType("cupy.cuda")
    cuda.runtime = Runtime(state)
    class DeviceStream(Stream):
        """A :class:`Stream` the device records in ``device.streams`` when made."""

        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            state.streams.append(self)

    cuda.Device, cuda.Stream, cuda.Event, cuda.Graph = _Device, DeviceStream, Event, Graph
    cuda.get_current_stream = _current_stream
    cuda.get_elapsed_time = _elapsed
    cuda.nccl = nccl_module()
    cuda.nvtx = types.SimpleNamespace(available=True, RangePush=lambda n, *a: state.nvtx_ranges.append(n),
                                      RangePop=lambda: state.nvtx_ranges.append(None))
    class Pool(MemoryPool):
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(state)

    class Hook(MemoryHook):
        def __enter__(self) -> Hook:
            state.hooks.append(self)
            return self

        def __exit__(self, *a: Any) -> None:
            state.hooks.remove(self)

    cuda.MemoryHook, cuda.UnownedMemory, cuda.MemoryPointer, cuda.MemoryPool = Hook, UnownedMemory, MemoryPointer, Pool
    default_pool = Pool()

    def get_allocator() -> Any:
        return state.allocator if state.allocator != "cupy-pool" or state.memory is not None else default_pool.malloc

    def set_allocator(fn: Any = None) -> None:
        state.allocator = fn if fn is not None else "cupy-pool"

    @contextlib.contextmanager
    def using_allocator(fn: Any = None):
        """CuPy's ``cupy.cuda.using_allocator``: ``fn`` is the allocator inside the block, the previous one after."""
        prev = state.allocator
        state.allocator = fn if fn is not None else "cupy-pool"
        try:
            yield
        finally:
            state.allocator = prev

    cuda.get_allocator, cuda.set_allocator, cuda.using_allocator = get_allocator, set_allocator, using_allocator
    cuda.compiler = types.SimpleNamespace(CompileException=RuntimeError)
    cuda.alloc_pinned_memory = lambda n: np.zeros(max(int(n), 1), np.uint8)
    cuda.PinnedMemoryPointer = None

    cp = types.ModuleType("cupy")
    cp.__version__ = "fake"
    cp.device, cp.cuda, cp.ndarray = state, cuda, ndarray
    cp.RawModule = _raw_module_class(state)
    cp.get_default_memory_pool = lambda: default_pool
    cp.asnumpy = lambda a, *x, **k: np.asarray(a).view(np.ndarray).copy()

    def asarray(a: Any, dtype: Any = None, order: str = "C") -> ndarray:
        if isinstance(a, np.ndarray) and type(a) not in (np.ndarray, ndarray):
            raise TypeError(f"fake cupy: cannot take an array of type {type(a).__name__}")
        return _wrap(np.array(_unwrap(a), dtype=dtype, order=order))  # a copy, as from the host

    def empty(shape: Any, dtype: Any = np.float32, order: str = "C") -> ndarray:
        """Floats filled with NaN (uninitialised memory that a kernel forgets to write shows up)."""
        dt = np.dtype(dtype)
        return _wrap(np.full(shape, np.nan, dt) if dt.kind == "f" else np.zeros(shape, dt))

    def empty_like(a: Any, dtype: Any = None) -> ndarray:
        return empty(np.shape(a), dtype or a.dtype)

    def empty_on_device(shape: Any, dtype: Any = np.uint8, order: str = "C") -> DeviceBuffer:
        """With simulated memory: a buffer from CuPy's current allocator (bluallocator's, once installed)."""
        shape = tuple(np.atleast_1d(shape).tolist())
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        alloc = state.allocator if callable(state.allocator) else default_pool.malloc
        return DeviceBuffer(alloc(nbytes), nbytes, shape, dtype)

    cp.asarray, cp.array, cp.empty_like = asarray, (lambda a, dtype=None, copy=True: asarray(a, dtype)), empty_like
    cp.empty = empty if state.memory is None else empty_on_device
    cp.ascontiguousarray = lambda a, dtype=None: _wrap(np.ascontiguousarray(_unwrap(a), dtype=dtype))
    cp.copyto = lambda dst, src, **k: np.copyto(dst, _unwrap(src), **k)
    cp.argsort = lambda a, axis=-1: _wrap(np.argsort(_unwrap(a), axis=axis, kind="stable"))
    rng = np.random.default_rng(0)
    cp.random = types.SimpleNamespace(
        standard_normal=lambda shape=None, dtype=np.float32: _wrap(rng.standard_normal(shape).astype(dtype)),
        randint=lambda lo, hi=None, size=None: _wrap(np.random.randint(lo, hi, size)),
        seed=lambda s=None: None)
    lib = types.ModuleType("cupy.lib")
    lib.stride_tricks = types.SimpleNamespace(as_strided=_wrapped(np.lib.stride_tricks.as_strided))
    cp.lib = lib

    def __getattr__(name: str) -> Any:  # everything else: NumPy's, on device arrays
        obj = getattr(np, name)
        if isinstance(obj, np.ufunc):
            class U:
                def __call__(self, *a: Any, **k: Any) -> Any:
                    return _wrapped(obj)(*a, **k)

                def __getattr__(self, n: str) -> Any:
                    return _wrapped(getattr(obj, n))

            return U()
        if callable(obj) and not isinstance(obj, type):
            return _wrapped(obj)
        return obj

    cp.__getattr__ = __getattr__
    cp.cupyx = _cupyx_modules()
    if state.distinct_arrays:
        _distinct_functions(cp)
    return cp


def _cupyx_modules() -> dict[str, types.ModuleType]:
    """``cupyx`` (scatter_add) and ``cupyx.scipy.special`` (erf) on device arrays."""
    import math

    cupyx = types.ModuleType("cupyx")
    scipy = types.ModuleType("cupyx.scipy")
    special = types.ModuleType("cupyx.scipy.special")

    def scatter_add(a: Any, slices: Any, value: Any) -> None:
        if not isinstance(a, ndarray):
            raise TypeError("scatter_add: not a (fake) device array")
        np.add.at(a.view(np.ndarray), _unwrap(slices), _unwrap(value))

    def erf(x: Any) -> ndarray:
        x = np.asarray(x)
        return _wrap(np.frompyfunc(math.erf, 1, 1)(x.view(np.ndarray)).astype(x.dtype))

    cupyx.scatter_add, cupyx.scipy, scipy.special, special.erf = scatter_add, scipy, special, erf
    return {"cupyx": cupyx, "cupyx.scipy": scipy, "cupyx.scipy.special": special}


def modules(cp: types.ModuleType) -> dict[str, types.ModuleType]:
    """The names a fake (from :func:`make_cupy`) takes in ``sys.modules``: cupy, cupy.cuda, cupy.cuda.nccl, cupy.lib,
    cupyx, cupyx.scipy, cupyx.scipy.special."""
    return {"cupy": cp, "cupy.cuda": cp.cuda, "cupy.cuda.nccl": cp.cuda.nccl, "cupy.lib": cp.lib, **cp.cupyx}


def install(monkeypatch: Any, **device: Any) -> types.ModuleType:
    """:func:`make_cupy` put in ``sys.modules`` as ``cupy``, ``cupy.cuda``, ``cupy.cuda.nccl``, ``cupy.lib`` and
    ``cupyx`` (``scatter_add``, ``scipy.special.erf``) for one test (``monkeypatch``: pytest's fixture, which
    restores the real modules afterwards)."""
    cp = make_cupy(**device)
    for name, mod in modules(cp).items():
        monkeypatch.setitem(sys.modules, name, mod)
    return cp


@contextlib.contextmanager
def installed(**device: Any):
    """:func:`install` outside pytest (a script, a subprocess): the fake modules for the ``with`` block."""
    cp = make_cupy(**device)
    mods = modules(cp)
    saved = {n: sys.modules.get(n) for n in mods}
    sys.modules.update(mods)
    try:
        yield cp
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
