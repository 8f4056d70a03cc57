"""Detect how this process was started (blurun, mpirun, Slurm srun, or alone) from its environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


class LaunchError(RuntimeError):
    """The launch environment is inconsistent (rank/world mismatch, missing variables)."""


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, and how it learned it."""

    launcher: str  # "blurun" | "env" (RANK/WORLD_SIZE set by hand or torchrun) | "mpirun" | "srun" | "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None = None
    master_port: int | None = None
    run_id: str | None = None
    under_mpi: bool = False  # an MPI runtime started this process (mpi4py can form the world)

    @property
    def has_store(self) -> bool:
        """True when a rendezvous store address is known (MASTER_ADDR and MASTER_PORT)."""
        return bool(self.master_addr) and bool(self.master_port)


def _int(env: Mapping[str, str], name: str, source: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise LaunchError(f"{name}={env[name]!r} is not an integer ({source} environment)") from None


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    for n in names:
        if n in env:
            return n
    return None


_MPI_RANK = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_MPI_SIZE = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
_MPI_LOCAL_RANK = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK")
_MPI_LOCAL_SIZE = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE")


def under_mpi(env: Mapping[str, str] | None = None) -> bool:
    """True when an MPI launcher (mpirun/mpiexec, Hydra, PMIx, ``srun --mpi=pmix|pmi2``) started this process.
    ``srun --mpi=pmix`` sets PMIX_RANK but no size variable: Slurm's SLURM_NTASKS gives the size."""
    env = os.environ if env is None else env
    return _first(env, _MPI_RANK) is not None and (_first(env, _MPI_SIZE) is not None or "SLURM_NTASKS" in env)


def _slurm_tasks_on_node(env: Mapping[str, str]) -> int | None:
    """Tasks of this job step on this node: SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE ("2(x3),1", one
    entry per node, indexed by SLURM_NODEID), else SLURM_NTASKS_PER_NODE; None when Slurm says nothing."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        spec = env.get(name)
        if not spec:
            continue
        counts: list[int] = []
        for part in spec.split(","):
            n, _, rep = part.partition("(x")
            try:
                counts += [int(n)] * (int(rep.rstrip(")")) if rep else 1)
            except ValueError:
                raise LaunchError(f"{name}={spec!r} is not a Slurm task count list (e.g. '2(x3),1')") from None
        node = _int(env, "SLURM_NODEID", "srun") if "SLURM_NODEID" in env else 0
        if not 0 <= node < len(counts):
            raise LaunchError(f"SLURM_NODEID={node} but {name}={spec!r} lists {len(counts)} node(s)")
        return counts[node]
    v = env.get("SLURM_NTASKS_PER_NODE", "")
    return int(v) if v.isdigit() else None


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``"gpu[07-09,12],cpu1"`` -> ``"gpu07"``."""
    text, depth = nodelist.strip(), 0
    for i, c in enumerate(text):
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            text = text[:i]
            break
    if "[" not in text:
        return text
    pre, _, rest = text.partition("[")
    inner, _, post = rest.partition("]")
    return pre + inner.split(",")[0].split("-")[0] + post


def _slurm_store(env: Mapping[str, str]) -> tuple[str | None, int | None]:
    """The store address from the allocation (no MASTER_ADDR given): the step's first node, port MASTER_PORT or
    15000 + (SLURM_JOB_ID + SLURM_STEP_ID) mod 20000 (the same on every rank of the step)."""
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodes:
        return None, None
    if env.get("MASTER_PORT"):
        return first_host(nodes), _int(env, "MASTER_PORT", "MASTER_PORT")
    job = _int(env, "SLURM_JOB_ID", "srun") if env.get("SLURM_JOB_ID") else 0
    step = _int(env, "SLURM_STEP_ID", "srun") if (env.get("SLURM_STEP_ID") or "").isdigit() else 0
    return first_host(nodes), 15000 + (job + step) % 20000


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read rank, world size and rendezvous address from the environment, checking they agree.

    Order: RANK/WORLD_SIZE (blurun sets these plus BLUTRAIN_RUN_ID; torchrun-style too), then MPI
    (OMPI_COMM_WORLD_*, PMI_*, PMIX_RANK; under ``srun --mpi=pmix|pmi2`` what MPI does not give comes from
    SLURM_NTASKS / SLURM_LOCALID / SLURM_[STEP_]TASKS_PER_NODE), then Slurm alone (SLURM_PROCID/SLURM_NTASKS/
    SLURM_LOCALID; the store address from the allocation's first node when MASTER_ADDR is unset), else one
    process.
    """
    env = os.environ if env is None else env
    mpi = under_mpi(env)
    addr = env.get("MASTER_ADDR") or None
    port = _int(env, "MASTER_PORT", "MASTER_PORT") if env.get("MASTER_PORT") else None
    run_id = env.get("BLUTRAIN_RUN_ID")

    if "RANK" in env or "WORLD_SIZE" in env:
        src = "blurun" if run_id else "env"
        missing = [n for n in ("RANK", "WORLD_SIZE") if n not in env]
        if missing:
            raise LaunchError(f"{' and '.join(missing)} missing from the environment while "
                              f"{'RANK' if 'RANK' in env else 'WORLD_SIZE'} is set ({src} launch)")
        rank, world = _int(env, "RANK", src), _int(env, "WORLD_SIZE", src)
        local = _int(env, "LOCAL_RANK", src) if "LOCAL_RANK" in env else rank
        lws = _int(env, "LOCAL_WORLD_SIZE", src) if "LOCAL_WORLD_SIZE" in env else world
        info = LaunchInfo(src, rank, world, local, lws, addr, port, run_id, mpi)
        if mpi:  # both sets present (blurun on CPU runs ranks under mpiexec): they must agree
            mr = _int(env, _first(env, _MPI_RANK), "MPI")
            ms = _int(env, _first(env, _MPI_SIZE), "MPI")
            if (mr, ms) != (rank, world):
                raise LaunchError(
                    f"world/rank mismatch: {src} environment says rank {rank} of {world} "
                    f"but the MPI launcher says rank {mr} of {ms}"
                )
    elif mpi:
        slurm = "SLURM_PROCID" in env or "SLURM_NTASKS" in env  # srun --mpi=pmix|pmi2
        src = "srun" if slurm else "mpirun"
        rn, sn = _first(env, _MPI_RANK), _first(env, _MPI_SIZE)
        rank = _int(env, rn, src)
        world = _int(env, sn, src) if sn else _int(env, "SLURM_NTASKS", "srun")
        lrn, lsn = _first(env, _MPI_LOCAL_RANK), _first(env, _MPI_LOCAL_SIZE)
        # what the MPI layer does not give, Slurm does (pmi2 sets neither a local rank nor a local size)
        if lrn:
            local = _int(env, lrn, src)
        else:
            local = _int(env, "SLURM_LOCALID", "srun") if slurm and "SLURM_LOCALID" in env else rank
        node_tasks = _slurm_tasks_on_node(env) if slurm else None
        lws = _int(env, lsn, src) if lsn else (node_tasks if node_tasks is not None else world)
        if slurm and not addr and env.get("BLUTRAIN_STORE_SECRET"):
            addr, port = _slurm_store(env)
        info = LaunchInfo(src, rank, world, local, lws, addr, port, run_id, True)
    elif "SLURM_PROCID" in env:
        if "SLURM_NTASKS" not in env:
            raise LaunchError("SLURM_PROCID is set but SLURM_NTASKS is missing (srun environment)")
        rank, world = _int(env, "SLURM_PROCID", "srun"), _int(env, "SLURM_NTASKS", "srun")
        local = _int(env, "SLURM_LOCALID", "srun") if "SLURM_LOCALID" in env else 0
        node_tasks = _slurm_tasks_on_node(env)
        lws = node_tasks if node_tasks is not None else max(local + 1, 1)
        if not addr:
            addr, port = _slurm_store(env)
        info = LaunchInfo("srun", rank, world, local, lws, addr, port, run_id, False)
    else:
        info = LaunchInfo("single", 0, 1, 0, 1, addr, port, run_id, False)

    if info.world_size < 1:
        raise LaunchError(f"world size {info.world_size} < 1 ({info.launcher} environment)")
    if not 0 <= info.rank < info.world_size:
        raise LaunchError(f"rank {info.rank} is not in [0, {info.world_size}) ({info.launcher} environment)")
    if not 0 <= info.local_rank < max(info.local_world_size, 1):
        raise LaunchError(
            f"local rank {info.local_rank} is not in [0, {info.local_world_size}) "
            f"({info.launcher} environment)"
        )
    return info
