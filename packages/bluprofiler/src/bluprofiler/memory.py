"""Allocation tracking: every allocation and free with size, stream, owning op and a ns timestamp.

Three sources, all appending one plain tuple per event to ``MemoryTracker.raw`` (turned into
:class:`MemEvent` records when the session stops):

* CUDA, CuPy's memory pool: a ``cupy.cuda.MemoryHook`` subclass sees every pool ``malloc`` and
  ``free`` (plus the raw ``cudaMalloc`` reservations as ``reserve``).
* CUDA, bluallocator's caching allocator (installed with ``cupy.cuda.set_allocator``, so CuPy calls
  no hooks): ``bluallocator.add_listener(fn)``, ``fn(event, ptr, size, stream, ts_ns)``.
* CPU (and CuPy arrays when neither is available): op outputs and backward gradients are tracked
  when they own their buffer (the root of a view chain), and a ``weakref`` callback records the
  free when the buffer dies.

The owner of an allocation is :data:`OWNER` at that moment: the profiler's observers set it to the
running op (``matmul.forward``) or region and restore it after, so a callback reads one global.
A free gets the owner and stream of its allocation when the events are built.
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from typing import Any

from bluprofiler.events import MemEvent

_now = time.perf_counter_ns

#: what is running now (an op key, a region name, or "other"); set by the profiler
OWNER = "other"


class MemoryTracker:
    """Collects raw memory event tuples ``(ts_ns, kind, nbytes, addr, stream, owner, device)``;
    ``build_events()`` turns them into MemEvents (frees attributed to their allocation)."""

    def __init__(self):
        self.raw: list[tuple] = []
        self.device_id = 0
        # id(root buffer) -> (weakref to it, nbytes, owner, device); the weakref's callback records the free
        self._live: dict[int, tuple] = {}
        self._ref_key: dict[int, int] = {}
        self._hook = None
        self._listener = None
        self.active = False

    # ---- array-level tracking (CPU) ----
    def track(self, arr: Any, owner: str, exclude: tuple = ()) -> None:
        """Record the buffer behind ``arr`` as allocated by ``owner`` unless it is already tracked or
        is the buffer of one of ``exclude`` (the op's inputs: ``arr`` is then a view of an input);
        record its free when the buffer dies. A fresh result reshaped by the kernel is a view of a
        temporary: its root buffer is what was allocated."""
        root = arr if arr.base is None else root_of(arr)
        key = id(root)
        if key in self._live:
            return
        for x in exclude:
            if x is not None and (x is root or x.base is root or (x.base is not None and root_of(x) is root)):
                return
        try:
            r = weakref.ref(root, self._dead)
        except TypeError:
            return
        dev = "cpu" if type(root).__module__ == "numpy" else f"cuda:{root.device.id}"
        n = root.nbytes
        self._live[key] = (r, n, owner, dev)
        self._ref_key[id(r)] = key
        self.raw.append((_now(), "alloc", n, key, 0, owner, dev))

    def _dead(self, r: Any) -> None:
        key = self._ref_key.pop(id(r), None)
        rec = self._live.pop(key, None) if key is not None else None
        if rec is not None and self.active:
            self.raw.append((_now(), "free", rec[1], key, 0, rec[2], rec[3]))

    # ---- CUDA ----
    def install_cuda_hook(self, cupy: Any) -> None:
        self._hook = make_cupy_hook(cupy, self.raw)
        self._hook.__enter__()

    def install_listener(self, add: Any, remove: Any) -> None:
        """Subscribe to an allocator's ``fn(event, ptr, size, stream, ts_ns)`` events (bluallocator).
        Timestamps are ours (``perf_counter_ns``, the clock of the op spans)."""
        raw_append = self.raw.append
        dev = self.device_id

        def listener(event: str, ptr: int, size: int, stream: int, ts_ns: int = 0) -> None:
            raw_append((_now(), event, size, ptr, stream, OWNER if event == "alloc" else None, dev))

        add(listener)
        self._listener = (listener, remove)

    def start(self) -> None:
        self.active = True

    def stop(self) -> None:
        self.active = False
        if self._hook is not None:
            self._hook.__exit__(None, None, None)
            self._hook = None
        if self._listener is not None:
            fn, remove = self._listener
            self._listener = None
            remove(fn)
        self._live.clear()  # dropping the weakrefs drops their callbacks
        self._ref_key.clear()

    def build_events(self) -> list[MemEvent]:
        """The raw tuples as MemEvents: a free gets its allocation's owner and stream ("?" and 0 when
        it was allocated before the session); integer devices become ``cuda:<id>``."""
        out: list[MemEvent] = []
        live: dict[int, tuple] = {}
        devs: dict = {}
        for ts, kind, n, addr, stream, owner, dev in self.raw:
            d = devs.get(dev)
            if d is None:
                d = devs[dev] = dev if isinstance(dev, str) else f"cuda:{dev}"
            if kind == "alloc":
                live[addr] = (stream, owner)
            elif kind == "free" and owner is None:
                stream, owner = live.pop(addr, (stream, "?"))
            out.append(MemEvent(ts, kind, n, addr, stream, owner, d))
        return out

    @property
    def events(self) -> list[MemEvent]:
        return self.build_events()


def make_cupy_hook(cupy: Any, raw: list) -> Any:
    """A ``cupy.cuda.MemoryHook`` that appends one tuple per pool event to ``raw`` (defined lazily:
    CuPy is optional). Owner: the module's OWNER global; a free's owner is resolved later."""
    stream = cupy.cuda.get_current_stream
    append = raw.append

    class BluprofilerMemoryHook(cupy.cuda.MemoryHook):
        name = "bluprofiler"

        def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id, **_):
            append((_now(), "alloc", mem_size, mem_ptr, stream().ptr, OWNER, device_id))

        def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id, **_):
            append((_now(), "free", mem_size, mem_ptr, 0, None, device_id))

        def alloc_postprocess(self, device_id, mem_size, mem_ptr, **_):
            append((_now(), "reserve", mem_size, mem_ptr, stream().ptr, OWNER, device_id))

    return BluprofilerMemoryHook()


def root_of(a: Any) -> Any:
    """The array that owns the memory ``a`` views (``a`` itself when it owns it)."""
    b = getattr(a, "base", None)
    while b is not None and hasattr(b, "nbytes"):
        a, b = b, getattr(b, "base", None)
    return a


# ---- analysis ----

def timeline(events: list[MemEvent]) -> tuple[list[int], list[int], list[int]]:
    """(timestamps ns, allocated bytes, reserved bytes) after each event, in time order."""
    ts, alloc, resv = [], [], []
    cur = res = 0
    for e in sorted(events, key=lambda e: e.ts_ns):
        if e.kind == "alloc":
            cur += e.nbytes
        elif e.kind == "free":
            cur -= e.nbytes
        elif e.kind == "reserve":
            res += e.nbytes
        ts.append(e.ts_ns)
        alloc.append(cur)
        resv.append(res)
    return ts, alloc, resv


def peak(events: list[MemEvent]) -> dict:
    """The peak of allocated bytes (relative to the session start), when it happened, and the
    bytes live at that moment broken down by owner (largest first)."""
    evs = sorted((e for e in events if e.kind in ("alloc", "free")), key=lambda e: e.ts_ns)
    cur = best = 0
    best_i = -1
    for i, e in enumerate(evs):
        cur += e.nbytes if e.kind == "alloc" else -e.nbytes
        if cur > best:
            best, best_i = cur, i
    live: dict[int, MemEvent] = {}
    for e in evs[: best_i + 1]:
        if e.kind == "alloc":
            live[e.addr] = e
        else:
            live.pop(e.addr, None)
    by_owner: dict[str, int] = defaultdict(int)
    for e in live.values():
        by_owner[e.owner] += e.nbytes
    return {"peak_bytes": best, "peak_ts_ns": evs[best_i].ts_ns if best_i >= 0 else None,
            "by_owner": dict(sorted(by_owner.items(), key=lambda kv: -kv[1])),
            "n_alloc": sum(e.kind == "alloc" for e in evs), "n_free": sum(e.kind == "free" for e in evs)}
