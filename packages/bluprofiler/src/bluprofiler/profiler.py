"""The Profiler: one context manager that times every op (forward and backward), tracks memory,
emits NVTX ranges and hands a :class:`ProfileResult` to the table, trace and plot writers.

How it attaches (and detaches, leaving no trace when off):

* forward: ``blutensor.ext.add_op_observer`` wraps every op call;
* backward: ``blutensor.ext.add_backward_observer`` wraps every node's backward formula.

With no profiler active nothing of ours is on the op path: both observer lists are empty (one
truthiness test per op and per node, as without bluprofiler).

The hot path (per span) records two raw pool events on the cached stream (none for view ops, which
launch no kernel: their spans are host-timed only) and appends one tuple; everything else (kernel
names, OpEvents, GPU milliseconds, memory owners of frees) is worked out when the session stops.
"""

from __future__ import annotations

import itertools
import operator
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bluprofiler import memory as _mem
from bluprofiler.comm import CommEvent, compute_overlap, resolve_gpu_times
from bluprofiler.events import OpEvent
from bluprofiler.memory import MemoryTracker
from bluprofiler.result import ProfileResult
from bluprofiler.timing import GpuTimer, Nvtx, cupy_or_none, nvtx_tool_attached

_now = time.perf_counter_ns
_data_shape = operator.attrgetter("_data.shape")
_tid = threading.get_ident
_active: Profiler | None = None
_lock = threading.Lock()
_Tensor = None  # blutensor.Tensor, bound at the first start (import order)
#: forward ops that launch no kernel (blutensor's VIEW flag): host-timed spans, no CUDA events
_HOST_FWD: frozenset = frozenset()
#: kernel class -> True (backward is always a view) / False (a view when the grad is C-contiguous)
_HOST_BWD: dict = {}
#: built-in ops whose backward formula launches no kernel: a view of the grad (permute, transpose),
#: the grad itself (contiguous, clone), or a reshape of the grad (a view when that grad is
#: C-contiguous: False); expand/getitem backward launch kernels (a sum, a scatter) and keep events
_NO_KERNEL_BACKWARD = {"permute": True, "transpose": True, "contiguous": True, "clone": True,
                       "view": False, "squeeze": False, "unsqueeze": False, "reshape": False}
#: dtypes whose CUDA kernel must be the built-in for a view op to be host-only (a plugin may launch)
_CHECK_DTYPES = ("float32", "bfloat16", "float16")


class ProfilerError(RuntimeError):
    """Misuse of the profiler (nested sessions, reading results of a running session, bad options)."""


