"""The one ``ProcessGroup`` interface, its ``Work`` handles, and argument checks shared by backends.

Collectives work in place on C-contiguous NumPy (CPU backends) or CuPy (NCCL) arrays; a blutensor
Tensor is accepted too and its ``_data`` is used. Ranks passed to a group's methods (``src``,
``dst``, ``new_group`` members) are ranks *within that group*.
"""

from __future__ import annotations

import os
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


class ReduceOp:
    """Reduction names accepted by ``all_reduce``/``reduce_scatter`` (plain strings work too)."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PRODUCT = "prod"


REDUCE_OPS = ("sum", "avg", "max", "min", "prod")
_KINDS = {"all_reduce": 1, "reduce_scatter": 2, "all_gather": 3, "broadcast": 4, "all_to_all": 5,
          "barrier": 6, "new_group": 7}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}


class CollectiveError(RuntimeError):
    """A collective was called with arguments that cannot work (here or across ranks)."""


class Work:
    """Handle of an operation in flight (``async_op=True``).

    ``wait()`` makes the result safe to use by what follows: on CPU it blocks until done; on GPU it
    makes the current (or given) CUDA stream wait on the completion event, without blocking the host.
    ``synchronize()`` always blocks the host until the operation has finished.
    """

    def wait(self, stream: Any = None) -> bool:
        self.synchronize()
        return True

    def synchronize(self) -> None:
        """Block the calling thread until the operation has completed."""

    def is_completed(self) -> bool:
        """True once the operation has finished (never blocks)."""
        return True

    def result(self) -> list[Any]:
        """The arrays written by the operation (PyTorch ``Work.result`` analogue)."""
        return list(getattr(self, "_outputs", []))


class CompletedWork(Work):
    """A handle for an operation that finished before it was returned."""

    def __init__(self, outputs: tuple = ()):
        self._outputs = outputs


def raw_array(x: Any, what: str, name: str = "tensor") -> Any:
    """The NumPy/CuPy array behind ``x`` (a blutensor Tensor's ``_data``), checked to be usable in place."""
    a = getattr(x, "_data", x)
    if not hasattr(a, "dtype") or not hasattr(a, "shape") or not hasattr(a, "flags"):
        raise TypeError(
            f"{what}: {name} must be a NumPy/CuPy array or a blutensor Tensor, got {type(x).__name__}"
        )
    if not a.flags.c_contiguous:
        raise CollectiveError(
            f"{what}: {name} of shape {tuple(a.shape)} is not C-contiguous (strides {a.strides}); "
            "collectives work in place on contiguous arrays (use a flat bucket or a contiguous copy)"
        )
    if a.dtype.hasobject:
        raise CollectiveError(
            f"{what}: {name} has dtype {a.dtype}, which holds Python object references; collectives move "
            "raw numbers (use a numeric dtype)"
        )
    if isinstance(a, np.ndarray) and not a.flags.writeable:
        raise CollectiveError(f"{what}: {name} is read-only; collectives write their result in place")
    return a


def is_cupy(a: Any) -> bool:
    """True for a CuPy ndarray (checked without importing CuPy)."""
    return type(a).__module__.startswith("cupy")


def checks_enabled(default: bool) -> bool:
    """Cross-rank argument checks: on with BLUTRAIN_DTMS_CHECK=1, off with 0, else ``default``."""
    v = os.environ.get("BLUTRAIN_DTMS_CHECK", "").strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    if v:
        raise ValueError(f"BLUTRAIN_DTMS_CHECK={v!r} is neither 1 (on) nor 0 (off); unset it for the default")
    return default


def collective_timeout() -> float | None:
    """Seconds a CPU collective may wait for its peers ($BLUTRAIN_DTMS_TIMEOUT), or None (wait forever)."""
    v = os.environ.get("BLUTRAIN_DTMS_TIMEOUT", "").strip()
    if not v:
        return None
    try:
        t = float(v)
    except ValueError:
        t = float("nan")
    if not t > 0 or t == float("inf"):
        raise ValueError(f"BLUTRAIN_DTMS_TIMEOUT={v!r} must be a positive number of seconds (unset: no timeout)")
    return t


def signature(kind: str, op: str | None, a: Any, extra: int = 0) -> np.ndarray:
    """Fixed-size int64 description of one rank's call, compared across ranks to catch mismatches.

    ``extra`` carries call details beyond op/dtype/shape (``new_group``: a checksum of its ranks)."""
    shape = tuple(int(s) for s in a.shape)[:6]
    sig = np.zeros(12, dtype=np.int64)
    sig[11] = extra
    sig[0] = _KINDS[kind]
    sig[1] = REDUCE_OPS.index(op) + 1 if op else 0
    sig[2] = _dtype_code(a.dtype)
    sig[3] = int(a.size)
    sig[4] = len(a.shape)
    sig[5 : 5 + len(shape)] = shape
    return sig


_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "uint16",
                "int32", "uint32", "int64", "uint64", "bool", "complex64", "complex128")


