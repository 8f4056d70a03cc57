"""NCCL backend through CuPy's ``cupy.cuda.nccl.NcclCommunicator``, for CuPy arrays on GPUs.

Stream/event semantics: each group owns a communication stream. A collective first makes that
stream wait on an event recorded on the caller's current stream (so it sees all earlier work), runs
NCCL there, and records a completion event. ``work.wait()`` makes the current stream wait on that
event (the host never blocks); ``work.synchronize()`` blocks the host. Inside CUDA-graph capture the
same fork/join through events is captured; an async op must be ``wait()``-ed before capture ends.
Keep the arrays (and the Work) alive until ``wait()``. isend/irecv are queued and launched together
as one NCCL group (see ``_flush_p2p``), so ring exchanges do not deadlock.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import process_group as _pg
from ..process_group import (
    CollectiveError,
    ProcessGroup,
    Work,
    checks_enabled,
    compare_signatures,
    is_cupy,
    signature,
)

CUDA_HINT = "pip install dtms[cuda12] (or dtms[cuda13]): CuPy with NCCL"

# ncclDataType_t and ncclRedOp_t values (stable across NCCL 2.x)
_NCCL_TYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
               "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
_NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}


def import_nccl() -> tuple[Any, Any]:
    """``(cupy, cupy.cuda.nccl)``, or a clear error naming the extra to install."""
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as e:
        raise RuntimeError(f"the 'nccl' backend needs CuPy built with NCCL: {CUDA_HINT}") from e
    if not getattr(nccl, "available", True) or not hasattr(nccl, "NcclCommunicator"):
        raise RuntimeError(f"CuPy could not load the NCCL library (libnccl.so.2): {CUDA_HINT}")
    return cupy, nccl


def uid_bytes(uid: bytes | tuple) -> bytes:
    """A NCCL unique id as 128 raw bytes (CuPy >= 14 returns bytes, older CuPy a tuple of ints)."""
    return bytes(uid) if isinstance(uid, bytes | bytearray) else bytes(int(v) & 0xFF for v in uid)


def make_communicator(nccl: Any, size: int, uid: bytes, rank: int) -> Any:
    """``NcclCommunicator(size, uid, rank)``, passing the id in the form this CuPy expects."""
    try:
        return nccl.NcclCommunicator(size, uid, rank)
    except TypeError:  # older CuPy: a tuple of signed chars
        return nccl.NcclCommunicator(size, tuple(v - 256 if v > 127 else v for v in uid), rank)


class NCCLWork(Work):
    """Completion of a NCCL operation: a CUDA event recorded on the communication stream."""

    def __init__(self, cupy: Any, event: Any, keep: tuple):
        self._cupy, self.event, self._keep = cupy, event, keep
        self._outputs = keep[:1]
        self.timing: tuple | None = None  # (start, end, stream pointer) timing events while observed

    def wait(self, stream: Any = None) -> bool:
        """Make ``stream`` (default: the current stream) wait for the operation; the host does not block."""
        s = stream if stream is not None else self._cupy.cuda.get_current_stream()
        s.wait_event(self.event)
        return True

    def synchronize(self) -> None:
        self.event.synchronize()

    def is_completed(self) -> bool:
        return bool(self.event.done)


class PendingP2PWork(Work):
    """An isend/irecv queued for coalescing: launched (with the other queued ones, in one NCCL group)
    at the first wait/synchronize/is_completed on any of them or at the next collective."""

    def __init__(self, pg: NCCLProcessGroup, keep: tuple):
        self._pg, self._outputs, self.work = pg, keep[:1], None

    def _launched(self) -> NCCLWork:
        if self.work is None:
            self._pg._flush_p2p()
        return self.work

    def wait(self, stream: Any = None) -> bool:
        return self._launched().wait(stream)

    def synchronize(self) -> None:
        self._launched().synchronize()

    def is_completed(self) -> bool:
        return self._launched().is_completed()


class StoreBootstrap:
    """Shares NCCL unique ids through the rendezvous store (root sets, members get)."""

    def __init__(self, store: Any, prefix: str, timeout: float):
        self.store, self.prefix, self.timeout = store, prefix, timeout

    def share(self, uid: bytes | None) -> bytes:
        key = f"{self.prefix}/nccl_unique_id"
        if uid is not None:
            self.store.set(key, uid)
            return uid
        got = self.store.get(key, timeout=self.timeout)
        if len(got) != 128:
            raise RuntimeError(f"store key {key!r} holds {len(got)} bytes, not a 128-byte NCCL unique id")
        return got

    def split(self, ranks: list[int], index: int, my_rank: int) -> StoreBootstrap:
        return StoreBootstrap(self.store, f"{self.prefix}/g{index}", self.timeout)


class MPIBootstrap:
    """Shares NCCL unique ids through an MPI communicator that mirrors the NCCL group."""

    def __init__(self, comm: Any, MPI: Any):
        self.comm, self.MPI = comm, MPI

    def share(self, uid: bytes | None) -> bytes:
        buf = np.zeros(128, dtype=np.uint8)
        if uid is not None:
            buf[:] = np.frombuffer(uid, dtype=np.uint8)
        self.comm.Bcast([buf, self.MPI.BYTE], root=0)
        return buf.tobytes()

    def split(self, ranks: list[int], index: int, my_rank: int) -> MPIBootstrap | None:
        member = my_rank in ranks
        sub = self.comm.Split(0 if member else self.MPI.UNDEFINED, ranks.index(my_rank) if member else 0)
        return MPIBootstrap(sub, self.MPI) if member else None


class NCCLProcessGroup(ProcessGroup):
    """Collectives on CuPy arrays through one NCCL communicator on this process's current device."""

    backend = "nccl"

    def __init__(self, rank: int, size: int, bootstrap: Any, global_ranks: tuple[int, ...] | None = None,
                 device: int | None = None, use_side_stream: bool = True):
        cupy, nccl = import_nccl()
        self.cupy, self.nccl = cupy, nccl
        self.device = cupy.cuda.Device(device if device is not None else cupy.cuda.runtime.getDevice())
        self.device.use()
        uid = bootstrap.share(uid_bytes(nccl.get_unique_id()) if rank == 0 else None)
        self.comm = make_communicator(nccl, size, uid, rank)
        self.bootstrap = bootstrap
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.use_side_stream = use_side_stream
        self.check = checks_enabled(default=False)
        super().__init__(rank, size, global_ranks or tuple(range(size)))
        self._avg_native = nccl.get_version() >= 21000
        self._p2p_queue: list[tuple[str, Any, int, PendingP2PWork]] = []

    # --- plumbing ---
    def _check_device(self, what: str, *arrays: Any) -> None:
        for a in arrays:
            if not is_cupy(a):
                raise CollectiveError(
                    f"{what}: the nccl backend works on CuPy (GPU) arrays, got {type(a).__module__}."
                    f"{type(a).__name__}; use backend='mpi' for host arrays"
                )
            if a.device.id != self.device.id:
                raise CollectiveError(
                    f"{what}: array is on cuda:{a.device.id} but this group's communicator is on "
                    f"cuda:{self.device.id}"
                )

    def _cross_check(self, kind: str, op: str | None, a: Any, extra: int = 0) -> None:
        cp = self.cupy
        if not self.check or self._size == 1 or cp.cuda.get_current_stream().is_capturing():
            return
        mine = cp.asarray(signature(kind, op, a, extra))
        sigs = cp.empty((self._size, mine.size), dtype=cp.int64)
        s = cp.cuda.get_current_stream()
        self.comm.allGather(mine.data.ptr, sigs.data.ptr, mine.size, _NCCL_TYPES["int64"], s.ptr)
        compare_signatures(kind, cp.asnumpy(sigs), self._rank, a.dtype)

    def _launch(self, fn: Any, keep: tuple) -> Work:
        cp = self.cupy
        cur = cp.cuda.get_current_stream()
        if self.use_side_stream:
            s = self.stream
            ready = cp.cuda.Event(disable_timing=True)
            ready.record(cur)
            s.wait_event(ready)
        else:
            s = cur
        timing = None
        if _pg._COLLECTIVE_OBSERVERS:  # a profiler listens: time the operation on the communication stream
            t0, t1 = cp.cuda.Event(), cp.cuda.Event()
            t0.record(s)
            timing = (t0, t1, s.ptr)
        fn(s)
        if timing is not None:
            timing[1].record(s)
        done = cp.cuda.Event(disable_timing=True)
        done.record(s)
        work = NCCLWork(cp, done, keep)
        work.timing = timing
        return work

    @staticmethod
    def _move_type(a: Any) -> tuple[int, int]:
        """(nccl type, count) for moving ``a`` without arithmetic: native type or raw bytes."""
        t = _NCCL_TYPES.get(str(a.dtype))
        return (t, a.size) if t is not None else (_NCCL_TYPES["uint8"], a.nbytes)

    def _reduce_type(self, what: str, a: Any) -> int:
        t = _NCCL_TYPES.get(str(a.dtype))
        if t is None:
            raise CollectiveError(f"{what}: dtype {a.dtype} cannot be reduced by NCCL")
        return t

    def _op_code(self, op: str) -> int:
        return _NCCL_OPS["sum"] if op == "avg" and not self._avg_native else _NCCL_OPS[op]

    def _scale_if_needed(self, op: str, a: Any, s: Any) -> None:
        if op == "avg" and not self._avg_native:
            with s:
                a *= 1.0 / self._size

    # --- collectives ---
    def _all_reduce(self, a: Any, op: str) -> Work:
        t = self._reduce_type("all_reduce", a)

        def run(s: Any) -> None:
            self.comm.allReduce(a.data.ptr, a.data.ptr, a.size, t, self._op_code(op), s.ptr)
            self._scale_if_needed(op, a, s)

        return self._launch(run, (a,))

    def _reduce_scatter(self, o: Any, i: Any, op: str) -> Work:
        t = self._reduce_type("reduce_scatter", i)

        def run(s: Any) -> None:
            self.comm.reduceScatter(i.data.ptr, o.data.ptr, o.size, t, self._op_code(op), s.ptr)
            self._scale_if_needed(op, o, s)

        return self._launch(run, (o, i))

    def _all_gather(self, o: Any, i: Any) -> Work:
        t, n = self._move_type(i)
        return self._launch(lambda s: self.comm.allGather(i.data.ptr, o.data.ptr, n, t, s.ptr), (o, i))

    def _broadcast(self, a: Any, src: int) -> Work:
        t, n = self._move_type(a)
        return self._launch(lambda s: self.comm.broadcast(a.data.ptr, a.data.ptr, n, t, src, s.ptr), (a,))

    def _all_to_all(self, o: Any, i: Any) -> Work:
        t, n = self._move_type(i)
        chunk = n // self._size
        step = i.nbytes // self._size

        def run(s: Any) -> None:
            self.nccl.groupStart()
            try:
                for p in range(self._size):
                    self.comm.send(i.data.ptr + p * step, chunk, t, p, s.ptr)
                    self.comm.recv(o.data.ptr + p * step, chunk, t, p, s.ptr)
            finally:
                self.nccl.groupEnd()

        return self._launch(run, (o, i))

    # Point to point: NCCL send/recv block on the GPU until the peer's matching call runs, so a ring
    # (isend to r+1, irecv from r-1) deadlocks unless both are in one NCCL group. We queue them and
    # launch the queue as one group at the first wait on any of them or before the next collective.
    def _send(self, a: Any, dst: int, tag: int) -> Work:
        w = PendingP2PWork(self, (a,))
        self._p2p_queue.append(("send", a, dst, w))
        return w

    def _recv(self, a: Any, src: int, tag: int) -> Work:
        w = PendingP2PWork(self, (a,))
        self._p2p_queue.append(("recv", a, src, w))
        return w

    def _flush_p2p(self) -> None:
        if not self._p2p_queue:
            return
        queue, self._p2p_queue = self._p2p_queue, []

        def run(s: Any) -> None:
            self.nccl.groupStart()
            try:
                for kind, a, peer, _ in queue:
                    t, n = self._move_type(a)
                    (self.comm.send if kind == "send" else self.comm.recv)(a.data.ptr, n, t, peer, s.ptr)
            finally:
                self.nccl.groupEnd()

        work = self._launch(run, tuple(a for _, a, _, _ in queue))
        for *_, pending in queue:
            pending.work = work

    def _barrier(self) -> Work:
        buf = self.cupy.zeros(1, dtype=self.cupy.float32)
        return self._all_reduce(buf, "sum")

    def _new_group(self, ranks: list[int], group_index: int) -> ProcessGroup | None:
        sub = self.bootstrap.split(ranks, group_index, self._rank)
        if self._rank not in ranks:
            return None
        return NCCLProcessGroup(ranks.index(self._rank), len(ranks), sub,
                                tuple(self.global_ranks[r] for r in ranks), self.device.id,
                                self.use_side_stream)

    def destroy(self) -> None:
        self._flush_p2p()
        comm, self.comm = self.comm, None
        if comm is not None:
            comm.destroy()
