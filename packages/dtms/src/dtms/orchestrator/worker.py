"""Worker side of orchestration: heartbeats and step progress through the store, a SIGTERM flag for
preemption, stack dumps on SIGUSR1, fault reports (classified) written before a rank exits, and the gang's
agreement on the checkpoint step to resume from.

Under ``python -m dtms.orchestrate`` every rank finds the orchestrator's store in its environment::

    agent = WorkerAgent.from_env()          # None when not orchestrated
    with agent.guard():                     # an exception is classified and reported, then re-raised
        step = agent.agree_resume_step(good_steps) or 0
        for ...:
            ...; agent.step_done(step, loss=..., tokens_per_s=...)
            if agent.should_stop():         # SIGTERM on any rank: every rank saves at this step
                save(); agent.finish("preempted", step); sys.exit(EXIT_REQUEUE)
        agent.finish("ok", step)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from ..store import TCPStore
from .faults import EXIT_REQUEUE, FaultClass, Incident, NonFiniteError, exception_incident, is_finite
from .stacks import register_dump, stack_file

ENV_ADDR, ENV_PORT = "BLUTRAIN_ORCH_ADDR", "BLUTRAIN_ORCH_PORT"
ENV_RUN, ENV_ATTEMPT = "BLUTRAIN_ORCH_RUN_ID", "BLUTRAIN_ORCH_ATTEMPT"
ENV_DIR, ENV_HB = "BLUTRAIN_ORCH_DIR", "BLUTRAIN_ORCH_HEARTBEAT"
NAN_POLICIES = ("stop", "skip", "restart")


_current: dict[str, Any] = {"agent": None}


def current_agent() -> WorkerAgent | None:
    """This process's agent, created from the environment on first use (without taking over SIGTERM);
    None when the process was not started by the orchestrator. Used by the trainer hooks in dtms.hooks."""
    if _current["agent"] is None and not os.environ.get(ENV_PORT):
        return None
    return WorkerAgent.from_env(install_sigterm=False)


def key_prefix(run_id: str, attempt: int) -> str:
    """Store key prefix of one attempt: keys of earlier attempts can never be mistaken for live ones."""
    return f"orch/{run_id}/a{attempt}/"


class WorkerAgent:
    """One rank's link to the orchestrator (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, addr: str, port: int, run_id: str, attempt: int,
                 run_dir: str, interval: float = 0.5, telemetry_every: int = 10):
        self.rank, self.world_size = int(rank), int(world_size)
        self.run_id, self.attempt, self.run_dir = run_id, int(attempt), run_dir
        self.interval = float(interval)
        self.prefix = key_prefix(run_id, attempt)
        self._addr, self._port = addr, int(port)
        self._store = TCPStore(addr, self._port, timeout=30.0)
        self._hb_store: TCPStore | None = None
        self._lock = threading.Lock()
        self.step: int | None = None  # steps completed in this attempt (None until the first one)
        self._phase = "startup"
        self._extra: dict[str, Any] = {}
        self.preempt_requested = False
        self._stop = threading.Event()
        self._wake = threading.Event()  # step_done wakes the heartbeat thread (at most ~10 beats/interval)
        self._thread: threading.Thread | None = None
        self._stack_fh = None
        self._telemetry_every = telemetry_every
        self._finished = False
        # straggler detection: wall time per step and time blocked in collectives (dtms' observer API)
        self._comm_done: list = []
        self._last_step_t: float | None = None
        self._observing = False

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, install_sigterm: bool = True) -> WorkerAgent | None:
        """This rank's agent when started by the orchestrator, else None; started already. One per
        process: a second call returns the first agent."""
        if _current["agent"] is not None:
            return _current["agent"]
        env = os.environ if env is None else env
        if not env.get(ENV_PORT):
            return None
        agent = cls(int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")), env.get(ENV_ADDR, "127.0.0.1"),
                    int(env[ENV_PORT]), env[ENV_RUN], int(env.get(ENV_ATTEMPT, "0")), env[ENV_DIR],
                    float(env.get(ENV_HB, "0.5")))
        agent.start(install_sigterm)
        _current["agent"] = agent
        return agent

    # ---------------------------------------------------------------- store keys
    def key(self, *parts: object) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def _set(self, k: str, value: Any) -> None:
        self._store.set(k, json.dumps(value))

    # ---------------------------------------------------------------- lifecycle
    def start(self, install_sigterm: bool = True) -> None:
        """Stack dumps on SIGUSR1, the SIGTERM preemption flag (unless ``install_sigterm`` is False: a loop
        that never checks ``should_stop`` keeps SIGTERM's default), a first heartbeat, the heartbeat thread."""
        self._stack_fh = register_dump(stack_file(self.run_dir, self.attempt, self.rank))
        if install_sigterm and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
        self._hb_store = TCPStore(self._addr, self._port, timeout=30.0)
        from ..process_group import add_collective_observer

        add_collective_observer(self._on_collective)
        self._observing = True
        self._beat()
        self._thread = threading.Thread(target=self._loop, name="dtms-heartbeat", daemon=True)
        self._thread.start()

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self.preempt_requested = True

    def _payload(self, n: int) -> dict[str, Any]:
        with self._lock:
            p = {"pid": os.getpid(), "t": time.time(), "step": self.step, "phase": self._phase, "n": n,
                 **self._extra}
        if self._telemetry_every and n % self._telemetry_every == 0:
            from .telemetry import gpu_telemetry, rank_gpu

            gpu = gpu_telemetry(rank_gpu())
            if gpu:
                p["gpu"] = gpu
        return p

    def _beat(self, n: int = 0) -> None:
        assert self._hb_store is not None
        self._hb_store.set(self.key("hb", self.rank), json.dumps(self._payload(n)))

    def _loop(self) -> None:
        n = 1
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._beat(n)
            except Exception:  # orchestrator busy or gone: keep trying, it may come back
                pass
            n += 1
            self._stop.wait(self.interval / 10)  # rate limit: fast steps do not flood the store

    def _on_collective(self, phase: str, rec: Any) -> None:
        if phase == "end":
            self._comm_done.append(rec)

    def _blocked_s(self) -> float:
        """Seconds blocked in the collectives completed since the last call: the CUDA-event time on the
        communication stream (NCCL), else the host time in the call and its wait (compute between
        issuing an async op and waiting on it is not counted)."""
        recs, self._comm_done = self._comm_done, []
        total = 0.0
        for r in recs:
            ev = getattr(r, "device_events", None)
            if ev is not None:
                cp = sys.modules.get("cupy")
                try:
                    if cp is not None and ev[1].done:
                        total += float(cp.cuda.get_elapsed_time(ev[0], ev[1])) / 1e3
                        continue
                except Exception:
                    pass
            total += r.blocked_ns() / 1e9
        return total

    def stop_heartbeat(self) -> None:
        if self._observing:
            from ..process_group import remove_collective_observer

            remove_collective_observer(self._on_collective)
            self._observing = False
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(2 * self.interval + 1.0)

    # ---------------------------------------------------------------- progress
    def step_done(self, step: int, **metrics: float) -> None:
        """Record that ``step`` steps are complete (plus loss, tokens_per_s, ...) for the next heartbeat.

        Also reports ``step_s`` (wall seconds per step since the previous call) and ``comm_s`` (of which
        blocked in collectives), what the orchestrator's straggler detector compares across ranks; the
        first step (start-up, compilation) is not measured."""
        now = time.monotonic()
        blocked = self._blocked_s()
        prev, self._last_step_t = self._last_step_t, now
        if prev is not None and self.step is not None and int(step) > self.step:
            n = int(step) - self.step
            metrics = {**metrics, "step_s": (now - prev) / n, "comm_s": blocked / n}
        with self._lock:
            self.step = int(step)
            self._phase = "train"
            self._extra.update({k: float(v) for k, v in metrics.items()})
        self._wake.set()  # progress reaches the orchestrator now, not one interval later

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Heartbeats inside the block carry ``phase=name`` (e.g. 'collective', 'checkpoint')."""
        with self._lock:
            prev, self._phase = self._phase, name
        try:
            yield
        finally:
            with self._lock:
                self._phase = prev

    def checkpoint_committed(self, step: int) -> None:
        """The checkpoint of ``step`` is durable on this rank."""
        self._set(self.key("ckpt", self.rank), int(step))

    def report_corrupt(self, path: str, reason: str, step: int | None = None) -> None:
        """A checkpoint failed verification here (recorded as a CHECKPOINT_CORRUPT incident)."""
        inc = Incident(FaultClass.CHECKPOINT_CORRUPT, f"{path}: {reason}", self.rank, self.attempt, step,
                       "worker", details={"path": str(path), "fatal": False})
        n = self._store.add(self.key("ncorrupt", self.rank), 1)
        self._set(self.key("corrupt", self.rank, n), inc.to_json())

    def agree_resume_step(self, good_steps: list[int], timeout: float = 120.0) -> int | None:
        """The newest step whose checkpoint verifies on every rank (None: start from scratch)."""
        self._set(self.key("good", self.rank), sorted(int(s) for s in good_steps))
        keys = [self.key("good", r) for r in range(self.world_size)]
        with self.phase("rendezvous"):
            self._store.wait(keys, timeout)
        common: set[int] | None = None
        for k in keys:
            s = set(json.loads(self._store.get(k)))
            common = s if common is None else common & s
        step = max(common) if common else None
        self._set(self.key("resume", self.rank), step)
        return step

    # ---------------------------------------------------------------- faults
    def fault(self, incident: Incident) -> None:
        """Report a fault of this rank (the orchestrator reads it before classifying the gang's end)."""
        try:
            self._set(self.key("fault", self.rank), incident.to_json())
        except Exception:
            pass

    @contextlib.contextmanager
    def guard(self) -> Iterator[WorkerAgent]:
        """Classify and report any exception leaving the block (then re-raise it)."""
        try:
            yield self
        except SystemExit:
            raise
        except BaseException as e:
            inc = exception_incident(e, self.rank, self.attempt, self.step)
            fatal = getattr(e, "fatal", None)
            if fatal is not None:
                inc.details["fatal"] = bool(fatal)
            self.fault(inc)
            self.stop_heartbeat()
            raise

    def check_finite(self, value: float, step: int, policy: str = "stop", what: str = "loss") -> bool:
        """True when ``value`` is finite. Otherwise, by ``policy``: 'skip' reports a NAN_INF incident and
        returns False (drop the update); 'stop' raises a fatal NonFiniteError (the run stops with
        EXIT_FATAL); 'restart' raises a restartable one (the gang restarts from the last good checkpoint)."""
        if policy not in NAN_POLICIES:
            raise ValueError(f"nan policy must be one of {NAN_POLICIES}, got {policy!r}")
        if is_finite(value):
            return True
        msg = f"step {step}: non-finite {what} ({value}) on rank {self.rank}"
        if policy == "skip":
            inc = Incident(FaultClass.NAN_INF, msg + "; update skipped (policy 'skip')", self.rank, self.attempt,
                           step, "worker", details={"policy": "skip", "fatal": False})
            self._set(self.key("nan", self.rank, step), inc.to_json())
            return False
        err = NonFiniteError(f"{msg} (nan policy {policy!r})")
        err.fatal = policy == "stop"  # type: ignore[attr-defined]
        raise err

    def should_stop(self, group: Any = None) -> bool:
        """True on every rank when any rank received SIGTERM (one MAX all-reduce; call at step ends)."""
        if self.world_size == 1:
            return self.preempt_requested
        import numpy as np

        from .. import world

        flag = np.array([1.0 if self.preempt_requested else 0.0])
        with self.phase("collective"):
            world.all_reduce(flag, "max", group=group)
        return bool(flag[0] > 0)

    def finish(self, status: str = "ok", step: int | None = None) -> None:
        """Report this rank's clean end ('ok' or 'preempted') and stop heartbeating."""
        if self._finished:
            return
        self._finished = True
        self._set(self.key("done", self.rank), {"status": status, "step": self.step if step is None else step,
                                                "pid": os.getpid()})
        self.stop_heartbeat()

    def close(self) -> None:
        self.stop_heartbeat()
        for s in (self._store, self._hb_store):
            if s is not None:
                s.close()


__all__ = ["WorkerAgent", "EXIT_REQUEUE", "key_prefix", "NAN_POLICIES"]