def _dtype_code(dtype: Any) -> int:
    name = str(np.dtype(dtype))
    if name in _DTYPE_NAMES:
        return _DTYPE_NAMES.index(name) + 1
    return 1000 + zlib.crc32(np.dtype(dtype).str.encode() + name.encode())


def _describe(sig: np.ndarray, dtype_names: dict[int, str]) -> str:
    shape = tuple(int(s) for s in sig[5 : 5 + min(int(sig[4]), 6)])
    code = int(sig[2])
    name = _DTYPE_NAMES[code - 1] if 0 < code <= len(_DTYPE_NAMES) else dtype_names.get(code, f"dtype#{code}")
    return f"shape {shape} {name}"


def compare_signatures(kind: str, sigs: np.ndarray, my_rank: int, my_dtype: Any) -> None:
    """Raise the same clear error on every rank when gathered signatures disagree."""
    ref = sigs[0]
    names = {int(signature(kind, None, np.empty(0, my_dtype))[2]): str(np.dtype(my_dtype))}
    for r in range(1, sigs.shape[0]):
        s = sigs[r]
        if s[0] != ref[0]:
            raise CollectiveError(
                f"{kind}: ranks called different collectives at the same point: rank 0 called "
                f"{_KIND_NAMES.get(int(ref[0]), '?')} but rank {r} called {_KIND_NAMES.get(int(s[0]), '?')}; "
                "every rank of a group must issue the same collectives in the same order"
            )
        if s[11] != ref[11]:
            raise CollectiveError(
                f"{kind}: arguments differ across ranks: rank {r} passed other ranks than rank 0 "
                f"(seen from rank {my_rank}); every member must pass the same list"
            )
        if s[1] != ref[1]:
            raise CollectiveError(
                f"{kind}: op mismatch across ranks: rank 0 uses {REDUCE_OPS[int(ref[1]) - 1]!r}, "
                f"rank {r} uses {REDUCE_OPS[int(s[1]) - 1]!r}"
            )
        if s[2] != ref[2] or s[3] != ref[3]:
            raise CollectiveError(
                f"{kind}: shape/dtype mismatch across ranks: rank 0 passed {_describe(ref, names)} "
                f"but rank {r} passed {_describe(s, names)} (seen from rank {my_rank})"
            )


_NO_DATA = np.empty(0, dtype=np.uint8)  # the "array" a barrier's signature describes


