"""The Profiler: one context manager that times every op (forward and backward), tracks memory,
emits NVTX ranges and hands a :class:`ProfileResult` to the table, trace and plot writers.

How it attaches (and detaches, leaving no trace when off):

* forward: ``blutensor.ops.dispatch.add_observer`` wraps every op call;
* backward: backward formulas run in ``Node.apply`` (called by the autograd engine), not through
  ``dispatch.apply``; while a profiler is active ``Node.apply`` is replaced on the class by a timed
  wrapper and restored on exit. This is the non-invasive stand-in for an engine observer hook.

With no profiler active nothing of ours is on the op path: the observer list is empty (one
truthiness test per op, as without bluprofiler) and ``Node.apply`` is blutensor's own function.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bluprofiler.events import OpEvent
from bluprofiler.memory import MemoryTracker
from bluprofiler.result import ProfileResult
from bluprofiler.timing import GpuTimer, Nvtx, cupy_or_none

_now = time.perf_counter_ns
_tid = threading.get_ident
_active: Profiler | None = None
_lock = threading.Lock()


class ProfilerError(RuntimeError):
    """Misuse of the profiler (nested sessions, reading results of a running session, bad options)."""


def _shape(x: Any) -> tuple | None:
    s = getattr(x, "shape", None)
    return tuple(s) if s is not None else None


class Profiler:
    """``with Profiler(timing=True, memory=True, nvtx=True) as prof: ...`` then ``prof.result``.

    timing: host time per op always; CUDA-event GPU time per op when ``device`` is CUDA.
    memory: allocation tracking (CuPy memory hook on CUDA, op-output tracking on CPU).
    nvtx: NVTX ranges named ``op.forward`` / ``op.backward`` / region (CUDA only).
    record_shapes: input/output shapes per op event (and on autograd nodes, for the graph recorder).
    device: "cpu", "cuda" or None (auto: CUDA when CuPy sees a GPU).
    """

    def __init__(self, timing: bool = True, memory: bool = True, nvtx: bool = True, record_shapes: bool = True,
                 device: str | None = None, backward: bool = True):
        if device not in (None, "cpu", "cuda") and not str(device).startswith("cuda"):
            raise ProfilerError(f"Profiler: device must be 'cpu', 'cuda' or None, got {device!r}")
        self.timing, self.memory, self.nvtx_on = timing, memory, nvtx
        self.record_shapes, self.backward = record_shapes, backward
        self.device = device
        self.events: list[OpEvent] = []
        self._raw: list[tuple] = []
        self._stack: list[str] = []
        self._index = 0
        self._running = False
        self._result: ProfileResult | None = None
        self._orig_apply = None

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
        from blutensor.ops import dispatch

        cp = None if self.device == "cpu" else cupy_or_none()
        if str(self.device).startswith("cuda") and cp is None:
            raise ProfilerError("Profiler(device='cuda'): CuPy with a visible GPU is needed "
                                "(pip install cupy-cuda12x)")
        self.cuda = cp is not None
        self.gpu = GpuTimer(cp) if (self.cuda and self.timing) else None
        nv = Nvtx(cp) if (self.cuda and self.nvtx_on) else None
        self._push = nv.push if nv is not None and nv.available else None
        self._pop = nv.pop if self._push is not None else None
        self.mem = MemoryTracker(self._owner) if self.memory else None
        self._array_track = self.mem is not None and not self.cuda
        self.memory_source = "op outputs (root buffers)" if self.mem is not None else "off"
        self.baseline_bytes = 0
        if self.mem is not None and self.cuda:
            if uses_cupy_pool(cp):
                self.mem.install_cuda_hook(cp)
                self.baseline_bytes = int(cp.get_default_memory_pool().used_bytes())
                self.memory_source = "CuPy memory pool hook"
            else:
                # another allocator (e.g. bluallocator's) bypasses CuPy's hooks: track op outputs instead
                self._array_track = True
                self.memory_source = ("op outputs (root buffers): the CuPy allocator is not a MemoryPool, "
                                      "so pool hooks see nothing")
        if self.mem is not None:
            self.mem.start()
        self.t0 = _now()
        self.wall0_ns = time.time_ns()
        self.pid = os.getpid()
        dispatch.add_observer(self._observe)
        if self.backward:
            self._patch_backward()
        self._running = True

    def _detach(self) -> None:
        """Remove everything this session installed (observer, Node.apply wrapper, memory hook)."""
        from blutensor.ops import dispatch

        dispatch.remove_observer(self._observe)
        self._unpatch_backward()
        if self.mem is not None:
            self.mem.stop()

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
        finally:
            _release()
        mem_events = self.mem.events if self.mem is not None else []
        self._result = ProfileResult(
            events=self.events, mem_events=mem_events, t0=self.t0, t1=t1, wall0_ns=self.wall0_ns,
            device="cuda" if self.cuda else "cpu", gpu_timing=self.gpu is not None,
            baseline_bytes=self.baseline_bytes, pid=self.pid)
        self._result.meta["memory_source"] = self.memory_source
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

    # ---- attribution (the hot path: raw tuples now, OpEvents when the session stops) ----
    def _owner(self) -> str:
        return self._stack[-1] if self._stack else "other"

    def _observe(self, op: str, inputs, attrs, run):
        stack = self._stack
        key = op + ".forward"
        idx = self._index
        self._index = idx + 1
        depth = len(stack)
        stack.append(key)
        gpu = self.gpu
        if self._push is not None:
            self._push(key)
        ga = gpu.begin() if gpu is not None else None
        t0 = _now()
        try:
            res = run()
        finally:
            t1 = _now()
            gb = gpu.end() if gpu is not None else None
            if self._pop is not None:
                self._pop()
            stack.pop()
        node = getattr(res, "grad_fn", None)
        if self.record_shapes:
            shapes = tuple([getattr(x, "shape", None) for x in inputs])
            out_shape = getattr(res, "shape", None)
            if node is not None:
                _annotate(node, shapes, out_shape)
        else:
            shapes = out_shape = None
        # never keep ``inputs`` (that would extend the tensors' lifetimes): a kernel class or a name
        kernel = node.kernel if node is not None else _resolved_kernel(op, inputs)
        self._raw.append((op, "forward", kernel, idx, depth, _tid(), t0, t1, shapes, out_shape, ga, gb))
        if self._array_track:
            self.mem.track(res._data, key, tuple([getattr(x, "_data", None) for x in inputs]))
        return res

    def _span(self, name: str, phase: str, kernel, fn, *args):
        """Run ``fn(*args)`` as one span (regions and backward nodes)."""
        stack = self._stack
        key = name if phase == "region" else f"{name}.{phase}"
        idx = self._index
        self._index = idx + 1
        depth = len(stack)
        stack.append(key)
        gpu = self.gpu
        if self._push is not None:
            self._push(key)
        ga = gpu.begin() if gpu is not None else None
        t0 = _now()
        try:
            return fn(*args)
        finally:
            t1 = _now()
            gb = gpu.end() if gpu is not None else None
            if self._pop is not None:
                self._pop()
            stack.pop()
            self._raw.append((name, phase, kernel, idx, depth, _tid(), t0, t1, None, None, ga, gb))

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Time a named range (a step, the optimizer, a data load) as its own span and memory owner."""
        stack = self._stack
        idx = self._index
        self._index = idx + 1
        depth = len(stack)
        stack.append(name)
        gpu = self.gpu
        if self._push is not None:
            self._push(name)
        ga = gpu.begin() if gpu is not None else None
        t0 = _now()
        try:
            yield
        finally:
            t1 = _now()
            gb = gpu.end() if gpu is not None else None
            if self._pop is not None:
                self._pop()
            stack.pop()
            self._raw.append((name, "region", "", idx, depth, _tid(), t0, t1, None, None, ga, gb))

    def _events(self) -> list[OpEvent]:
        """The raw span tuples as OpEvents (kernel names resolved), in start order."""
        out = []
        for name, phase, kernel, idx, depth, tid, t0, t1, shapes, out_shape, ga, gb in self._raw:
            if not isinstance(kernel, str):
                kernel = _kernel_name(kernel)
            e = OpEvent(name, phase, kernel, idx, depth, tid, t0, t1,
                        tuple(tuple(s) if s is not None else None for s in shapes) if shapes is not None else None,
                        tuple(out_shape) if out_shape is not None else None)
            if ga is not None:
                e._ev, e.stream = (ga[0], gb), ga[1]
            out.append(e)
        out.sort(key=lambda e: e.start_ns)
        return out

    # ---- backward ----
    def _patch_backward(self) -> None:
        from blutensor.autograd.node import Node

        orig = Node.apply
        prof = self

        def apply(node, grad):
            grads = prof._span(node.op, "backward", node.kernel, orig, node, grad)
            if prof._array_track:
                key = node.op + ".backward"
                for g in grads if isinstance(grads, tuple) else (grads,):
                    if g is not None:
                        prof.mem.track(g, key, (grad,))
            return grads

        apply.__wrapped__ = orig
        self._orig_apply = orig
        Node.apply = apply

    def _unpatch_backward(self) -> None:
        if self._orig_apply is None:
            return
        from blutensor.autograd.node import Node

        Node.apply = self._orig_apply
        self._orig_apply = None


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
            from blutensor.ops import dispatch

            try:
                name = getattr(dispatch.resolve(op, dev.type, dt.name), "PLUGIN_NAME", "")
            except Exception:
                name = ""
            _kernel_names[key] = name
        return name
    return ""


def _annotate(node: Any, shapes, out_shape) -> None:
    meta = node.meta
    if meta is None:
        node.meta = meta = {}
    if isinstance(meta, dict):
        meta.setdefault("in_shapes", shapes)
        meta.setdefault("out_shape", out_shape)


def profile(timing: bool = True, memory: bool = True, nvtx: bool = True, record_shapes: bool = True,
            device: str | None = None, backward: bool = True) -> Profiler:
    """A :class:`Profiler` to use as a context manager: ``with profile() as prof: step()``."""
    return Profiler(timing=timing, memory=memory, nvtx=nvtx, record_shapes=record_shapes, device=device,
                    backward=backward)


def active() -> Profiler | None:
    """The running profiler, or None."""
    return _active


@contextmanager
def record_function(name: str) -> Iterator[None]:
    """A named region in the running profiler (no-op when none is running), like torch's."""
    p = _active
    if p is None or not p._running:
        yield
        return
    with p.region(name):
        yield