class Profiler:
    """``with Profiler(timing=True, memory=True) as prof: ...`` then ``prof.result``.

    timing: host time per op always; CUDA-event time per op when ``device`` is CUDA (and
    ``gpu_events``; view ops get host-timed spans only, they launch no kernel).
    memory: allocation tracking (CuPy memory hook or bluallocator listener on CUDA, op-output
    tracking on CPU).
    nvtx: NVTX ranges named ``op.forward`` / ``op.backward`` / region (CUDA only). None (default):
    on only when an NVTX tool is attached (Nsight sets NVTX_INJECTION64_PATH); True/False force it.
    record_shapes: input/output shapes per op event (and on autograd nodes, for the graph recorder).
    device: "cpu", "cuda" or None (auto: CUDA when CuPy sees a GPU).
    gpu_events: True: two CUDA events per op span (start, end); "end": one event per op span, its
    end; its start is the latest event recorded before it opened (half the events; GPU work launched
    between ops outside any op or region counts in the next span); False: GPU sessions host-timed
    (no CUDA events at all; for overhead ablations).

    Events are recorded on the CUDA stream current when the session starts (start the session
    inside ``with stream:`` to time work launched on another stream).
    """

    def __init__(self, timing: bool = True, memory: bool = True, nvtx: bool | None = None,
                 record_shapes: bool = True, device: str | None = None, backward: bool = True,
                 gpu_events: bool | str = True):
        if device not in (None, "cpu", "cuda") and not str(device).startswith("cuda"):
            raise ProfilerError(f"Profiler: device must be 'cpu', 'cuda' or None, got {device!r}")
        if nvtx not in (None, True, False):
            raise ProfilerError(f"Profiler: nvtx must be True, False or None (auto), got {nvtx!r}")
        if gpu_events not in (True, False, "pair", "end"):
            raise ProfilerError(f"Profiler: gpu_events must be True, False, 'pair' or 'end', got {gpu_events!r}")
        self.timing, self.memory, self.nvtx_on = timing, memory, nvtx
        self.gpu_events = gpu_events
        self._chain = gpu_events == "end"
        self._last = -1  # "end" mode: pool index of the latest event recorded (-1: the base event)
        self.record_shapes, self.backward = record_shapes, backward
        self.device = device
        self.events: list[OpEvent] = []
        self._raw: list[tuple] = []
        self._depth = 0
        self._count = itertools.count()
        self._next = self._count.__next__
        self._running = False
        self._result: ProfileResult | None = None
        self._observing = self._observing_bwd = False
        self._comm_api: Any = None  # dtms, while this session observes its collectives
        self._comms: list[CommEvent] = []
        self._comm_open = 0

    # ---- lifecycle ----
    def start(self) -> Profiler:
        global _active
        with _lock:
            if _active is not None:
                raise ProfilerError("a bluprofiler session is already active; sessions do not nest "
                                    "(use prof.region(name) for sub-ranges)")
            _active = self
        self.mem = None
        try:
            self._start()
        except BaseException:
            self._detach()
            _release()
            raise
        return self

    def _start(self) -> None:
        global _Tensor
        from blutensor import Tensor, ext

        _Tensor = Tensor
        cp = None if self.device == "cpu" else cupy_or_none()
        if str(self.device).startswith("cuda") and cp is None:
            raise ProfilerError("Profiler(device='cuda'): CuPy with a visible GPU is needed "
                                "(pip install cupy-cuda12x)")
        self.cuda = cp is not None
        if self.cuda and self.timing and self.gpu_events:
            _bind_view_ops()
        self.gpu = GpuTimer(cp) if (self.cuda and self.timing and self.gpu_events) else None
        # hot-path copies: the pool list (grown in place), its next free index, the raw record
        # function and the stream pointer
        self._evs = self.gpu.events if self.gpu is not None else None
        self._n = 0
        self._last = -1
        self._rec = self.gpu.record if self.gpu is not None else None
        self._sptr = self.gpu.stream if self.gpu is not None else 0
        nvtx_on = self.nvtx_on if self.nvtx_on is not None else nvtx_tool_attached()
        self.nvtx_active = bool(self.cuda and nvtx_on)
        nv = Nvtx(cp) if self.nvtx_active else None
        self._push = nv.push if nv is not None and nv.available else None
        self._pop = nv.pop if self._push is not None else None
        self.mem = MemoryTracker() if self.memory else None
        self._array_track = self.mem is not None and not self.cuda
        self.memory_source = "op outputs (root buffers)" if self.mem is not None else "off"
        self.baseline_bytes = 0
        if self.mem is not None and self.cuda:
            self.mem.device_id = _device_index(cp)
            blu = _bluallocator_listener()
            if uses_cupy_pool(cp):
                self.mem.install_cuda_hook(cp)
                self.baseline_bytes = int(cp.get_default_memory_pool().used_bytes())
                self.memory_source = "CuPy memory pool hook"
            elif blu is not None:
                self.mem.install_listener(*blu)
                self.memory_source = "bluallocator listener"
            else:
                # another allocator that reports nothing: track op outputs instead
                self._array_track = True
                self.memory_source = ("op outputs (root buffers): the CuPy allocator is not a MemoryPool, "
                                      "so pool hooks see nothing")
        _mem.OWNER = "other"
        _shapes.clear()  # bounded by one session's distinct shapes
        if self.mem is not None:
            self.mem.start()
        self.t0 = _now()
        self.wall0_ns = time.time_ns()
        self.pid = os.getpid()
        ext.add_op_observer(self._observe)
        self._observing = True
        if self.backward:
            ext.add_backward_observer(self._observe_backward)
            self._observing_bwd = True
        self._comms, self._comm_open = [], 0
        dtms = sys.modules.get("dtms")  # never imported here: a run with process groups has it already
        if dtms is not None and hasattr(dtms, "add_collective_observer"):
            dtms.add_collective_observer(self._observe_collective)
            self._comm_api = dtms
        self._running = True

    def _detach(self) -> None:
        """Remove everything this session installed (observers, memory hook or listener)."""
        from blutensor import ext

        if self._observing:
            ext.remove_op_observer(self._observe)
            self._observing = False
        if self._observing_bwd:
            ext.remove_backward_observer(self._observe_backward)
            self._observing_bwd = False
        if self._comm_api is not None:
            self._comm_api.remove_collective_observer(self._observe_collective)
            self._comm_api = None
        if self.mem is not None:
            self.mem.stop()
        _mem.OWNER = "other"

    def stop(self) -> ProfileResult:
        if not self._running:
            raise ProfilerError("Profiler.stop(): the session is not running")
        t1 = _now()
        self._running = False
        try:
            self._detach()
            self.events = self._events()
            self._raw = []
            if self.gpu is not None:
                self.gpu.resolve(self.events)
            comms = sorted(self._comms, key=lambda c: c.start_ns)
            self._comms = []
            resolve_gpu_times(comms, self.gpu)
            compute_overlap(comms, [e for e in self.events if e.phase != "region"])
        finally:
            _release()
        mem_events = self.mem.build_events() if self.mem is not None else []
        self._result = ProfileResult(
            events=self.events, mem_events=mem_events, t0=self.t0, t1=t1, wall0_ns=self.wall0_ns,
            device="cuda" if self.cuda else "cpu", gpu_timing=self.gpu is not None,
            baseline_bytes=self.baseline_bytes, pid=self.pid)
        self._result.meta["memory_source"] = self.memory_source
        self._result.meta["cuda_events_recorded"] = self._n
        self._result.meta["nvtx"] = self.nvtx_active
        self._result.comms = comms
        if self._comm_open:
            self._result.meta["collectives_unfinished"] = self._comm_open
        return self._result

    def __enter__(self) -> Profiler:
        return self.start()

    def __exit__(self, *exc) -> None:
        if self._running:
            self.stop()

    @property
    def result(self) -> ProfileResult:
        if self._result is None:
            raise ProfilerError("Profiler.result: the session has not stopped yet (leave the with-block first)")
        return self._result

    def _observe_collective(self, phase: str, rec: Any) -> None:
        """dtms collective observer: a CommEvent per collective completed while the session runs."""
        if phase == "start":
            self._comm_open += 1
            return
        self._comm_open -= 1
        self._comms.append(CommEvent(rec.op, rec.backend, tuple(rec.group), rec.rank, rec.nbytes, rec.dtype,
                                     rec.reduce_op, rec.async_op, rec.start_ns, rec.issued_ns, rec.end_ns,
                                     rec.stream, _tid(), _events=rec.device_events))

    # ---- the hot path: set the owner, record two raw pool events, append one tuple ----
    # _observe and _observe_backward inline the span open/close (no helper calls per span); region
    # uses _open/_close.
    def _open(self, key: str) -> tuple:
        """Start a span named ``key``: (previous owner, depth, start event index, stream, index, t0)."""
        prev = _mem.OWNER
        _mem.OWNER = key
        d = self._depth
        self._depth = d + 1
        if self._push is not None:
            self._push(key)
        evs = self._evs
        if evs is not None:
            i = self._n
            if i + 2 > len(evs):
                self.gpu.grow()
            self._n = i + 2
            self._rec(evs[i], self._sptr)
            self._last = i
            s = self._sptr
        else:
            i, s = None, 0
        return prev, d, i, s, self._next(), _now()

    def _close(self, tok: tuple) -> int:
        """End the span opened as ``tok``; returns t1."""
        t1 = _now()
        i = tok[2]
        if i is not None:
            self._rec(self._evs[i + 1], self._sptr)
            self._last = i + 1
        if self._pop is not None:
            self._pop()
        self._depth = tok[1]
        _mem.OWNER = tok[0]
        return t1

    def _observe(self, op: str, inputs, attrs, run):
        key = op + ".forward"
        prev = _mem.OWNER
        _mem.OWNER = key
        d = self._depth
        self._depth = d + 1
        push = self._push
        if push is not None:
            push(key)
        evs = self._evs
        if evs is None or op in _HOST_FWD:
            i = j = None
            s = 0
        elif self._chain:  # one event, at the end; the start is the latest event before this span
            i, j, s = self._last, -1, self._sptr
        else:
            i = self._n
            if i + 2 > len(evs):
                self.gpu.grow()
            self._n = i + 2
            j = i + 1
            s = self._sptr
            self._rec(evs[i], s)
        idx = self._next()
        t0 = _now()
        try:
            res = run()
        finally:
            t1 = _now()
            if j is not None:
                if j < 0:
                    j = self._n
                    if j + 1 > len(evs):
                        self.gpu.grow()
                    self._n = j + 1
                    self._last = j
                self._rec(evs[j], s)
            if push is not None:
                self._pop()
            self._depth = d
            _mem.OWNER = prev
        node = getattr(res, "grad_fn", None)
        if self.record_shapes:
            try:  # all inputs tensors (the common case): C-level map, no Python frame
                shapes = tuple(map(_data_shape, inputs))
            except AttributeError:
                shapes = tuple([x._data.shape if isinstance(x, _Tensor) else None for x in inputs])
            # interned: a step repeats a few hundred distinct shapes, so the span keeps a shared
            # tuple and the fresh ones die at once (fewer tracked survivors: fewer gc passes)
            shapes = _interned(shapes, shapes)
            out_shape = res._data.shape if isinstance(res, _Tensor) else None
            if out_shape is not None:
                out_shape = _interned(out_shape, out_shape)
            if node is not None:
                meta = node.meta
                if meta is None:
                    node.meta = {"in_shapes": shapes, "out_shape": out_shape}
                elif isinstance(meta, dict):
                    meta.setdefault("in_shapes", shapes)
                    meta.setdefault("out_shape", out_shape)
        else:
            shapes = out_shape = None
        # never keep ``inputs`` (that would extend the tensors' lifetimes); strings and ints only, so
        # that the garbage collector untracks the tuple (a growing list of tracked tuples slows gc)
        if node is not None:
            kernel = _knames.get(node.kernel)
            if kernel is None:
                kernel = _knames[node.kernel] = _kernel_name(node.kernel)
        else:
            try:  # no node (no grad): the kernel dispatch picked for (op, device type, dtype), cached
                x0 = inputs[0]
                kernel = _kernel_names[(op, x0.device.type, x0.dtype.name)]
            except (IndexError, AttributeError, KeyError):
                kernel = _resolved_kernel(op, inputs)
        self._raw.append((op, "forward", kernel, idx, d, _tid(), t0, t1, shapes, out_shape, i, j, s))
        if self._array_track:
            self.mem.track(res._data, key, tuple([getattr(x, "_data", None) for x in inputs]))
        return res

    def _observe_backward(self, node, grad, run):
        op = node.op
        key = op + ".backward"
        prev = _mem.OWNER
        _mem.OWNER = key
        d = self._depth
        self._depth = d + 1
        push = self._push
        if push is not None:
            push(key)
        evs = self._evs
        kcls = node.kernel
        i = j = None
        s = 0
        if evs is not None:
            view = _HOST_BWD.get(kcls)
            if view is None or not (view or _c_contiguous(grad)):
                s = self._sptr
                if self._chain:
                    i, j = self._last, -1
                else:
                    i = self._n
                    if i + 2 > len(evs):
                        self.gpu.grow()
                    self._n = i + 2
                    j = i + 1
                    self._rec(evs[i], s)
        idx = self._next()
        t0 = _now()
        try:
            grads = run()
        finally:
            t1 = _now()
            if j is not None:
                if j < 0:
                    j = self._n
                    if j + 1 > len(evs):
                        self.gpu.grow()
                    self._n = j + 1
                    self._last = j
                self._rec(evs[j], s)
            if push is not None:
                self._pop()
            self._depth = d
            _mem.OWNER = prev
        kernel = _knames.get(kcls)
        if kernel is None:
            kernel = _knames[kcls] = _kernel_name(kcls)
        self._raw.append((op, "backward", kernel, idx, d, _tid(), t0, t1, None, None, i, j, s))
        if self._array_track:
            for g in grads:
                g = getattr(g, "grad", g)  # bt.autograd.Summed: the array it carries
                if g is not None and hasattr(g, "dtype"):  # not bt.autograd.ACCUMULATED (added into a .grad)
                    self.mem.track(g, key, (grad,))
        return grads

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Time a named range (a step, the optimizer, a data load) as its own span and memory owner."""
        if not isinstance(name, str):
            raise TypeError(f"bluprofiler: a region name must be a str, got {type(name).__name__} {name!r}")
        tok = self._open(name)
        try:
            yield
        finally:
            t1 = self._close(tok)
            i = tok[2]
            self._raw.append((name, "region", "", tok[4], tok[1], _tid(), tok[5], t1, None, None,
                              i, None if i is None else i + 1, tok[3]))

    def _events(self) -> list[OpEvent]:
        """The raw span tuples as OpEvents (kernel names resolved), in start order."""
        out = []
        timed = self.gpu is not None
        for name, phase, kernel, idx, depth, tid, t0, t1, shapes, out_shape, ev0, ev1, stream in self._raw:
            e = OpEvent(name, phase, kernel, idx, depth, tid, t0, t1,
                        tuple(tuple(s) if s is not None else None for s in shapes) if shapes is not None else None,
                        tuple(out_shape) if out_shape is not None else None, stream)
            if ev1 is not None:
                e._ev = (ev0, ev1)  # pool indices of start (-1: the base event) and end
            elif timed:
                e.host_only = True
                e.stream = self._sptr
            out.append(e)
        out.sort(key=lambda e: e.index)
        return out


def _c_contiguous(a: Any) -> bool:
    flags = getattr(a, "flags", None)
    return bool(flags is not None and flags.c_contiguous)


def _bind_view_ops() -> None:
    """Fill _HOST_FWD/_HOST_BWD from blutensor's op table (VIEW flag) at session start.

    A forward op is host-only when the table marks it VIEW and BF16_NATIVE (``expand`` is not: a
    bfloat16 input would be widened by a kernel) and dispatch picks the built-in kernel for CUDA (a
    plugin kernel registered for a view op may launch work: it keeps its events). A backward is
    host-only by its node's kernel class, which is the built-in's only for built-ins.
    """
    global _HOST_FWD
    from blutensor import ext

    fwd = set()
    for name in ext.op_names():
        k = ext.op_rule(name)
        if not (getattr(k, "VIEW", False) and getattr(k, "BF16_NATIVE", False)):
            continue  # (a bfloat16 input of a non-native op is widened first: a cast kernel)
        try:
            if all(ext.resolve_kernel(name, "cuda", dt) is k for dt in _CHECK_DTYPES):
                fwd.add(name)
        except Exception:
            continue
    _HOST_BWD.clear()
    for name, always in _NO_KERNEL_BACKWARD.items():
        k = ext.op_rule(name, missing_ok=True)
        if k is not None:
            _HOST_BWD[k] = always
    _HOST_FWD = frozenset(fwd)


def _device_index(cp: Any) -> int:
    try:
        return int(cp.cuda.runtime.getDevice())
    except Exception:
        return 0


def _bluallocator_listener() -> tuple | None:
    """(add_listener, remove_listener) of bluallocator when it is imported, installed as CuPy's
    allocator and offers listeners; else None. Never imports bluallocator."""
    blu = sys.modules.get("bluallocator")
    if blu is None:
        return None
    add, remove = getattr(blu, "add_listener", None), getattr(blu, "remove_listener", None)
    installed = getattr(blu, "is_installed", None)
    if add is None or remove is None or (installed is not None and not installed()):
        return None
    return add, remove


def uses_cupy_pool(cp: Any) -> bool:
    """True when CuPy allocates through a ``cupy.cuda.MemoryPool`` (whose malloc/free call memory hooks)."""
    try:
        alloc = cp.cuda.get_allocator()
    except Exception:
        return True  # cannot tell: assume CuPy's default
    owner = getattr(alloc, "__self__", None)
    pool_cls = getattr(cp.cuda, "MemoryPool", None)
    return owner is not None and pool_cls is not None and isinstance(owner, pool_cls)


def _release() -> None:
    global _active
    with _lock:
        _active = None


def _kernel_name(kernel: Any) -> str:
    k = getattr(kernel, "kernel", kernel)  # bf16-widened wrapper holds the real kernel
    return getattr(k, "PLUGIN_NAME", None) or getattr(k, "__name__", type(k).__name__)


_kernel_names: dict[tuple, str] = {}
#: shape tuples seen by any session (one shared object per distinct shape)
_shapes: dict[tuple, tuple] = {}
_interned = _shapes.setdefault
#: kernel class -> plugin name (a handful of entries)
_knames: dict = {}


def _resolved_kernel(op: str, inputs) -> str:
    """The kernel plugin name dispatch chose for an op that recorded no node (cached per key)."""
    for t in inputs:
        dev = getattr(t, "device", None)
        dt = getattr(t, "dtype", None)
        if dev is None or dt is None:
            continue
        key = (op, dev.type, dt.name)
        name = _kernel_names.get(key)
        if name is None:
            from blutensor import ext

            try:
                name = getattr(ext.resolve_kernel(op, dev.type, dt.name), "PLUGIN_NAME", "")
            except Exception:
                name = ""
            _kernel_names[key] = name
        return name
    return ""


def profile(timing: bool = True, memory: bool = True, nvtx: bool | None = None, record_shapes: bool = True,
            device: str | None = None, backward: bool = True, gpu_events: bool = True) -> Profiler:
    """A :class:`Profiler` to use as a context manager: ``with profile() as prof: step()``."""
    return Profiler(timing=timing, memory=memory, nvtx=nvtx, record_shapes=record_shapes, device=device,
                    backward=backward, gpu_events=gpu_events)


def active() -> Profiler | None:
    """The running profiler, or None."""
    return _active


@contextmanager
def record_function(name: str) -> Iterator[None]:
    """A named region in the running profiler (no-op when none is running), like torch's."""
    if not isinstance(name, str):  # checked without a profiler too, so the mistake shows on the first run
        raise TypeError(f"record_function: name must be a str, got {type(name).__name__} {name!r}")
    p = _active
    if p is None or not p._running:
        yield
        return
    with p.region(name):
        yield


def _shape(x: Any) -> tuple | None:
    s = getattr(x, "shape", None)
    return tuple(s) if s is not None else None


def _annotate(node: Any, shapes, out_shape) -> None:
    """Put input/output shapes on an autograd node (for the graph recorder)."""
    meta = node.meta
    if meta is None:
        node.meta = {"in_shapes": shapes, "out_shape": out_shape}
    elif isinstance(meta, dict):
        meta.setdefault("in_shapes", shapes)
        meta.setdefault("out_shape", out_shape)
