"""``python -m dtms.orchestrate [options] script.py [args]``: run a script on a gang of ranks (through
``blurun``) with heartbeats, fault classification and gang restarts from the last verified checkpoint.
``blurun --run-dir DIR --max-restarts N ... script.py`` is the same: an orchestrator flag before the
script switches blurun to this mode.

Exit codes: 0 success, 70 fatal fault, 71 restart budget spent, 72 no progress, 75 preempted (requeue)."""

from __future__ import annotations

import argparse
import sys

ORCHESTRATOR_FLAGS = ("--run-dir", "--max-restarts", "--max-no-progress", "--heartbeat-interval",
                      "--heartbeat-timeout", "--progress-timeout", "--startup-timeout", "--metrics-port",
                      "--metrics-host", "--straggler-margin", "--straggler-steps", "--otel-endpoint",
                      "--otel-file")


def orchestrator_requested(argv: list[str]) -> bool:
    """True when ``blurun`` options (before the script) include an orchestrator flag: blurun then runs
    ``python -m dtms.orchestrate`` with the same arguments."""
    for tok in argv:
        if not tok.startswith("-") and tok.endswith(".py"):
            return False
        if tok.split("=", 1)[0] in ORCHESTRATOR_FLAGS:
            return True
    return False


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dtms.orchestrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True, help="state, events.jsonl, logs, stacks (reuse it to continue)")
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--launcher", choices=("auto", "direct", "mpi"), default="auto")
    p.add_argument("--max-restarts", type=int, default=3, help="gang restarts allowed after faults")
    p.add_argument("--max-no-progress", type=int, default=2,
                   help="restarts in a row without a new step before giving up (exit 72)")
    p.add_argument("--heartbeat-interval", type=float, default=0.5)
    p.add_argument("--heartbeat-timeout", type=float, default=10.0, help="seconds without a heartbeat = hung")
    p.add_argument("--progress-timeout", type=float, default=120.0, help="seconds without a step = hung")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds to the first step")
    p.add_argument("--grace-period", type=float, default=10.0, help="SIGTERM -> checkpoint -> exit window")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics (0: any port)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="metrics bind address (loopback by default)")
    p.add_argument("--run-id", default=None)
    p.add_argument("--straggler-margin", type=float, default=0.25,
                   help="a rank busy this fraction above the gang's median per step ...")
    p.add_argument("--straggler-steps", type=int, default=5,
                   help="... for this many consecutive steps is reported as a STRAGGLER incident (0: off)")
    p.add_argument("--placement", choices=("auto", "off"), default="auto",
                   help="blurun's GPU placement for every attempt (auto: NVML health check and NUMA pinning)")
    p.add_argument("--otel-endpoint", default=None, metavar="URL",
                   help="export incidents and recoveries as OpenTelemetry traces to this OTLP/HTTP base URL "
                        "(default: $OTEL_EXPORTER_OTLP_ENDPOINT when set; needs dtms[otel])")
    p.add_argument("--otel-file", default=None, metavar="PATH",
                   help="also (or only) write the trace as OTLP/JSON lines to PATH (needs dtms[otel])")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    from .orchestrator import Orchestrator, OrchestratorConfig
    from .orchestrator.tracing import TracingConfigError

    a = _parser().parse_args(argv)
    if not a.straggler_margin > 0 or a.straggler_steps < 0:
        print(f"orchestrate: error: need --straggler-margin > 0 and --straggler-steps >= 0 (got "
              f"{a.straggler_margin}, {a.straggler_steps})", file=sys.stderr)
        return 2
    if a.nproc_per_node < 1 or a.max_restarts < 0 or a.max_no_progress < 0:
        print("orchestrate: error: need --nproc-per-node >= 1, --max-restarts >= 0, --max-no-progress >= 0",
              file=sys.stderr)
        return 2
    cfg = OrchestratorConfig(
        script=a.script, args=list(a.args), run_dir=a.run_dir, nproc_per_node=a.nproc_per_node,
        launcher=a.launcher, max_restarts=a.max_restarts, max_no_progress=a.max_no_progress,
        heartbeat_interval=a.heartbeat_interval, heartbeat_timeout=a.heartbeat_timeout,
        progress_timeout=a.progress_timeout, startup_timeout=a.startup_timeout, grace_period=a.grace_period,
        metrics_host=a.metrics_host, metrics_port=a.metrics_port, run_id=a.run_id, quiet=a.quiet,
        straggler_margin=a.straggler_margin, straggler_steps=a.straggler_steps, placement=a.placement,
        otel_endpoint=a.otel_endpoint, otel_file=a.otel_file)
    try:
        return Orchestrator(cfg).run()
    except TracingConfigError as e:
        print(f"orchestrate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
