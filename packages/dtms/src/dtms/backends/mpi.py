"""MPI backend (mpi4py) for CPU processes: nonblocking MPI collectives behind ``Work`` handles."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..mpi import MPI_HINT
from ..process_group import (
    CollectiveError,
    ProcessGroup,
    Work,
    checks_enabled,
    collective_timeout,
    compare_signatures,
    is_cupy,
    signature,
)


def import_mpi() -> Any:
    """``mpi4py.MPI`` (initialises MPI), or a clear error naming the extra to install."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise RuntimeError(f"the 'mpi' backend needs mpi4py and an MPI library: {MPI_HINT}") from e
    return MPI


class MPIWork(Work):
    """Nonblocking MPI requests plus an optional host-side finish (average, copy back from staging)."""

    def __init__(self, MPI: Any, requests: list, finish: Callable[[], None] | None = None, keep: tuple = (),
                 what: str = "collective", timeout: float | None = None, rank: int = 0, size: int = 1,
                 recv_bytes: int | None = None):
        self._MPI, self._reqs, self._finish, self._keep = MPI, requests, finish, keep
        self._recv_bytes = recv_bytes  # a receive: the bytes its buffer must get (a shorter message is an error)
        self._done, self._what, self._timeout, self._who = False, what, timeout, (rank, size)
        self._outputs = keep[:1]

    def _failed(self, e: Exception) -> CollectiveError:
        """An MPI error turned into a CollectiveError naming the operation (not a bare mpi4py Exception)."""
        msg = e.Get_error_string() if hasattr(e, "Get_error_string") else str(e)
        hint = ""
        if self._what.startswith("recv"):
            hint = " (MPI_ERR_TRUNCATE/IN_STATUS here means the sender's message is larger than this buffer)"
        return CollectiveError(f"{self._what}: MPI error: {msg}{hint}")

    def _statuses(self) -> list | None:
        """Status objects for a receive's requests (its byte count and error are checked on completion), None for
        collectives, whose waits report their errors themselves."""
        return [self._MPI.Status() for _ in self._reqs] if self._recv_bytes is not None else None

    def _check_statuses(self, statuses: list | None) -> None:
        """A completed receive is checked through its status as well as the wait's return code: an error recorded
        there (a truncated message) and a message shorter than the buffer both raise, naming the sizes."""
        for st in statuses or ():
            err = st.Get_error()
            if err != self._MPI.SUCCESS:
                raise self._failed(self._MPI.Exception(err))
            if (n := st.Get_count(self._MPI.BYTE)) != self._recv_bytes:
                raise CollectiveError(f"{self._what}: the sender's message is {n} bytes, this buffer "
                                      f"{self._recv_bytes}; send and receive the same shape and dtype")

    def _complete(self) -> None:
        if self._finish is not None:
            self._finish()
        self._done, self._keep, self._reqs = True, (), []

    def synchronize(self) -> None:
        if not self._done:
            statuses = self._statuses()
            try:
                if self._timeout is None:
                    self._MPI.Request.Waitall(self._reqs, statuses)
                else:
                    self._wait_until_deadline(statuses)
            except self._MPI.Exception as e:
                raise self._failed(e) from e
            self._check_statuses(statuses)
            self._complete()

    def _wait_until_deadline(self, statuses: list | None) -> None:
        """Poll (which also drives MPI progress) until done; past $BLUTRAIN_DTMS_TIMEOUT raise instead of hanging."""
        t0 = time.monotonic()
        while not self._MPI.Request.Testall(self._reqs, statuses):
            waited = time.monotonic() - t0
            if waited > self._timeout:
                rank, size = self._who
                raise CollectiveError(
                    f"{self._what}: not complete after {waited:.1f}s on rank {rank} of a group of {size} "
                    f"(BLUTRAIN_DTMS_TIMEOUT={self._timeout:g}); a peer rank is stuck elsewhere, dead, or "
                    "issuing its collectives in another order"
                )
            if waited > 1e-3:  # spin (as Waitall does) for the first millisecond, then 100 us naps
                time.sleep(1e-4)

    def wait(self, stream: Any = None) -> bool:
        self.synchronize()
        return True

    def is_completed(self) -> bool:
        if not self._done:
            statuses = self._statuses()
            try:
                done = self._MPI.Request.Testall(self._reqs, statuses)
            except self._MPI.Exception as e:
                raise self._failed(e) from e
            if done:
                self._check_statuses(statuses)
                self._complete()
        return self._done


