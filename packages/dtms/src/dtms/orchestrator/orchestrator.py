"""The Orchestrator: starts the gang through ``blurun``, watches heartbeats and progress in its own
store, classifies faults, collects stacks on a hang, tears the gang down and restarts it from the last
checkpoint every rank can verify, within a restart budget; a persisted state machine lets the
orchestrator itself be restarted. ``python -m dtms.orchestrate --help`` is its command line."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..store import SECRET_ENV, TCPStore
from ..supervisor import _pdeathsig, describe_exit, shell_code
from . import state as st
from .faults import (
    EXIT_BUDGET,
    EXIT_FATAL,
    EXIT_NAMES,
    EXIT_NO_PROGRESS,
    EXIT_OK,
    EXIT_PREEMPT_UNSAVED,
    EXIT_REQUEUE,
    FaultClass,
    Incident,
)
from .metrics import MetricsServer, orchestrator_metrics
from .stacks import alive, collect_stacks, stack_file
from .straggler import StragglerDetector
from .tracing import RunTracer, make_tracer
from .worker import ENV_ADDR, ENV_ATTEMPT, ENV_DIR, ENV_HB, ENV_PORT, ENV_RUN, key_prefix


@dataclass
class OrchestratorConfig:
    """What to run and how patiently (seconds)."""

    script: str
    args: list[str] = field(default_factory=list)
    run_dir: str = "blurun-orch"
    nproc_per_node: int = 1
    launcher: str = "auto"
    max_restarts: int = 3
    max_no_progress: int = 2
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 10.0
    progress_timeout: float = 120.0
    startup_timeout: float = 180.0
    grace_period: float = 10.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no endpoint; 0: any free port (written to run_dir/metrics.json)
    run_id: str | None = None
    stack_timeout: float = 3.0
    quiet: bool = False
    straggler_margin: float = 0.25  # a rank busy this fraction above the gang's median ...
    straggler_steps: int = 5  # ... for this many consecutive gang steps is a STRAGGLER (0: no detection)
    placement: str = "auto"  # blurun --placement: health/NUMA-aware GPU placement each attempt, or "off"
    otel_endpoint: str | None = None  # OTLP base URL for the run's trace (else $OTEL_EXPORTER_OTLP_ENDPOINT)
    otel_file: str | None = None  # OTLP/JSON-lines file for the run's trace


@dataclass
class _Attempt:
    """What the monitor learned about one attempt."""

    index: int
    hb: dict[int, dict] = field(default_factory=dict)
    hb_seen: dict[int, tuple[int, float]] = field(default_factory=dict)  # rank -> (beat n, monotonic)
    faults: dict[int, dict] = field(default_factory=dict)
    done: dict[int, dict] = field(default_factory=dict)
    ckpt: dict[int, int] = field(default_factory=dict)
    resume: dict[int, Any] = field(default_factory=dict)
    recorded: set[str] = field(default_factory=set)
    reached: int | None = None  # lowest step every rank completed in this attempt
    last_progress: float = 0.0
    stragglers: StragglerDetector | None = None

    @property
    def pids(self) -> dict[int, int]:
        return {r: int(h["pid"]) for r, h in self.hb.items() if "pid" in h}


class Orchestrator:
    """Runs ``config.script`` on a gang of ranks until it succeeds, is preempted, or the budget is spent."""

    def __init__(self, config: OrchestratorConfig):
        self.cfg = config
        self.run_dir = Path(config.run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = orchestrator_metrics()
        self._signal: int | None = None
        self.state: st.RunState | None = None
        self.tracer: RunTracer | None = None
        self._current: _Attempt | None = None

    # ---------------------------------------------------------------- logging
    def say(self, msg: str) -> None:
        if not self.cfg.quiet:
            print(f"[orchestrator] {msg}", file=sys.stderr, flush=True)

    def event(self, kind: str, **fields: Any) -> None:
        """Append one structured record to ``run_dir/events.jsonl`` (every incident and attempt)."""
        assert self.state is not None
        rec = {"time": time.time(), "run_id": self.state.run_id, "attempt": self.state.attempt, "event": kind,
               **fields}
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        if self.tracer is not None:
            self.tracer.on_event(json.loads(json.dumps(rec, default=str)), self.state)

    def incident(self, inc: Incident) -> None:
        assert self.state is not None
        d = inc.to_json()
        self.state.incidents.append({k: d[k] for k in ("fault", "rank", "attempt", "step", "message",
                                                         "detected_by", "time")})
        self.state.save(self.run_dir)
        self.metrics.inc("incidents_total", fault=inc.fault.value)
        self.event("incident", **d, checkpoint_step=self._checkpoint_step())
        where = f"rank {inc.rank}" if inc.rank is not None else "gang"
        self.say(f"incident {inc.fault.value} ({where}, attempt {inc.attempt}, step {inc.step}): {inc.message}")

    def _checkpoint_step(self) -> int | None:
        """The newest checkpoint step every rank committed so far (what a restart now would resume from)."""
        last = self.state.last_good_step if self.state is not None else None
        att = self._current
        if att is not None and att.ckpt and len(att.ckpt) == self.cfg.nproc_per_node:
            last = max(last or 0, min(att.ckpt.values()))
        return last

    # ---------------------------------------------------------------- main loop
    def _on_signal(self, signum: int, frame: object) -> None:
        self._signal = signum

    def run(self) -> int:
        """The state machine; returns the exit code (see faults.EXIT_*)."""
        cfg = self.cfg
        prev = st.RunState.load(self.run_dir)
        if prev is not None and prev.status in st.TERMINAL:
            self.state = prev
            self.say(f"run {prev.run_id} already ended ({prev.status}: {prev.reason}); nothing to do "
                     f"(remove {self.run_dir / st.STATE_FILE} to start over)")
            return prev.exit_code or EXIT_OK
        self.state = prev or st.RunState(cfg.run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}",
                                         started=time.time())
        self.tracer = make_tracer(self.state.run_id, cfg.otel_endpoint, cfg.otel_file)  # before any rank starts
        if prev is not None:
            self.say(f"continuing run {prev.run_id} after attempt {prev.attempt} ({prev.status})")
            self._reap(prev.live)
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._on_signal)
        secret = secrets.token_hex(32)
        store = TCPStore("127.0.0.1", 0, is_server=True, secret=secret, timeout=30.0)
        server = None
        if cfg.metrics_port is not None:
            server = MetricsServer(self.metrics, cfg.metrics_host, cfg.metrics_port)
            (self.run_dir / "metrics.json").write_text(json.dumps({"url": server.url, "pid": os.getpid()}) + "\n")
            self.say(f"metrics at {server.url}")
        self.metrics.inc("restarts_total", 0)
        self.metrics.set("restarts_total", self.state.restarts)
        try:
            return self._loop(store, secret)
        finally:
            store.close()
            if server is not None:
                server.close()
            if self.tracer is not None:
                self.tracer.shutdown()

    def _reap(self, live: dict[str, Any]) -> None:
        """Kill what a previous orchestrator's attempt left running (it was killed itself), so two gangs
        never write the same checkpoints; only processes still running our script are touched."""
        pids = [int(p) for p in live.get("ranks", {}).values()] + ([int(live["launcher"])] if live.get("launcher")
                                                                  else [])
        left = [p for p in pids if alive(p) and _runs(p, self.cfg.script)]
        for p in left:
            _kill(p, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while any(alive(p) for p in left) and time.monotonic() < deadline:
            time.sleep(0.05)
        if left:
            self.say(f"killed {len(left)} process(es) left by the previous orchestrator: {left}")
            self.event("reaped", pids=left)

    def _finish(self, status: str, code: int, reason: str) -> int:
        s = self.state
        assert s is not None
        s.status, s.exit_code, s.reason = status, code, reason
        s.save(self.run_dir)
        summary = {"run_id": s.run_id, "status": status, "exit_code": code, "exit_name": EXIT_NAMES.get(code),
                   "reason": reason, "attempts": s.attempt + 1, "restarts": s.restarts,
                   "last_good_step": s.last_good_step, "best_step": s.best_step,
                   "incidents": [f"{i['fault']} rank={i['rank']} attempt={i['attempt']} step={i['step']}"
                                 for i in s.incidents]}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.event("final", **summary)
        self.say(f"{status}: {reason} (exit {code} {EXIT_NAMES.get(code, '')}); attempts {s.attempt + 1}, "
                 f"restarts {s.restarts}, incidents {len(s.incidents)}; summary in {self.run_dir / 'summary.json'}")
        return code

    def _loop(self, store: TCPStore, secret: str) -> int:
        s, cfg = self.state, self.cfg
        assert s is not None
        while True:
            s.attempt += 1
            s.status = st.STARTING
            s.save(self.run_dir)
            self.metrics.set("attempt", s.attempt)
            outcome, inc, att = self._run_attempt(store, secret, s.attempt)
            if att.ckpt and len(att.ckpt) == cfg.nproc_per_node:
                s.last_good_step = max(s.last_good_step or 0, min(att.ckpt.values()))
            progress = att.reached is not None and att.reached > s.best_step
            if att.reached is not None:
                s.best_step = max(s.best_step, att.reached)
            s.attempts.append({"attempt": att.index, "outcome": outcome, "resume_step": _min(att.resume),
                               "reached_step": att.reached, "fault": inc.fault.value if inc else None})
            self.event("attempt_end", outcome=outcome, resume_step=_min(att.resume), reached_step=att.reached,
                       progress=progress)
            if outcome == "ok":
                return self._finish(st.SUCCEEDED, EXIT_OK, f"all ranks finished at step "
                                    f"{att.reached if att.reached is not None else s.last_good_step}")
            if outcome == "preempted":  # 75 only when every rank committed the step it left at
                code = EXIT_REQUEUE if _preempt_committed(att, cfg.nproc_per_node) else EXIT_PREEMPT_UNSAVED
                s.status, s.exit_code = st.PREEMPTED, code
                return self._finish(st.PREEMPTED, code, _preempt_reason(att, cfg.nproc_per_node, s.last_good_step))
            assert inc is not None
            if inc.details.get("fatal"):
                return self._finish(st.FAILED, EXIT_FATAL, f"fatal {inc.fault.value}: {inc.message}")
            s.no_progress_restarts = 0 if progress else s.no_progress_restarts + 1
            if s.no_progress_restarts > cfg.max_no_progress:
                return self._finish(st.GAVE_UP, EXIT_NO_PROGRESS,
                                    f"{s.no_progress_restarts} attempts in a row reached no new step (last: "
                                    f"{inc.fault.value}: {inc.message})")
            if s.restarts >= cfg.max_restarts:
                return self._finish(st.GAVE_UP, EXIT_BUDGET,
                                    f"restart budget of {cfg.max_restarts} spent (last: {inc.fault.value}: "
                                    f"{inc.message})")
            s.restarts += 1
            s.status = st.RECOVERING
            s.save(self.run_dir)
            self.metrics.set("restarts_total", s.restarts)
            self.event("restart", restarts=s.restarts, after=inc.fault.value, last_good_step=s.last_good_step)
            self.say(f"restarting the gang (restart {s.restarts}/{cfg.max_restarts}) from the last verified "
                     f"checkpoint (step {s.last_good_step})")

    # ---------------------------------------------------------------- one attempt
    def _spawn(self, secret: str, port: int, attempt: int) -> tuple[subprocess.Popen, Path]:
        cfg, s = self.cfg, self.state
        assert s is not None
        log_dir = self.run_dir / "logs" / f"attempt{attempt}"
        log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update({SECRET_ENV: secret, ENV_ADDR: "127.0.0.1", ENV_PORT: str(port), ENV_RUN: s.run_id,
                    ENV_ATTEMPT: str(attempt), ENV_DIR: str(self.run_dir), ENV_HB: str(cfg.heartbeat_interval),
                    "PYTHONUNBUFFERED": "1"})
        cmd = [sys.executable, "-u", "-m", "dtms.run", "--nproc-per-node", str(cfg.nproc_per_node),
               "--launcher", cfg.launcher, "--grace-period", str(cfg.grace_period), "--log-dir", str(log_dir),
               "--placement", cfg.placement,
               "--run-id", f"{s.run_id}-a{attempt}", cfg.script, *cfg.args]
        out = open(log_dir / "launcher.log", "wb")
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_pdeathsig(signal.SIGTERM))
        out.close()
        return proc, log_dir

    def _read(self, store: TCPStore, att: _Attempt) -> None:
        prefix = key_prefix(self.state.run_id, att.index)  # type: ignore[union-attr]
        now = time.monotonic()
        for k, v in store.local_items(prefix).items():
            parts = k[len(prefix):].split("/")
            kind, rank = parts[0], int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else -1
            if kind == "ncorrupt":
                continue
            val = json.loads(v)
            if kind == "hb":
                att.hb[rank] = val
                n = int(val.get("n", 0))
                if att.hb_seen.get(rank, (None,))[0] != n:
                    att.hb_seen[rank] = (n, now)
            elif kind == "fault":
                att.faults[rank] = val
            elif kind == "done":
                att.done[rank] = val
            elif kind == "ckpt":
                att.ckpt[rank] = int(val)
            elif kind == "resume":
                att.resume[rank] = val
            elif kind in ("corrupt", "nan") and k not in att.recorded:
                att.recorded.add(k)
                self.incident(Incident.from_json(val))
        steps = [max(h.get("step") or 0, att.done.get(r, {}).get("step") or 0) if h.get("step") is not None
                 or r in att.done else None for r, h in att.hb.items()]
        if len(att.hb) == self.cfg.nproc_per_node and all(x is not None for x in steps):
            m = min(steps)
            if att.reached is None or m > att.reached:
                if att.reached is None:
                    self.event("first_step", step=m)
                att.reached, att.last_progress = m, now
                self._check_stragglers(att, m)
            self.metrics.set("step", m)
        ranks = {str(r): p for r, p in att.pids.items()}
        if ranks != self.state.live.get("ranks"):  # type: ignore[union-attr]
            self.state.live["ranks"] = ranks  # type: ignore[union-attr]
            self.state.save(self.run_dir)  # type: ignore[union-attr]
        self.metrics.set("tokens_per_second", sum(h.get("tokens_per_s", 0.0) for h in att.hb.values()))
        for r, (_, t) in att.hb_seen.items():
            self.metrics.set("heartbeat_age_seconds", now - t, rank=r)
        for r, h in att.hb.items():
            for g in h.get("gpu", []):
                for k, name in (("temperature_c", "gpu_temperature_celsius"), ("utilization", "gpu_utilization_ratio"),
                                ("throttle_reasons", "gpu_throttle_reasons"),
                                ("memory_used_bytes", "gpu_memory_used_bytes")):
                    if k in g:
                        self.metrics.set(name, g[k], rank=r, gpu=g.get("index", 0))
                for k in ("ecc_corrected", "ecc_uncorrected"):
                    if k in g:
                        self.metrics.set("gpu_ecc_errors_total", g[k], rank=r, gpu=g.get("index", 0),
                                         type=k.split("_")[1])

    def _check_stragglers(self, att: _Attempt, step: int) -> None:
        """Compare the ranks' busy seconds per step (wall minus blocked in collectives) at each gang step."""
        cfg = self.cfg
        if cfg.straggler_steps <= 0:
            return
        if att.stragglers is None:
            att.stragglers = StragglerDetector(cfg.straggler_margin, cfg.straggler_steps)
        busy = {r: float(h["step_s"]) - float(h.get("comm_s", 0.0)) for r, h in att.hb.items() if "step_s" in h}
        for r, v in busy.items():
            self.metrics.set("step_busy_seconds", v, rank=r)
        for rep in att.stragglers.observe(step, busy):
            self.incident(Incident(
                FaultClass.STRAGGLER, f"rank {rep.rank} is {rep.ratio:.2f}x the gang's median busy time per step "
                f"({rep.busy_s * 1e3:.1f} ms vs {rep.median_s * 1e3:.1f} ms) for {rep.steps} steps (margin "
                f"{cfg.straggler_margin:g}); the run goes on", rep.rank, att.index, step,
                details={"busy_s": rep.busy_s, "median_s": rep.median_s, "steps": rep.steps,
                         "margin": cfg.straggler_margin}))
        self.metrics.set("stragglers", len(att.stragglers.flagged))

    def _hang(self, att: _Attempt, now: float, t0: float) -> Incident | None:
        """A hang incident (no heartbeat / no progress / stuck collective), or None."""
        cfg = self.cfg
        if len(att.hb) < cfg.nproc_per_node:
            if now - t0 > cfg.startup_timeout:
                missing = sorted(set(range(cfg.nproc_per_node)) - set(att.hb))
                return Incident(FaultClass.LAUNCH_FAILED, f"ranks {missing} sent no heartbeat within "
                                f"{cfg.startup_timeout:g}s of the launch", missing[0], att.index)
            return None
        for r, (_, t) in sorted(att.hb_seen.items()):
            if r not in att.done and now - t > cfg.heartbeat_timeout:
                return Incident(FaultClass.RANK_HUNG, f"no heartbeat from rank {r} for {now - t:.1f}s "
                                f"(timeout {cfg.heartbeat_timeout:g}s; process state "
                                f"{_pstate(att.hb[r].get('pid'))})", r, att.index, att.hb[r].get("step"),
                                details={"detected": "heartbeat"})
        started = att.reached is not None
        limit = cfg.progress_timeout if started else cfg.startup_timeout
        since = att.last_progress if started else t0
        if now - since > limit and len(att.done) < cfg.nproc_per_node:
            live = {r: h for r, h in att.hb.items() if r not in att.done}
            phases = {r: h.get("phase") for r, h in live.items()}
            lowest = min((h.get("step") or 0) for h in live.values())
            stuck = [r for r, h in sorted(live.items()) if (h.get("step") or 0) == lowest
                     and phases[r] != "collective"]
            what = f"no step progress for {now - since:.1f}s (timeout {limit:g}s); phases {phases}"
            if not stuck:
                return Incident(FaultClass.COLLECTIVE_TIMEOUT, what, None, att.index, lowest,
                                details={"detected": "progress", "phases": phases})
            return Incident(FaultClass.RANK_HUNG, what, stuck[0], att.index, lowest,
                            details={"detected": "progress", "phases": phases})
        return None

    def _run_attempt(self, store: TCPStore, secret: str, attempt: int) -> tuple[str, Incident | None, _Attempt]:
        cfg = self.cfg
        assert self.state is not None
        proc, log_dir = self._spawn(secret, store.port, attempt)
        att = self._current = _Attempt(attempt)
        t0 = time.monotonic()
        self.state.live = {"launcher": proc.pid, "ranks": {}}
        self.state.status = st.RUNNING
        self.state.save(self.run_dir)
        self.event("attempt_start", pid=proc.pid, log_dir=str(log_dir), nproc=cfg.nproc_per_node)
        self.say(f"attempt {attempt}: {cfg.nproc_per_node} rank(s) of {cfg.script} (logs {log_dir})")
        inc: Incident | None = None
        preempt_at: float | None = None
        signalled: set[int] = set()
        first_dead: int | None = None  # the rank seen dead first (the others die in the teardown)
        while True:
            time.sleep(0.05)
            self._read(store, att)
            now = time.monotonic()
            if self._signal is not None and preempt_at is None:
                preempt_at = now
                self.say(f"received {signal.Signals(self._signal).name}: asking every rank to checkpoint and "
                         f"leave within {cfg.grace_period:g}s")
            if preempt_at is not None:
                for pid in set(att.pids.values()) - signalled:  # ranks that show up later are told too
                    _kill(pid, signal.SIGTERM)
                    signalled.add(pid)
            if proc.poll() is not None:
                self._read(store, att)
                break
            if preempt_at is not None:
                if now - preempt_at > cfg.grace_period:
                    inc = Incident(FaultClass.PREEMPTED, f"ranks did not leave within the {cfg.grace_period:g}s "
                                   "grace period", None, attempt, att.reached)
                    break
                continue
            if att.faults:
                time.sleep(0.2)  # let the other ranks' reports land
                self._read(store, att)
                r, f = min(att.faults.items(), key=lambda kv: kv[1].get("time", 0))
                inc = Incident.from_json(f)
                break
            dead = [r for r, pid in sorted(att.pids.items()) if r not in att.done and not alive(pid)]
            if dead:  # a rank's process is gone without a report: let the launcher say how it ended
                first_dead = dead[0]
                try:
                    proc.wait(2.0)  # blurun ends the gang within ms of a failure; 0 when it simply finished
                except subprocess.TimeoutExpired:
                    pass
                self._read(store, att)
                if att.faults:
                    continue
                if proc.poll() is not None:
                    break  # classified below from the launcher's exit status
                r = dead[0]
                inc = Incident(FaultClass.RANK_DEAD, f"rank {r} (pid {att.pids[r]}) died without reporting",
                               r, attempt, att.hb[r].get("step"), details={"exit": "pending"})
                break
            inc = self._hang(att, now, t0)
            if inc is not None:
                stacks = collect_stacks(att.pids, self.run_dir, attempt, cfg.stack_timeout)
                inc.details["stacks"] = {str(r): str(stack_file(self.run_dir, attempt, r)) for r in stacks}
                inc.details["stacks_missing"] = sorted(set(att.pids) - set(stacks))
                self.event("stacks", ranks=sorted(stacks), files=inc.details["stacks"])
                self.say(f"collected stacks of ranks {sorted(stacks)} into {self.run_dir / 'stacks'}")
                break
        outcome = self._teardown(proc, att)
        if inc is not None and inc.details.get("exit") == "pending":  # the launcher has named the exit now
            inc.details["exit"] = _exit_hint(log_dir)
            inc.message += f" ({inc.details['exit']})"
            inc.fault = _dead_class(inc.details["exit"])
        self._release(store, attempt)
        statuses = [d.get("status") for d in att.done.values()]
        if inc is None and preempt_at is None and not att.faults and all(x == "ok" for x in statuses) and \
                (len(att.done) == cfg.nproc_per_node or proc.returncode == 0):
            return "ok", None, att
        if preempt_at is not None or (att.done and all(x == "preempted" for x in statuses)):
            committed = len(att.done) == cfg.nproc_per_node and all(x == "preempted" for x in statuses)
            self.incident(inc or Incident(FaultClass.PREEMPTED, "SIGTERM: every rank committed a checkpoint at "
                                          f"step {_min(att.ckpt)} and left" if committed else
                                          "SIGTERM: not every rank reported a committed checkpoint",
                                          None, attempt, att.reached, details={"fatal": False}))
            return "preempted", inc, att
        if inc is None:
            if att.faults:
                inc = Incident.from_json(min(att.faults.values(), key=lambda f: f.get("time", 0)))
            elif not att.hb and proc.returncode == 2:  # blurun refused to start (usage, no MPI, no script)
                inc = Incident(FaultClass.LAUNCH_FAILED, f"the launcher refused to start the gang "
                               f"({_last_line(log_dir)})", None, attempt, None, detected_by="launcher",
                               details={"fatal": True})
            else:
                dead = [r for r in sorted(att.pids) if r not in att.done and not alive(att.pids[r])]
                if first_dead is not None or dead:
                    r = first_dead if first_dead is not None else dead[0]
                    hint = _exit_hint(log_dir)
                    inc = Incident(_dead_class(hint), f"rank {r} (pid {att.pids[r]}) died without reporting "
                                   f"({hint})", r, attempt, att.hb[r].get("step"), details={"exit": hint})
                else:
                    inc = Incident(FaultClass.UNKNOWN, f"the gang ended with {outcome} ({_exit_hint(log_dir)})",
                                   None, attempt, att.reached, detected_by="launcher")
        inc.attempt = attempt
        self.incident(inc)
        return "fault", inc, att

    def _release(self, store: TCPStore, attempt: int) -> None:
        """Drop the attempt's keys from the store (the next attempt uses a new key prefix anyway)."""
        for k in store.local_items(key_prefix(self.state.run_id, attempt)):  # type: ignore[union-attr]
            store.delete(k)

    def _teardown(self, proc: subprocess.Popen, att: _Attempt) -> str:
        """Stop every rank and the launcher; free the attempt's store keys. Returns how the launcher ended."""
        grace = self.cfg.grace_period
        if proc.poll() is None:
            for r, pid in att.pids.items():
                if r not in att.done:
                    _kill(pid, signal.SIGKILL)
            try:
                proc.wait(grace + 10.0)
            except subprocess.TimeoutExpired:
                _killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(grace + 5.0)
                except subprocess.TimeoutExpired:
                    _killpg(proc.pid, signal.SIGKILL)
                    proc.wait(5.0)
        for pid in att.pids.values():  # nothing of this attempt may outlive it
            if alive(pid):
                _kill(pid, signal.SIGKILL)
        self.state.live = {}  # type: ignore[union-attr]
        self.event("attempt_teardown", launcher_exit=proc.returncode, launcher_pid=proc.pid,
                   rank_pids={str(r): p for r, p in att.pids.items()})
        return describe_exit(proc.returncode) if proc.returncode is not None else "unknown"


