"""CUDA graphs: capture a sequence of kernel launches once, replay it with one launch (PyTorch's names).

    g = bt.cuda.CUDAGraph()
    with bt.cuda.graph(g):          # capture on a side stream into a private memory pool
        out = step(static_x)        # nothing runs now: kernels are recorded
    static_x.copy_(new_x); g.replay()   # out now holds the result for new_x

Rules (docs/design.md, section 5): no host sync inside the capture (no .item()/.numpy()/bool() of device data);
GEMMs through a capture-safe provider (blublas 'cublas' = cuBLASLt through ctypes on the capture stream,
or BluBLAS's own kernels; CuPy's cuBLAS refuses capture); every array the graph reads or writes keeps its
address while the graph lives (static inputs are copied into, never replaced); values that change per
step (learning rate, step count, RNG offset) live in device memory. Allocations during capture come from a
private pool that nothing else uses while the graph lives: bluallocator's ``graph_pool`` when bluallocator
is CuPy's allocator, else a dedicated ``cupy.cuda.MemoryPool``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from blutensor.errors import BluTensorError

#: capture mode: 'relaxed' lets the private pool call cudaMalloc while capturing (as PyTorch's allocator
#: does); 'global' / 'thread_local' are CUDA's stricter modes
DEFAULT_MODE = "relaxed"


def _cp():
    from blutensor.backends.cupy import require_cuda

    return require_cuda()


def _mode(cp, name: str) -> int:
    rt = cp.cuda.runtime
    table = {"global": "streamCaptureModeGlobal", "thread_local": "streamCaptureModeThreadLocal",
             "relaxed": "streamCaptureModeRelaxed"}
    if name not in table:
        raise ValueError(f"capture_error_mode must be one of {sorted(table)}, got {name!r}")
    return int(getattr(rt, table[name], {"global": 0, "thread_local": 1, "relaxed": 2}[name]))


def _graph_allocator():
    """The cuda backend's graph-capable allocator (an installed allocator plugin's), None without one."""
    from blutensor.backends.cupy import CupyBackend

    return CupyBackend.graph_allocator()


class _Pool:
    """A private allocation pool for one capture (kept alive as long as its graph)."""

    def __init__(self, cp):
        self.cp = cp
        self.blu = None
        self.pool_id = None
        self.cupy_pool = None
        self.blu = _graph_allocator()
        if self.blu is None:
            self.cupy_pool = cp.cuda.MemoryPool()

    @contextlib.contextmanager
    def active(self):
        """Route this thread's CuPy allocations to the pool inside the block."""
        if self.blu is not None:
            with self.blu.graph_pool(self.pool_id) as pid:
                self.pool_id = pid
                yield
            return
        with self.cp.cuda.using_allocator(self.cupy_pool.malloc):
            yield

    def used_bytes(self) -> int:
        return int(self.cupy_pool.total_bytes()) if self.cupy_pool is not None else -1


_CAPTURE_STREAMS: dict[int, Any] = {}


def _capture_stream(cp: Any) -> Any:
    """The current device's default capture stream (made once)."""
    dev = cp.cuda.Device().id
    if dev not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[dev] = cp.cuda.Stream(non_blocking=True)
    return _CAPTURE_STREAMS[dev]


class CUDAGraph:
    """One captured CUDA graph: ``capture_begin()``/``capture_end()`` (or :class:`graph`), then ``replay()``."""

    def __init__(self) -> None:
        self._graph = None
        self._stream = None
        self._pool: _Pool | None = None
        self._capturing = False

    def capture_begin(self, pool: Any = None, capture_error_mode: str = DEFAULT_MODE, stream: Any = None) -> None:
        """Start capturing the current thread's launches on ``stream`` (default: the device's one capture side
        stream, shared by every capture as in PyTorch: a caching allocator keeps free blocks per stream, so graphs
        sharing a pool reuse each other's memory only when they were captured on the same stream)."""
        cp = _cp()
        if self._graph is not None or self._capturing:
            raise BluTensorError("CUDAGraph.capture_begin: this graph was already captured; make a new CUDAGraph")
        self._stream = stream if stream is not None else _capture_stream(cp)
        self._pool = pool if isinstance(pool, _Pool) else _Pool(cp)
        prev = cp.cuda.get_current_stream()
        self._stream.wait_event(prev.record())  # the capture sees everything queued before it
        self._stream_ctx = self._stream.__enter__()
        self._pool_ctx = self._pool.active()
        self._pool_ctx.__enter__()
        try:
            try:
                self._stream.begin_capture(mode=_mode(cp, capture_error_mode))
            except TypeError:  # a CuPy without the mode argument: its default (global) mode
                self._stream.begin_capture()
        except Exception:
            self._pool_ctx.__exit__(None, None, None)
            self._stream.__exit__(None, None, None)
            raise
        self._capturing = True

    def capture_end(self) -> None:
        """Finish the capture (raises what CUDA reports, e.g. a host sync or a non-capturable call inside)."""
        if not self._capturing:
            raise BluTensorError("CUDAGraph.capture_end without capture_begin")
        self._capturing = False
        try:
            self._graph = self._stream.end_capture()
        finally:
            self._pool_ctx.__exit__(None, None, None)
            self._stream.__exit__(None, None, None)

    def abort(self) -> None:
        """End a failed capture, discarding it (the stream leaves capture mode)."""
        if self._capturing:
            self._capturing = False
            with contextlib.suppress(Exception):
                self._stream.end_capture()
            self._pool_ctx.__exit__(None, None, None)
            self._stream.__exit__(None, None, None)

    def replay(self) -> None:
        """Launch the captured graph on the current stream (asynchronous: no host sync)."""
        if self._graph is None:
            raise BluTensorError("CUDAGraph.replay: nothing captured yet (use bt.cuda.graph(g) first)")
        cp = _cp()
        self._graph.launch(cp.cuda.get_current_stream())

    def pool(self) -> _Pool | None:
        """The private pool (pass it to another capture to share memory, as in PyTorch)."""
        return self._pool

    def reset(self) -> None:
        """Drop the graph and its pool (arrays allocated during capture must not be used afterwards)."""
        self._graph = None
        self._pool = None


