"""Fault taxonomy: the class every incident report names, exception classification, exit codes."""

from __future__ import annotations

import enum
import math
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

# exit codes of the orchestrator (and EXIT_REQUEUE of a preempted worker)
EXIT_OK = 0
EXIT_FATAL = 70  # a fault that restarting cannot fix (NaN with policy 'stop', bad configuration)
EXIT_BUDGET = 71  # --max-restarts restarts used up
EXIT_NO_PROGRESS = 72  # --max-no-progress restarts in a row without a new step
EXIT_REQUEUE = 75  # preempted (SIGTERM): checkpoint committed, resubmit to continue (EX_TEMPFAIL)
EXIT_PREEMPT_UNSAVED = 74  # preempted, but not every rank committed the stop step: a resume starts earlier (EX_IOERR)

EXIT_NAMES = {EXIT_OK: "ok", EXIT_FATAL: "fatal", EXIT_BUDGET: "restart-budget-exhausted",
              EXIT_NO_PROGRESS: "no-progress", EXIT_REQUEUE: "requeue",
              EXIT_PREEMPT_UNSAVED: "preempted-unsaved"}


class FaultClass(enum.StrEnum):
    """What went wrong, as named in every incident report."""

    RANK_DEAD = "RANK_DEAD"  # a rank's process vanished (killed, segfault) without reporting
    RANK_HUNG = "RANK_HUNG"  # no heartbeat, or no step progress, within the timeout
    EXCEPTION = "EXCEPTION"  # a Python exception on a rank
    NAN_INF = "NAN_INF"  # a loss or gradient became NaN/Inf
    COLLECTIVE_TIMEOUT = "COLLECTIVE_TIMEOUT"  # ranks alive but stuck in a collective
    CHECKPOINT_CORRUPT = "CHECKPOINT_CORRUPT"  # a checkpoint failed verification or crashed its load
    OOM = "OOM"  # host MemoryError or a device allocation failure
    PREEMPTED = "PREEMPTED"  # SIGTERM: save and leave for a requeue
    LAUNCH_FAILED = "LAUNCH_FAILED"  # the gang never started (no heartbeat within the startup timeout)
    DATA = "DATA"  # a token shard, tokenizer or corpus is bad or changed under the run: fatal, a restart reads it again
    CONFIG = "CONFIG"  # the run's configuration or run directory is refused (ConfigError): fatal
    UNKNOWN = "UNKNOWN"  # the gang ended nonzero without anything more specific
    STRAGGLER = "STRAGGLER"  # a rank's busy time per step stays above the gang's median by the margin: reported


# classes that restarting from the last good checkpoint can cure
RESTARTABLE = {FaultClass.RANK_DEAD, FaultClass.RANK_HUNG, FaultClass.EXCEPTION, FaultClass.COLLECTIVE_TIMEOUT,
               FaultClass.CHECKPOINT_CORRUPT, FaultClass.OOM, FaultClass.LAUNCH_FAILED, FaultClass.UNKNOWN,
               FaultClass.NAN_INF}
# classes that restarting cannot cure: the incident is fatal unless the exception says otherwise (``fatal``)
FATAL = {FaultClass.DATA, FaultClass.CONFIG}
DATA_ERRORS = ("ShardError", "LoaderError", "TokenizerError", "CorpusError")


class NonFiniteError(FloatingPointError):
    """A loss or gradient is NaN/Inf (raised by the worker helper under nan policy 'stop'/'restart')."""


class CheckpointLoadError(RuntimeError):
    """Restoring a checkpoint that verified still failed (wrong shapes, bad state): CHECKPOINT_CORRUPT."""


@dataclass
class Incident:
    """One detected fault: its class, where (rank, attempt, step) and how it was detected."""

    fault: FaultClass
    message: str
    rank: int | None = None
    attempt: int | None = None
    step: int | None = None
    detected_by: str = "orchestrator"  # "worker" | "orchestrator" | "launcher"
    time: float = field(default_factory=time.time)
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["fault"] = self.fault.value
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Incident:
        d = dict(d)
        d["fault"] = FaultClass(d["fault"])
        return cls(**d)


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    name = type(exc).__name__
    if "OutOfMemory" in name:  # cupy.cuda.memory.OutOfMemoryError, torch.OutOfMemoryError
        return True
    text = str(exc).lower()
    return "out of memory" in text or "cudaerrormemoryallocation" in text


def classify_exception(exc: BaseException) -> FaultClass:
    """The fault class of an exception raised on a rank (MemoryError / CuPy OOM -> OOM, ...)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:  # the cause chain: an OOM wrapped in a RuntimeError is an OOM
        seen.add(id(e))
        if _is_oom(e):
            return FaultClass.OOM
        name = type(e).__name__
        if isinstance(e, FloatingPointError) or name == "NonFiniteError":
            return FaultClass.NAN_INF
        if isinstance(e, CheckpointLoadError) or name in ("CheckpointError", "StateError"):
            return FaultClass.CHECKPOINT_CORRUPT
        if name in DATA_ERRORS:
            return FaultClass.DATA
        if name in ("ConfigError", "RunLockError"):
            return FaultClass.CONFIG
        if isinstance(e, TimeoutError) or ("timed out" in str(e).lower() and "collective" in str(e).lower()):
            return FaultClass.COLLECTIVE_TIMEOUT
        e = e.__cause__ or e.__context__
    return FaultClass.EXCEPTION


def exception_incident(exc: BaseException, rank: int | None, attempt: int | None, step: int | None) -> Incident:
    """An Incident describing ``exc`` (class, message, last traceback lines)."""
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    fault = classify_exception(exc)
    fatal = getattr(exc, "fatal", None)
    details: dict[str, Any] = {"traceback": "".join(tb)[-4000:], "type": type(exc).__name__}
    if fatal is not None or fault in FATAL:
        details["fatal"] = bool(fatal) if fatal is not None else True
    return Incident(fault, f"{type(exc).__name__}: {exc}", rank, attempt, step, "worker", details=details)


def is_finite(x: float) -> bool:
    """math.isfinite that accepts NumPy scalars and 0-d arrays."""
    return math.isfinite(float(x))
