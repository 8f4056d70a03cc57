"""A CPU stand-in for ``cupy`` + ``cupy.cuda.nccl`` so the NCCL backend's plumbing (pointers, counts,
types, all-to-all offsets, groups, bootstrap through the store) is tested without a GPU.

Ranks are threads. Arrays are NumPy arrays of a subclass whose module name starts with "cupy";
the fake communicator runs each collective at call time (streams and events are no-ops) by reading
and writing memory through the raw pointers the backend passes, as NCCL would.
"""

from __future__ import annotations

import ctypes
import os
import threading
import types

import numpy as np

_NP = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64, 6: np.float16,
       7: np.float32, 8: np.float64}
_RED = {0: np.add.reduce, 1: np.multiply.reduce, 2: np.maximum.reduce, 3: np.minimum.reduce}


class FakeArray(np.ndarray):
    """A 'device' array: ``.data.ptr`` and ``.device.id`` like CuPy's."""

    @property
    def data(self):  # noqa: D401
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])

    @property
    def device(self):
        return types.SimpleNamespace(id=0)


FakeArray.__module__ = "cupy_fake"


def _mem(ptr: int, count: int, t: int) -> np.ndarray:
    dt = np.dtype(_NP[t])
    buf = (ctypes.c_char * (count * dt.itemsize)).from_address(ptr)
    return np.frombuffer(buf, dtype=dt, count=count)


class _World:
    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=20)
        self.slots: dict = {}
        self.mail: dict = {}


_worlds: dict[bytes, _World] = {}
_lock = threading.Lock()
_group = threading.local()


class NcclCommunicator:
    def __init__(self, size: int, uid: bytes, rank: int):
        if not isinstance(uid, bytes):
            raise TypeError("Argument 'commId' has incorrect type (expected bytes)")
        with _lock:
            self.w = _worlds.setdefault(uid, _World(size))
        self.rank, self.size = rank, size
        self.w.barrier.wait()

    def _exchange(self, item):
        self.w.slots[self.rank] = item
        self.w.barrier.wait()
        items = [self.w.slots[r].copy() for r in range(self.size)]  # read everything before anyone writes
        self.w.barrier.wait()
        return items

    def allReduce(self, s, r, count, t, op, stream):
        vals = list(self._exchange(_mem(s, count, t)))
        res = np.mean(vals, axis=0) if op == 4 else _RED[op](np.stack(vals), axis=0)
        _mem(r, count, t)[...] = res

    def reduceScatter(self, s, r, recvcount, t, op, stream):
        vals = list(self._exchange(_mem(s, recvcount * self.size, t)))
        full = np.mean(vals, axis=0) if op == 4 else _RED[op](np.stack(vals), axis=0)
        _mem(r, recvcount, t)[...] = full[self.rank * recvcount:(self.rank + 1) * recvcount]

    def allGather(self, s, r, count, t, stream):
        vals = list(self._exchange(_mem(s, count, t)))
        _mem(r, count * self.size, t)[...] = np.concatenate(vals)

    def broadcast(self, s, r, count, t, root, stream):
        vals = list(self._exchange(_mem(s, count, t)))
        _mem(r, count, t)[...] = vals[root]

    def send(self, s, count, t, peer, stream):
        _group.ops = getattr(_group, "ops", None)
        self._p2p(("send", s, count, t, peer))

    def recv(self, r, count, t, peer, stream):
        self._p2p(("recv", r, count, t, peer))

    def _p2p(self, op):
        ops = getattr(_group, "ops", None)
        if ops is not None:
            ops.append((self, op))
        else:
            self._run_p2p([op])

    def _run_p2p(self, ops):
        for kind, p, count, t, peer in ops:
            if kind == "send":
                self.w.mail[(self.rank, peer, len([1 for k in self.w.mail if k[:2] == (self.rank, peer)]))] = \
                    _mem(p, count, t).copy()
        self.w.barrier.wait()
        seen: dict = {}
        for kind, p, count, t, peer in ops:
            if kind == "recv":
                i = seen.get(peer, 0)
                seen[peer] = i + 1
                _mem(p, count, t)[...] = self.w.mail[(peer, self.rank, i)]
        self.w.barrier.wait()
        for k in [k for k in self.w.mail if k[0] == self.rank]:
            del self.w.mail[k]
        self.w.barrier.wait()

    def destroy(self):
        pass


def groupStart():
    _group.ops = []


def groupEnd():
    ops, _group.ops = _group.ops, None
    if ops:
        ops[0][0]._run_p2p([op for _, op in ops])


class _Stream:
    ptr = 0

    def __init__(self, non_blocking: bool = False):
        self.ptr = id(self)

    def wait_event(self, ev):
        ev.waited = True

    def is_capturing(self):
        return False

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class _Event:
    def __init__(self, disable_timing: bool = False):
        self.done, self.recorded_on = False, None

    def record(self, stream):
        self.recorded_on, self.done = stream, True

    def synchronize(self):
        pass


def make_modules():
    """(cupy, cupy.cuda, cupy.cuda.nccl) fakes, to be put into sys.modules."""
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = True
    nccl.NcclCommunicator = NcclCommunicator
    nccl.get_unique_id = lambda: os.urandom(128)
    nccl.get_version = lambda: 22000
    nccl.groupStart, nccl.groupEnd = groupStart, groupEnd
    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl = nccl
    cuda.Stream, cuda.Event = _Stream, _Event
    default = _Stream()
    cuda.get_current_stream = lambda: default
    cuda.Device = lambda i=0: types.SimpleNamespace(id=i, use=lambda: None)
    cuda.runtime = types.SimpleNamespace(getDevice=lambda: 0, getDeviceCount=lambda: 1)
    cp = types.ModuleType("cupy")
    cp.cuda = cuda
    cp.int64, cp.float32 = np.int64, np.float32
    cp.asarray = lambda a, dtype=None: np.array(a, dtype=dtype, order="C").view(FakeArray)  # a copy, as from host
    cp.empty = lambda shape, dtype=np.float32: np.empty(shape, dtype).view(FakeArray)
    cp.zeros = lambda shape, dtype=np.float32: np.zeros(shape, dtype).view(FakeArray)
    cp.asnumpy = lambda a: np.asarray(a).view(np.ndarray).copy()
    return cp, cuda, nccl
