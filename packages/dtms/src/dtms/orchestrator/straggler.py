"""Straggler detection: a rank whose step time stays above the gang's median by a set margin.

Under synchronous data parallelism every rank's wall step time is the slowest rank's (the fast ones wait
in the collectives), so the time compared is each rank's *busy* time per step: its wall step time minus
the time it spent blocked in collectives (``WorkerAgent`` measures both through dtms' collective
observers: host waits on CPU backends, the CUDA-event time of each collective on NCCL). A rank is a
straggler when its busy time exceeds ``(1 + margin) x`` the median over the gang for ``steps``
consecutive gang steps; it is reported once (as fault class ``STRAGGLER``) until it recovers.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class StragglerReport:
    """One rank found slow: its busy seconds per step, the gang's median, and for how many steps."""

    rank: int
    step: int
    busy_s: float
    median_s: float
    steps: int

    @property
    def ratio(self) -> float:
        return self.busy_s / self.median_s if self.median_s > 0 else float("inf")


@dataclass
class StragglerDetector:
    """Feed it each gang step's per-rank busy seconds; it answers the ranks that just became stragglers."""

    margin: float = 0.25
    steps: int = 5
    min_ranks: int = 2
    _over: dict[int, int] = field(default_factory=dict)
    _flagged: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not self.margin > 0:
            raise ValueError(f"StragglerDetector: margin must be > 0 (a fraction above the median), got {self.margin}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"StragglerDetector: steps must be an int >= 1, got {self.steps!r}")

    def observe(self, step: int, busy_s: dict[int, float]) -> list[StragglerReport]:
        """Ranks over the margin for ``steps`` consecutive observations, reported once each."""
        vals = {r: float(v) for r, v in busy_s.items() if v is not None and v >= 0}
        if len(vals) < self.min_ranks:
            return []
        med = statistics.median(vals.values())
        out = []
        for r, v in sorted(vals.items()):
            if med > 0 and v > (1.0 + self.margin) * med:
                self._over[r] = self._over.get(r, 0) + 1
                if self._over[r] >= self.steps and r not in self._flagged:
                    self._flagged.add(r)
                    out.append(StragglerReport(r, step, v, med, self._over[r]))
            else:
                self._over[r] = 0
                self._flagged.discard(r)  # recovered: a new slow stretch is reported again
        return out

    @property
    def flagged(self) -> set[int]:
        """Ranks currently reported as stragglers."""
        return set(self._flagged)