def _preempt_committed(att: _Attempt, nproc: int) -> bool:
    """True when every rank reported a checkpoint of the very step it left at, and left as 'preempted'."""
    saved = [att.ckpt.get(r) for r in range(nproc)]
    left = [att.done.get(r, {}).get("step") for r in range(nproc)]
    return all(x is not None for x in saved) and saved == left and \
        all(att.done.get(r, {}).get("status") == "preempted" for r in range(nproc))


def _preempt_reason(att: _Attempt, nproc: int, last_good: int | None) -> str:
    """What a preemption kept: the step every rank saved as it left, or that no rank could save one."""
    saved = [att.ckpt.get(r) for r in range(nproc)]
    if _preempt_committed(att, nproc):
        return f"preempted; every rank saved the checkpoint of step {min(saved)} as it left, requeue to continue"
    where = "no checkpoint was committed in this attempt" if last_good is None else \
        f"a requeue resumes from the last committed step {last_good}"
    return f"preempted, but not every rank saved a checkpoint as it left ({where})"


def _min(d: dict) -> Any:
    vals = [v for v in d.values() if v is not None]
    return min(vals) if vals else None


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _runs(pid: int, script: str) -> bool:
    """True when ``pid``'s command line mentions ``script`` (guards against a reused pid)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return Path(script).name in cmd


def _pstate(pid: Any) -> str:
    from .stacks import process_state

    s = process_state(int(pid)) if pid else None
    return {"T": "stopped", "Z": "zombie", None: "gone"}.get(s, s or "?")


def _dead_class(exit_hint: str) -> FaultClass:
    """A rank that left without a report: EXCEPTION when it exited with an error code (an uncaught
    exception in a loop without the agent's guard), RANK_DEAD when a signal killed it."""
    return FaultClass.EXCEPTION if "failed (exit code" in exit_hint else FaultClass.RANK_DEAD


def _last_line(log_dir: Path) -> str:
    try:
        lines = (log_dir / "launcher.log").read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no launcher log"
    return lines[-1] if lines else "no output"


def _exit_hint(log_dir: Path) -> str:
    """The launcher's last 'blurun:' line (it names the failed rank and its exit), if any."""
    try:
        lines = [ln for ln in (log_dir / "launcher.log").read_text(errors="replace").splitlines()
                 if ln.startswith("blurun:") and "failed" in ln]
    except OSError:
        return "no launcher log"
    return lines[-1].removeprefix("blurun: ") if lines else "see the launcher log"


__all__ = ["Orchestrator", "OrchestratorConfig", "shell_code"]