@dataclass(slots=True)
class CollectiveRecord:
    """One collective (or point-to-point op) as seen by collective observers.

    ``nbytes`` is the size NCCL's bus-bandwidth formulas take: the buffer of ``all_reduce``/``broadcast``/
    ``send``/``recv``, the whole input of ``reduce_scatter``/``all_to_all``, the whole output of
    ``all_gather`` (0 for ``barrier``). Host times are ``time.perf_counter_ns`` values: ``start_ns``
    when the call began (before the cross-rank argument check, which waits for the peers),
    ``issued_ns`` when the call returned (the op may still be in flight), ``wait_ns`` when the caller
    began waiting for it, ``end_ns`` when the caller saw it complete (its ``wait``/``synchronize``, or
    an ``is_completed`` that returned True). On NCCL ``stream`` is the communication stream's pointer
    and ``device_events`` the pair of timing CUDA events recorded on it around the operation; CPU
    backends leave them 0 / None.
    """

    op: str
    backend: str
    group: tuple[int, ...]
    rank: int
    nbytes: int
    dtype: str
    reduce_op: str | None
    async_op: bool
    start_ns: int
    issued_ns: int = 0
    wait_ns: int | None = None
    end_ns: int | None = None
    stream: int = 0
    device_events: tuple | None = None

    @property
    def group_size(self) -> int:
        return len(self.group)

    def blocked_ns(self) -> int:
        """Host time the caller spent blocked in this op: the call itself plus its wait (not the compute
        between issuing an async op and waiting on it); 0 until it ended."""
        if self.end_ns is None:
            return 0
        w = self.issued_ns if self.wait_ns is None else max(self.wait_ns, self.issued_ns)
        return max(self.issued_ns - self.start_ns, 0) + max(self.end_ns - w, 0)


#: observers called as ``fn("start", record)`` before a collective is issued and ``fn("end", record)``
#: once its completion is seen; empty means nothing of this is on the collective path
_COLLECTIVE_OBSERVERS: list[Callable[[str, CollectiveRecord], None]] = []


def add_collective_observer(fn: Callable[[str, CollectiveRecord], None]) -> None:
    """Call ``fn(phase, record)`` around every collective and point-to-point op of every group.

    ``phase`` is ``"start"`` (before the backend runs it; ``end_ns`` is None) or ``"end"`` (the same
    :class:`CollectiveRecord`, with ``end_ns`` set, when the caller waits on it or finds it complete).
    An op whose ``Work`` is never waited on reports no ``"end"``. Profilers use this (bluprofiler puts
    the records into its trace and table); an observer must not issue collectives itself.
    """
    if not callable(fn):
        raise TypeError(f"add_collective_observer: fn must be callable, got {type(fn).__name__}")
    if fn not in _COLLECTIVE_OBSERVERS:
        _COLLECTIVE_OBSERVERS.append(fn)


def remove_collective_observer(fn: Callable[[str, CollectiveRecord], None]) -> None:
    """Stop calling ``fn`` (no error when it was not added)."""
    if fn in _COLLECTIVE_OBSERVERS:
        _COLLECTIVE_OBSERVERS.remove(fn)


def _notify(phase: str, rec: CollectiveRecord) -> None:
    for fn in tuple(_COLLECTIVE_OBSERVERS):
        fn(phase, rec)


class ObservedWork(Work):
    """A backend's ``Work`` that reports its completion to the collective observers once."""

    def __init__(self, work: Work, rec: CollectiveRecord):
        self._work, self._rec, self._outputs = work, rec, getattr(work, "_outputs", ())

    def _ended(self) -> None:
        if self._rec is not None:
            rec, self._rec = self._rec, None
            rec.end_ns = time.perf_counter_ns()
            _notify("end", rec)

    def _waiting(self) -> None:
        if self._rec is not None and self._rec.wait_ns is None:
            self._rec.wait_ns = time.perf_counter_ns()

    def wait(self, stream: Any = None) -> bool:
        self._waiting()
        r = self._work.wait(stream)
        self._ended()
        return r

    def synchronize(self) -> None:
        self._waiting()
        self._work.synchronize()
        self._ended()

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done:
            self._ended()
        return done

    def result(self) -> list[Any]:
        return self._work.result()


