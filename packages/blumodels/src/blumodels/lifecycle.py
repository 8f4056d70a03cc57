"""How a training run ends, told to whoever supervises it: preemption by SIGTERM, and the end report.

- :class:`Preemption` turns SIGTERM (a scheduler's or an orchestrator's "leave now") into a flag the Trainer checks
  at each step end; every rank agrees on it (one max-reduction), the run saves a checkpoint at that step and
  ends with ``summary["preempted"] = True`` (``blutrain train`` exits 75, EX_TEMPFAIL: requeue and ``--resume``)
  once every rank agrees that the step is committed; when it is not, :class:`PreemptionError` says why and which
  committed step is kept (exit 74).
- :func:`report_end` calls the ``blutrain_on_train_end`` hook with ``"ok"``, ``"preempted"`` or ``"failed"`` and
  the error, so an orchestrator (dtms) classifies the fault from the exception itself (NaN under
  ``nan_policy = "stop"`` is fatal, MemoryError is OOM, bad data or config is fatal) instead of guessing from
  an exit code.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 75  # EX_TEMPFAIL, as dtms' orchestrator's EXIT_REQUEUE: the stop step is committed
EXIT_PREEMPT_UNSAVED = 74  # EX_IOERR, as dtms' EXIT_PREEMPT_UNSAVED: SIGTERM, but the stop step was not committed


class PreemptionError(RuntimeError):
    """SIGTERM ended the run but its checkpoint could not be committed on every rank (the message says why and
    which committed step a ``--resume`` starts from); ``blutrain train`` exits 74 instead of 75."""

    def __init__(self, step: int, why: str, kept: int | None) -> None:
        self.step, self.kept = int(step), kept
        where = f"a --resume starts from the committed step {kept}" if kept is not None else \
            "no committed checkpoint exists, a --resume starts from scratch"
        super().__init__(f"preempted (SIGTERM) at step {step}, but its checkpoint could not be committed on every "
                         f"rank ({why}); {where}")


def report_end(status: str, step: int, error: BaseException | None = None) -> None:
    """Tell the plugins how the run ended; a plugin's own failure is logged, never raised over ``error``."""
    try:
        from blutensor.ext import get_host

        hook = getattr(get_host().hook, "blutrain_on_train_end", None)
        if hook is not None:
            hook(status=status, step=int(step), error=error)
    except Exception as e:  # the run's own outcome matters more than the report of it
        log.warning("blutrain_on_train_end hook failed: %s", e)


class Preemption:
    """SIGTERM -> ``requested`` while the block runs (main thread only; the previous handler comes back after)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self.requested = True

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def agreed(self, dist: Any, device: str) -> bool:
        """True on every rank when any rank received SIGTERM (a collective: call at the same point everywhere)."""
        flag = 1 if self.requested else 0
        if dist.world > 1:
            flag = -dist.min_int(-flag, device)
        return flag > 0