def _mpi_ops(MPI: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Reduction ops for numbers, and for bool (MPI has only logical ops on C_BOOL: PyTorch's semantics)."""
    return ({"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD},
            {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND, "prod": MPI.LAND})


def _mpi_type(MPI: Any, dtype: np.dtype) -> Any | None:
    table = {
        "float32": MPI.FLOAT, "float64": MPI.DOUBLE, "int8": MPI.INT8_T, "uint8": MPI.UINT8_T,
        "int16": MPI.INT16_T, "uint16": MPI.UINT16_T, "int32": MPI.INT32_T, "uint32": MPI.UINT32_T,
        "int64": MPI.INT64_T, "uint64": MPI.UINT64_T, "bool": MPI.C_BOOL,
        "complex64": MPI.C_FLOAT_COMPLEX, "complex128": MPI.C_DOUBLE_COMPLEX,
    }
    return table.get(str(np.dtype(dtype)))


def _bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


class MPIProcessGroup(ProcessGroup):
    """Collectives through an MPI communicator (a private duplicate of the one given)."""

    backend = "mpi"

    def __init__(self, comm: Any = None, global_ranks: tuple[int, ...] | None = None, *, _dup: bool = True):
        MPI = import_mpi()
        self.MPI = MPI
        base = MPI.COMM_WORLD if comm is None else comm
        self.comm = base.Dup() if _dup else base
        size = self.comm.Get_size()
        super().__init__(self.comm.Get_rank(), size, global_ranks or tuple(range(size)))
        self.check = checks_enabled(default=True)
        self.timeout = collective_timeout()
        self._ops = _mpi_ops(MPI)

    def _work(self, requests: list, finish: Callable[[], None] | None = None, keep: tuple = (),
              what: str = "collective", recv_bytes: int | None = None) -> MPIWork:
        return MPIWork(self.MPI, requests, finish, keep, what, self.timeout, self._rank, self._size, recv_bytes)

    def _check_device(self, what: str, *arrays: Any) -> None:
        for a in arrays:
            if is_cupy(a):
                raise CollectiveError(
                    f"{what}: the mpi backend works on host (NumPy) arrays, got a CuPy array on the GPU; "
                    "use backend='nccl' for GPU arrays"
                )

    def _cross_check(self, kind: str, op: str | None, a: Any, extra: int = 0) -> None:
        if not self.check or self._size == 1:
            return
        mine = signature(kind, op, a, extra)
        sigs = np.empty((self._size, mine.size), dtype=np.int64)
        if self.timeout is None:
            self.comm.Allgather([mine, self.MPI.INT64_T], [sigs, self.MPI.INT64_T])
        else:  # a peer that never arrives must not hang us here either
            req = self.comm.Iallgather([mine, self.MPI.INT64_T], [sigs, self.MPI.INT64_T])
            self._work([req], None, (), f"{kind} (cross-rank argument check)").synchronize()
        compare_signatures(kind, sigs, self._rank, a.dtype)

    # --- reductions: native MPI types, or float32 staging for float16/bfloat16 ---
    def _reduce_prep(self, what: str, a: np.ndarray) -> tuple[np.ndarray, Any, bool]:
        t = _mpi_type(self.MPI, a.dtype)
        if t is not None:
            return a, t, False
        if str(a.dtype) in ("float16", "bfloat16"):
            return a.astype(np.float32), self.MPI.FLOAT, True
        raise CollectiveError(f"{what}: dtype {a.dtype} cannot be reduced by the mpi backend")

    def _all_reduce(self, a: np.ndarray, op: str) -> Work:
        buf, t, staged = self._reduce_prep("all_reduce", a)
        req = self.comm.Iallreduce(self.MPI.IN_PLACE, [buf, t], self._ops[buf.dtype.kind == "b"][op])
        n = self._size

        def finish() -> None:
            if op == "avg":
                np.divide(buf, n, out=buf)
            if staged:
                a[...] = buf.astype(a.dtype)

        return self._work([req], finish, (a, buf), "all_reduce")

    def _reduce_scatter(self, o: np.ndarray, i: np.ndarray, op: str) -> Work:
        src, t, staged = self._reduce_prep("reduce_scatter", i)
        aliased = np.may_share_memory(o, i)
        dst = np.empty(o.shape, np.float32 if staged else o.dtype) if (staged or aliased) else o
        req = self.comm.Ireduce_scatter_block([src, t], [dst, t], self._ops[src.dtype.kind == "b"][op])
        n = self._size

        def finish() -> None:
            if op == "avg":
                np.divide(dst, n, out=dst)
            if dst is not o:
                o[...] = dst.astype(o.dtype).reshape(o.shape)

        return self._work([req], finish, (o, src, dst), "reduce_scatter")

    # --- data movement: byte views, any dtype ---
    def _all_gather(self, o: np.ndarray, i: np.ndarray) -> Work:
        src = i.copy() if np.may_share_memory(o, i) else i
        req = self.comm.Iallgather([_bytes(src), self.MPI.BYTE], [_bytes(o), self.MPI.BYTE])
        return self._work([req], None, (o, src), "all_gather")

    def _broadcast(self, a: np.ndarray, src: int) -> Work:
        req = self.comm.Ibcast([_bytes(a), self.MPI.BYTE], root=src)
        return self._work([req], None, (a,), f"broadcast from rank {src}")

    def _all_to_all(self, o: np.ndarray, i: np.ndarray) -> Work:
        src = i.copy() if np.may_share_memory(o, i) else i
        req = self.comm.Ialltoall([_bytes(src), self.MPI.BYTE], [_bytes(o), self.MPI.BYTE])
        return self._work([req], None, (o, src), "all_to_all")

    def _send(self, a: np.ndarray, dst: int, tag: int) -> Work:
        req = self.comm.Isend([_bytes(a), self.MPI.BYTE], dest=dst, tag=tag)
        return self._work([req], None, (a,), f"send to rank {dst} (tag {tag})")

    def _recv(self, a: np.ndarray, src: int, tag: int) -> Work:
        req = self.comm.Irecv([_bytes(a), self.MPI.BYTE], source=src, tag=tag)
        return self._work([req], None, (a,),
                          f"recv from rank {src} (tag {tag}) into {tuple(a.shape)} {a.dtype} ({a.nbytes} bytes)",
                          recv_bytes=a.nbytes)

    def _barrier(self) -> Work:
        return self._work([self.comm.Ibarrier()], what="barrier")

    def _new_group(self, ranks: list[int], group_index: int) -> ProcessGroup | None:
        member = self._rank in ranks
        color = 0 if member else self.MPI.UNDEFINED
        sub = self.comm.Split(color, ranks.index(self._rank) if member else 0)
        if not member:
            return None
        return MPIProcessGroup(sub, tuple(self.global_ranks[r] for r in ranks), _dup=False)

    def destroy(self) -> None:
        comm, self.comm = self.comm, None
        if comm is not None and comm != self.MPI.COMM_NULL and not self.MPI.Is_finalized():
            comm.Free()