class ProcessGroup(ABC):
    """A set of processes that run collectives together; one interface over NCCL, MPI and local."""

    backend: str = "?"

    def __init__(self, rank: int, size: int, global_ranks: tuple[int, ...]):
        self._rank, self._size, self.global_ranks = rank, size, tuple(global_ranks)
        self._n_subgroups = 0

    # --- identity ---
    def rank(self) -> int:
        """This process's rank within the group."""
        return self._rank

    def size(self) -> int:
        """Number of processes in the group."""
        return self._size

    def __repr__(self) -> str:
        return f"<ProcessGroup {self.backend} rank {self._rank}/{self._size} ranks={list(self.global_ranks)}>"

    # --- checks shared by backends ---
    def _op(self, what: str, op: str, a: Any) -> str:
        op = str(op).lower()
        if op not in REDUCE_OPS:
            raise CollectiveError(f"{what}: unknown op {op!r}; use one of {REDUCE_OPS}")
        if op == "avg" and not (np.issubdtype(a.dtype, np.floating) or str(a.dtype) == "bfloat16"):
            raise CollectiveError(f"{what}: op 'avg' needs a floating dtype, got {a.dtype}")
        if op in ("max", "min") and np.issubdtype(a.dtype, np.complexfloating):
            raise CollectiveError(f"{what}: op {op!r} is not defined for complex dtype {a.dtype}")
        return op

    @staticmethod
    def _tag(what: str, tag: Any) -> int:
        if not isinstance(tag, int | np.integer) or isinstance(tag, bool) or not 0 <= int(tag) < 2**23:
            raise CollectiveError(f"{what}: tag={tag!r} must be an integer in [0, 2**23)")
        return int(tag)

    def _peer(self, what: str, peer: int, name: str) -> int:
        if not isinstance(peer, int | np.integer) or not 0 <= int(peer) < self._size:
            raise CollectiveError(f"{what}: {name}={peer!r} is not a rank of this group of size {self._size}")
        return int(peer)

    @staticmethod
    def _same_dtype(what: str, out: Any, inp: Any) -> None:
        if out.dtype != inp.dtype:
            raise CollectiveError(f"{what}: output dtype {out.dtype} differs from input dtype {inp.dtype}")

    def _check_device(self, what: str, *arrays: Any) -> None:  # noqa: B027 (optional hook)
        """Backends override: refuse arrays on the wrong device with a clear message."""

    def _flush_p2p(self) -> None:  # noqa: B027 (optional hook)
        """Backends that coalesce point-to-point ops launch the queued ones here (before a collective)."""

    def _cross_check(self, kind: str, op: str | None, a: Any, extra: int = 0) -> None:  # noqa: B027
        """Backends override: compare (kind, op, dtype, shape) across ranks when checks are on."""

    # --- public collectives (validate, then call the backend) ---
    def all_reduce(self, tensor: Any, op: str = "sum", async_op: bool = False) -> Work | None:
        """Reduce ``tensor`` over all ranks in place (op: sum, avg, max, min, prod)."""
        a = raw_array(tensor, "all_reduce")
        self._check_device("all_reduce", a)
        self._flush_p2p()
        op = self._op("all_reduce", op, a)
        rec = self._begin("all_reduce", a.nbytes, a.dtype, op, async_op) if _COLLECTIVE_OBSERVERS else None
        self._cross_check("all_reduce", op, a)
        if rec is not None:
            return self._observed(rec, lambda: self._all_reduce(a, op), async_op)
        return self._ret(self._all_reduce(a, op), async_op)

    def reduce_scatter(self, output: Any, input: Any, op: str = "sum", async_op: bool = False) -> Work | None:
        """Reduce ``input`` (group size x output size) over ranks; rank r gets chunk r."""
        o, i = raw_array(output, "reduce_scatter", "output"), raw_array(input, "reduce_scatter", "input")
        self._check_device("reduce_scatter", o, i)
        self._flush_p2p()
        self._same_dtype("reduce_scatter", o, i)
        if i.size != o.size * self._size:
            raise CollectiveError(
                f"reduce_scatter: input has {i.size} elements {tuple(i.shape)}, expected group size "
                f"{self._size} x output size {o.size} = {o.size * self._size}"
            )
        op = self._op("reduce_scatter", op, i)
        rec = self._begin("reduce_scatter", i.nbytes, i.dtype, op, async_op) if _COLLECTIVE_OBSERVERS else None
        self._cross_check("reduce_scatter", op, i)
        if rec is not None:
            return self._observed(rec, lambda: self._reduce_scatter(o, i, op), async_op)
        return self._ret(self._reduce_scatter(o, i, op), async_op)

    def all_gather(self, output: Any, input: Any, async_op: bool = False) -> Work | None:
        """Concatenate every rank's ``input`` in rank order into ``output`` (group size x input size)."""
        o, i = raw_array(output, "all_gather", "output"), raw_array(input, "all_gather", "input")
        self._check_device("all_gather", o, i)
        self._flush_p2p()
        self._same_dtype("all_gather", o, i)
        if o.size != i.size * self._size:
            raise CollectiveError(
                f"all_gather: output has {o.size} elements {tuple(o.shape)}, expected group size "
                f"{self._size} x input size {i.size} = {i.size * self._size}"
            )
        rec = self._begin("all_gather", o.nbytes, o.dtype, None, async_op) if _COLLECTIVE_OBSERVERS else None
        self._cross_check("all_gather", None, i)
        if rec is not None:
            return self._observed(rec, lambda: self._all_gather(o, i), async_op)
        return self._ret(self._all_gather(o, i), async_op)

    def broadcast(self, tensor: Any, src: int = 0, async_op: bool = False) -> Work | None:
        """Copy ``tensor`` of group rank ``src`` into ``tensor`` on every rank."""
        a = raw_array(tensor, "broadcast")
        self._check_device("broadcast", a)
        self._flush_p2p()
        src = self._peer("broadcast", src, "src")
        rec = self._begin("broadcast", a.nbytes, a.dtype, None, async_op) if _COLLECTIVE_OBSERVERS else None
        self._cross_check("broadcast", None, a)
        if rec is not None:
            return self._observed(rec, lambda: self._broadcast(a, src), async_op)
        return self._ret(self._broadcast(a, src), async_op)

    def all_to_all(self, output: Any, input: Any, async_op: bool = False) -> Work | None:
        """Split ``input`` into equal chunks; chunk j goes to rank j, where it lands as chunk i (our rank)."""
        o, i = raw_array(output, "all_to_all", "output"), raw_array(input, "all_to_all", "input")
        self._check_device("all_to_all", o, i)
        self._flush_p2p()
        self._same_dtype("all_to_all", o, i)
        if o.size != i.size or i.size % self._size:
            raise CollectiveError(
                f"all_to_all: input {tuple(i.shape)} and output {tuple(o.shape)} must have the same number "
                f"of elements, divisible by the group size {self._size}"
            )
        rec = self._begin("all_to_all", i.nbytes, i.dtype, None, async_op) if _COLLECTIVE_OBSERVERS else None
        self._cross_check("all_to_all", None, i)
        if rec is not None:
            return self._observed(rec, lambda: self._all_to_all(o, i), async_op)
        return self._ret(self._all_to_all(o, i), async_op)

    def send(self, tensor: Any, dst: int, tag: int = 0, async_op: bool = False) -> Work | None:
        """Send ``tensor`` to group rank ``dst`` (matched by a ``recv`` there with the same tag)."""
        a = raw_array(tensor, "send")
        self._check_device("send", a)
        dst = self._peer("send", dst, "dst")
        if dst == self._rank:
            raise CollectiveError(f"send: dst={dst} is this rank; send to another rank")
        tag = self._tag("send", tag)
        if _COLLECTIVE_OBSERVERS:
            rec = self._begin("send", a.nbytes, a.dtype, None, async_op)
            return self._observed(rec, lambda: self._send(a, dst, tag), async_op)
        return self._ret(self._send(a, dst, tag), async_op)

    def recv(self, tensor: Any, src: int, tag: int = 0, async_op: bool = False) -> Work | None:
        """Receive into ``tensor`` from group rank ``src``."""
        a = raw_array(tensor, "recv")
        self._check_device("recv", a)
        src = self._peer("recv", src, "src")
        if src == self._rank:
            raise CollectiveError(f"recv: src={src} is this rank; receive from another rank")
        tag = self._tag("recv", tag)
        if _COLLECTIVE_OBSERVERS:
            rec = self._begin("recv", a.nbytes, a.dtype, None, async_op)
            return self._observed(rec, lambda: self._recv(a, src, tag), async_op)
        return self._ret(self._recv(a, src, tag), async_op)

    def isend(self, tensor: Any, dst: int, tag: int = 0) -> Work:
        """Nonblocking ``send``."""
        return self.send(tensor, dst, tag, async_op=True)

    def irecv(self, tensor: Any, src: int, tag: int = 0) -> Work:
        """Nonblocking ``recv``."""
        return self.recv(tensor, src, tag, async_op=True)

    def start_p2p(self) -> None:
        """Launch the isend/irecv posted so far now (NCCL coalesces them into one group, launched otherwise only
        at the first wait or the next collective): what a ring needs to have its exchange in flight while it
        computes. A no-op where point-to-point operations start when posted (MPI)."""
        self._flush_p2p()

    def barrier(self, async_op: bool = False) -> Work | None:
        """Wait until every rank of the group has reached the barrier."""
        self._flush_p2p()
        rec = self._begin("barrier", 0, _NO_DATA.dtype, None, async_op) if _COLLECTIVE_OBSERVERS else None
        self._cross_check("barrier", None, _NO_DATA)
        if rec is not None:
            return self._observed(rec, self._barrier, async_op, sync=True)
        w = self._barrier()
        if async_op:
            return w
        w.synchronize()
        return None

    def new_group(self, ranks: list[int]) -> ProcessGroup | None:
        """Sub-group of these group ranks; every rank of this group must call it (None for non-members)."""
        rs = [int(r) for r in ranks]
        if not rs:
            raise CollectiveError("new_group: ranks is empty")
        if len(set(rs)) != len(rs):
            raise CollectiveError(f"new_group: duplicate ranks in {rs}")
        bad = [r for r in rs if not 0 <= r < self._size]
        if bad:
            raise CollectiveError(f"new_group: ranks {bad} are not in this group of size {self._size}")
        self._n_subgroups += 1
        self._flush_p2p()
        ids = np.asarray(rs, dtype=np.int64)
        self._cross_check("new_group", None, ids, extra=zlib.crc32(ids.tobytes()))
        return self._new_group(rs, self._n_subgroups)

    def destroy(self) -> None:  # noqa: B027 (optional hook)
        """Release backend resources held by this group."""

    def _begin(self, kind: str, nbytes: int, dtype: Any, op: str | None, async_op: bool) -> CollectiveRecord:
        """The observers' "start" of a collective: before its cross-rank check, which may block on peers."""
        rec = CollectiveRecord(kind, self.backend, self.global_ranks, self._rank, int(nbytes), str(dtype), op,
                               bool(async_op), time.perf_counter_ns())
        _notify("start", rec)
        return rec

    def _observed(self, rec: CollectiveRecord, issue: Callable[[], Work], async_op: bool,
                  sync: bool = False) -> Work | None:
        """Run ``issue()``; the observers' "end" comes when the returned work is seen complete."""
        work = issue()
        rec.issued_ns = time.perf_counter_ns()
        timing = getattr(work, "timing", None)  # NCCL: (start event, end event, stream pointer)
        if timing is not None:
            rec.device_events, rec.stream = (timing[0], timing[1]), int(timing[2])
        w = ObservedWork(work, rec)
        if async_op:
            return w
        if sync:
            w.synchronize()
        else:
            w.wait()
        return None

    @staticmethod
    def _ret(work: Work, async_op: bool) -> Work | None:
        if async_op:
            return work
        work.wait()
        return None

    # --- backend hooks ---
    @abstractmethod
    def _all_reduce(self, a: Any, op: str) -> Work: ...

    @abstractmethod
    def _reduce_scatter(self, o: Any, i: Any, op: str) -> Work: ...

    @abstractmethod
    def _all_gather(self, o: Any, i: Any) -> Work: ...

    @abstractmethod
    def _broadcast(self, a: Any, src: int) -> Work: ...

    @abstractmethod
    def _all_to_all(self, o: Any, i: Any) -> Work: ...

    @abstractmethod
    def _send(self, a: Any, dst: int, tag: int) -> Work: ...

    @abstractmethod
    def _recv(self, a: Any, src: int, tag: int) -> Work: ...

    @abstractmethod
    def _barrier(self) -> Work: ...

    @abstractmethod
    def _new_group(self, ranks: list[int], group_index: int) -> ProcessGroup | None: ...