class graph:  # noqa: N801 - PyTorch's name
    """Context manager capturing the block into ``cuda_graph`` (on a side stream, into a private pool)."""

    def __init__(self, cuda_graph: CUDAGraph, pool: Any = None, stream: Any = None,
                 capture_error_mode: str = DEFAULT_MODE) -> None:
        self.g, self.pool, self.stream, self.mode = cuda_graph, pool, stream, capture_error_mode

    def __enter__(self) -> CUDAGraph:
        cp = _cp()
        cp.cuda.get_current_stream().synchronize()  # outside the capture: start from a quiet stream
        self.g.capture_begin(self.pool, self.mode, self.stream)
        return self.g

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.g.abort()
            return
        self.g.capture_end()


def run_warmup(fn: Callable[[], Any], steps: int) -> Any:
    """Run ``fn`` ``steps`` times on a side stream (as PyTorch does before capture), then join the stream."""
    cp = _cp()
    side = cp.cuda.Stream(non_blocking=True)
    cur = cp.cuda.get_current_stream()
    side.wait_event(cur.record())
    out = None
    with side:
        for _ in range(steps):
            out = fn()
    cur.wait_event(side.record())
    return out


class GraphedCallable:
    """``fn`` captured once over ``static_inputs``; calling it copies new inputs in and replays."""

    def __init__(self, g: CUDAGraph, static_inputs: tuple, static_output: Any) -> None:
        self.graph, self.static_inputs, self.static_output = g, static_inputs, static_output

    def __call__(self, *inputs: Any) -> Any:
        if len(inputs) != len(self.static_inputs):
            raise BluTensorError(f"graphed step: got {len(inputs)} inputs, captured with {len(self.static_inputs)}")
        for i, (dst, src) in enumerate(zip(self.static_inputs, inputs)):
            if src is dst:
                continue
            if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
                raise BluTensorError(f"graphed step: input {i} has shape {tuple(src.shape)} dtype {src.dtype}; the "
                                     f"graph was captured for shape {tuple(dst.shape)} dtype {dst.dtype}")
            _copy_into(dst, src)
        self.graph.replay()
        return self.static_output


def _copy_into(dst, src) -> None:
    """Device copy of ``src`` into the static buffer ``dst`` (Tensors or CuPy arrays), no host sync."""
    d = getattr(dst, "_data", dst)
    s = getattr(src, "_data", src)
    cp = _cp()
    if type(s).__module__.startswith("numpy"):
        raise BluTensorError("graphed step: inputs must already be on the GPU (a host array would need a "
                             "synchronous copy); move the batch to the device first")
    cp.copyto(d, s)


def make_graphed_step(fn: Callable[..., Any], static_inputs: tuple, warmup: int = 3,
                      capture_error_mode: str = DEFAULT_MODE) -> GraphedCallable:
    """Warm ``fn(*static_inputs)`` up ``warmup`` times on a side stream, capture it, return a replayer.

    ``fn`` runs for real during the warm-up (a training step really steps), never during the capture."""
    run_warmup(lambda: fn(*static_inputs), warmup)
    g = CUDAGraph()
    with graph(g, capture_error_mode=capture_error_mode):
        out = fn(*static_inputs)
    return GraphedCallable(g, tuple(static_inputs), out)


__all__ = ["CUDAGraph", "GraphedCallable", "graph", "make_graphed_step", "run_warmup"]
