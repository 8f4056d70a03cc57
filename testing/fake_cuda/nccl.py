"""NCCL of the fake CUDA device (``cupy.cuda.nccl``): communicators whose ranks are threads of the test process,
meeting through the unique id; each collective runs at call time by reading and writing the memory at the raw
pointers it is given, as NCCL would."""

from __future__ import annotations

import ctypes
import os
import threading
import types
from typing import Any

import numpy as np

_NCCL_NP = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64, 6: np.float16,
            7: np.float32, 8: np.float64}
_NCCL_RED = {0: np.add.reduce, 1: np.multiply.reduce, 2: np.maximum.reduce, 3: np.minimum.reduce}


def _nccl_mem(ptr: int, count: int, t: int) -> np.ndarray:
    dt = np.dtype(_NCCL_NP[t])
    return np.frombuffer((ctypes.c_char * (count * dt.itemsize)).from_address(ptr), dtype=dt, count=count)


class _World:
    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=20)
        self.slots: dict = {}
        self.mail: dict = {}


_worlds: dict[bytes, _World] = {}
_worlds_lock = threading.Lock()
_nccl_group = threading.local()


class NcclCommunicator:
    """One rank of a communicator; ranks are threads of this process meeting through the unique id."""

    def __init__(self, size: int, uid: bytes, rank: int) -> None:
        if not isinstance(uid, bytes):
            raise TypeError("Argument 'commId' has incorrect type (expected bytes)")
        with _worlds_lock:
            self.w = _worlds.setdefault(uid, _World(size))
        self.rank, self.size = rank, size
        self.w.barrier.wait()

    def _exchange(self, item: np.ndarray) -> list:
        self.w.slots[self.rank] = item
        self.w.barrier.wait()
        items = [self.w.slots[r].copy() for r in range(self.size)]  # read everything before anyone writes
        self.w.barrier.wait()
        return items

    def allReduce(self, s: int, r: int, count: int, t: int, op: int, stream: Any) -> None:  # noqa: N802
        vals = self._exchange(_nccl_mem(s, count, t))
        _nccl_mem(r, count, t)[...] = np.mean(vals, axis=0) if op == 4 else _NCCL_RED[op](np.stack(vals), axis=0)

    def reduceScatter(self, s: int, r: int, recvcount: int, t: int, op: int, stream: Any) -> None:  # noqa: N802
        vals = self._exchange(_nccl_mem(s, recvcount * self.size, t))
        full = np.mean(vals, axis=0) if op == 4 else _NCCL_RED[op](np.stack(vals), axis=0)
        _nccl_mem(r, recvcount, t)[...] = full[self.rank * recvcount:(self.rank + 1) * recvcount]

    def allGather(self, s: int, r: int, count: int, t: int, stream: Any) -> None:  # noqa: N802
        _nccl_mem(r, count * self.size, t)[...] = np.concatenate(self._exchange(_nccl_mem(s, count, t)))

    def broadcast(self, s: int, r: int, count: int, t: int, root: int, stream: Any) -> None:
        _nccl_mem(r, count, t)[...] = self._exchange(_nccl_mem(s, count, t))[root]

    def send(self, s: int, count: int, t: int, peer: int, stream: Any) -> None:
        self._p2p(("send", s, count, t, peer))

    def recv(self, r: int, count: int, t: int, peer: int, stream: Any) -> None:
        self._p2p(("recv", r, count, t, peer))

    def _p2p(self, op: tuple) -> None:
        ops = getattr(_nccl_group, "ops", None)
        if ops is not None:
            ops.append((self, op))
        else:
            self._run_p2p([op])

    def _run_p2p(self, ops: list) -> None:
        for kind, p, count, t, peer in ops:
            if kind == "send":
                n = len([1 for k in self.w.mail if k[:2] == (self.rank, peer)])
                self.w.mail[(self.rank, peer, n)] = _nccl_mem(p, count, t).copy()
        self.w.barrier.wait()
        seen: dict = {}
        for kind, p, count, t, peer in ops:
            if kind == "recv":
                i = seen.get(peer, 0)
                seen[peer] = i + 1
                _nccl_mem(p, count, t)[...] = self.w.mail[(peer, self.rank, i)]
        self.w.barrier.wait()
        for k in [k for k in self.w.mail if k[0] == self.rank]:
            del self.w.mail[k]
        self.w.barrier.wait()

    def destroy(self) -> None:
        pass


def nccl_module() -> types.ModuleType:
    """A fresh ``cupy.cuda.nccl``."""
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = True
    nccl.NcclCommunicator = NcclCommunicator
    nccl.get_unique_id = lambda: os.urandom(128)
    nccl.get_version = lambda: 22000

    def group_start() -> None:
        _nccl_group.ops = []

    def group_end() -> None:
        ops, _nccl_group.ops = _nccl_group.ops, None
        if ops:
            ops[0][0]._run_p2p([op for _, op in ops])

    nccl.groupStart, nccl.groupEnd = group_start, group_end
    return nccl
