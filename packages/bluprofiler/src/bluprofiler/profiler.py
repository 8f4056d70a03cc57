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
        from blutensor.ops import dispatch

        cp = None if self.device == "cpu" else cupy_or_none()
        if str(self.device).startswith("cuda") and cp is None:
            _release()
            raise ProfilerError("Profiler(device='cuda'): CuPy with a visible GPU is needed "
                                "(pip install cupy-cuda12x)")
        self.cuda = cp is not None
        self.gpu = GpuTimer(cp) if (self.cuda and self.timing) else None
        nv = Nvtx(cp) if (self.cuda and self.nvtx_on) else None
        self._push = nv.push if nv is not None and nv.available else None
        self._pop = nv.pop if self._push is not None else None
        self.mem = MemoryTracker(self._owner) if self.memory else None
        self._cpu_track = self.mem is not None and not self.cuda
        if self.mem is not None:
            if self.cuda:
                self.mem.install_cuda_hook(cp)
                pool = cp.get_default_memory_pool()
                self.baseline_bytes = int(pool.used_bytes())
            else:
                self.baseline_bytes = 0
            self.mem.start()
        self.t0 = _now()
        self.wall0_ns = time.time_ns()
        self.pid = os.getpid()
        dispatch.add_observer(self._observe)
        if self.backward:
            self._patch_backward()
        self._running = True
        return self

    def stop(self) -> ProfileResult:
        global _active
        if not self._running:
            raise ProfilerError("Profiler.stop(): the session is not running")
        from blutensor.ops import dispatch

        dispatch.remove_observer(self._observe)
        self._unpatch_backward()
        self._running = False
        t1 = _now()
        if self.gpu is not None:
            self.gpu.resolve(self.events)
        mem_events = []
        if self.mem is not None:
            self.mem.stop()
            mem_events = self.mem.events
        self._result = ProfileResult(
            events=self.events, mem_events=mem_events, t0=self.t0, t1=t1, wall0_ns=self.wall0_ns,
            device="cuda" if self.cuda else "cpu", gpu_timing=self.gpu is not None,
            baseline_bytes=getattr(self, "baseline_bytes", 0), pid=self.pid)
        _release()
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

    # ---- attribution ----
    def _owner(self) -> str:
        return self._stack[-1] if self._stack else "other"

    def _begin(self, name: str, phase: str, kernel: str, shapes) -> OpEvent:
        key = name if phase == "region" else f"{name}.{phase}"
        ev = OpEvent(name, phase, kernel, self._index, len(self._stack), threading.get_ident(), 0,
                     shapes=shapes)
        self._index += 1
        self._stack.append(key)
        if self._push is not None:
            self._push(key)
        if self.gpu is not None:
            a, ev.stream = self.gpu.begin()
            ev._ev = (a, None)
        ev.start_ns = _now()
        return ev

    def _end(self, ev: OpEvent) -> None:
        ev.end_ns = _now()
        if self.gpu is not None:
            ev._ev = (ev._ev[0], self.gpu.end())
        if self._pop is not None:
            self._pop()
        self._stack.pop()
        self.events.append(ev)

    def _observe(self, op: str, inputs, attrs, run):
        shapes = tuple(_shape(x) for x in inputs) if self.record_shapes else None
        ev = self._begin(op, "forward", "", shapes)
        try:
            res = run()
        finally:
            self._end(ev)
        node = getattr(res, "grad_fn", None)
        if node is not None:
            ev.kernel = _kernel_name(node.kernel)
            if self.record_shapes:
                _annotate(node, shapes, _shape(res))
        else:
            ev.kernel = _resolved_kernel(op, inputs)
        if self.record_shapes:
            ev.out_shape = _shape(res)
        if self._cpu_track:
            self.mem.track(res._data, ev.key, tuple(getattr(x, "_data", None) for x in inputs))
        return res

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Time a named range (a step, the optimizer, a data load) as its own span and memory owner."""
        ev = self._begin(name, "region", "", None)
        try:
            yield
        finally:
            self._end(ev)

    # ---- backward ----
    def _patch_backward(self) -> None:
        from blutensor.autograd.node import Node

        orig = Node.apply
        prof = self

        def apply(node, grad):
            ev = prof._begin(node.op, "backward", _kernel_name(node.kernel), None)
            try:
                grads = orig(node, grad)
            finally:
                prof._end(ev)
            if prof._cpu_track:
                for g in grads if isinstance(grads, tuple) else (grads,):
                    if g is not None:
                        prof.mem.track(g, ev.key, (grad,))
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
