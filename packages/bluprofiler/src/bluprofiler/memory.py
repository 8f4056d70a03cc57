"""Allocation tracking: every allocation and free with size, stream, owning op and a ns timestamp.

Two sources, both feeding one list of :class:`MemEvent`:

* CUDA: a ``cupy.cuda.MemoryHook`` subclass sees every pool ``malloc`` and ``free`` (plus the raw
  ``cudaMalloc`` reservations as ``reserve``) and attributes each to the op executing at that time.
  It sees CuPy's own memory pool only; an allocator installed with ``cupy.cuda.set_allocator``
  (bluallocator's caching allocator) bypasses CuPy's hooks.
* CPU (and CuPy arrays when the hook is off): op outputs and backward gradients are tracked when
  they own their buffer (the root of a view chain), and a ``weakref`` callback records the free
  when the buffer dies.
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from bluprofiler.events import MemEvent

_now = time.perf_counter_ns


class MemoryTracker:
    """Collects MemEvents; ``owner()`` names whatever is running (an op, a region, or "other")."""

    def __init__(self, owner: Callable[[], str]):
        self.events: list[MemEvent] = []
        self.owner = owner
        # id(root buffer) -> (weakref to it, nbytes, owner, device); the weakref's callback records the free
        self._live: dict[int, tuple] = {}
        self._ref_key: dict[int, int] = {}
        self._hook = None
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
            if x is not None and (x is root or x.base is root or root_of(x) is root):
                return
        try:
            r = weakref.ref(root, self._dead)
        except TypeError:
            return
        dev = "cpu" if type(root).__module__ == "numpy" else f"cuda:{root.device.id}"
        n = root.nbytes
        self._live[key] = (r, n, owner, dev)
        self._ref_key[id(r)] = key
        self.events.append(MemEvent(_now(), "alloc", n, key, 0, owner, dev))

    def _dead(self, r: Any) -> None:
        key = self._ref_key.pop(id(r), None)
        rec = self._live.pop(key, None) if key is not None else None
        if rec is not None and self.active:
            self.events.append(MemEvent(_now(), "free", rec[1], key, 0, rec[2], rec[3]))

    # ---- CUDA memory hook ----
    def install_cuda_hook(self, cupy: Any) -> None:
        self._hook = make_cupy_hook(cupy, self)
        self._hook.__enter__()

    def start(self) -> None:
        self.active = True

    def stop(self) -> None:
        self.active = False
        if self._hook is not None:
            self._hook.__exit__(None, None, None)
            self._hook = None
        self._live.clear()  # dropping the weakrefs drops their callbacks
        self._ref_key.clear()


def make_cupy_hook(cupy: Any, tracker: MemoryTracker) -> Any:
    """A ``cupy.cuda.MemoryHook`` that appends to ``tracker.events`` (defined lazily: CuPy is optional)."""

    class BluprofilerMemoryHook(cupy.cuda.MemoryHook):
        name = "bluprofiler"

        def __init__(self):
            super().__init__()
            self.live: dict[int, tuple[int, int, str]] = {}
            self.stream = cupy.cuda.get_current_stream

        def malloc_postprocess(self, **kw):
            ptr, size, dev = kw["mem_ptr"], kw["mem_size"], kw["device_id"]
            owner = tracker.owner()
            s = self.stream().ptr
            self.live[ptr] = (size, s, owner)
            tracker.events.append(MemEvent(_now(), "alloc", size, ptr, s, owner, f"cuda:{dev}"))

        def free_postprocess(self, **kw):
            ptr, size, dev = kw["mem_ptr"], kw["mem_size"], kw["device_id"]
            _, s, owner = self.live.pop(ptr, (size, 0, "?"))
            tracker.events.append(MemEvent(_now(), "free", size, ptr, s, owner, f"cuda:{dev}"))

        def alloc_postprocess(self, **kw):
            tracker.events.append(MemEvent(_now(), "reserve", kw["mem_size"], kw["mem_ptr"],
                                           self.stream().ptr, tracker.owner(), f"cuda:{kw['device_id']}"))

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
