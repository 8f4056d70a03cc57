"""The records a profiling session produces: op/region spans and memory events."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class OpEvent:
    """One timed span: an op's forward, an autograd node's backward, or a named region.

    CPU times are ``time.perf_counter_ns`` values; CUDA-event times are milliseconds
    since the session's base event, filled in when the session stops. ``host_only`` spans (view
    ops, which launch no kernel) carry no events: ``gpu_ms`` 0 and no ``gpu_start_ms``.
    """

    name: str
    phase: str  # "forward" | "backward" | "region"
    kernel: str
    index: int
    depth: int
    tid: int
    start_ns: int
    end_ns: int = 0
    shapes: tuple | None = None
    out_shape: tuple | None = None
    stream: int = 0
    gpu_start_ms: float | None = None
    gpu_ms: float | None = None
    #: a view op on a GPU-timed session: no kernel launched, so no CUDA events (CUDA-event time 0)
    host_only: bool = False
    _ev: tuple | None = field(default=None, repr=False)

    @property
    def key(self) -> str:
        """Table key: ``op.forward`` / ``op.backward`` / region name."""
        return self.name if self.phase == "region" else f"{self.name}.{self.phase}"

    @property
    def cpu_us(self) -> float:
        return (self.end_ns - self.start_ns) / 1e3

    def as_dict(self, t0: int = 0) -> dict:
        d = {"type": "op", "name": self.name, "phase": self.phase, "kernel": self.kernel, "index": self.index,
             "depth": self.depth, "tid": self.tid, "start_ns": self.start_ns - t0, "end_ns": self.end_ns - t0,
             "stream": self.stream}
        if self.shapes is not None:
            d["shapes"] = [list(s) if s is not None else None for s in self.shapes]
        if self.out_shape is not None:
            d["out_shape"] = list(self.out_shape)
        if self.gpu_ms is not None:
            d["gpu_start_ms"], d["gpu_ms"] = self.gpu_start_ms, self.gpu_ms
        if self.host_only:
            d["host_only"] = True
        return d


@dataclass(slots=True)
class MemEvent:
    """One allocation (``alloc``), free (``free``), or device reservation (``reserve``) of ``nbytes``."""

    ts_ns: int
    kind: str
    nbytes: int
    addr: int
    stream: int
    owner: str
    device: str

    def as_dict(self, t0: int = 0) -> dict:
        return {"type": "mem", "ts_ns": self.ts_ns - t0, "kind": self.kind, "nbytes": self.nbytes,
                "addr": self.addr, "stream": self.stream, "owner": self.owner, "device": self.device}
