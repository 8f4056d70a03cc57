"""The default process group: ``init_process_group`` and the module-level collectives over it."""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import sys
from typing import Any

from .env import LaunchError, LaunchInfo, detect_launch
from .mpi import MPI_HINT, mpi4py_available
from .process_group import ProcessGroup, Work
from .store import SECRET_ENV, TCPStore

BACKENDS = ("nccl", "mpi", "local")
_state: dict[str, Any] = {"pg": None, "info": None, "store": None}


def gpu_count() -> int:
    """GPUs CuPy can see (0 without CuPy, a driver or a GPU; never raises)."""
    if importlib.util.find_spec("cupy") is None:
        return 0
    driver_nodes = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")
    if sys.platform.startswith("linux") and not any(os.path.exists(d) for d in driver_nodes):
        return 0  # no NVIDIA driver device: skip importing CuPy (slow) for nothing
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one GPU (never raises)."""
    return gpu_count() > 0


def default_backend(info: LaunchInfo) -> str:
    """nccl when every local rank can have its own GPU (or blurun pinned one); else mpi under an MPI
    launcher; local for one process; else a clear error. More local ranks than GPUs under mpirun means
    CPU processes (NCCL refuses two ranks on one GPU), so those get mpi."""
    n = gpu_count()
    if n and (os.environ.get("BLUTRAIN_GPU_PINNED") == "1" or info.local_world_size <= n):
        return "nccl"
    if info.under_mpi:
        return "mpi"
    if info.world_size == 1:
        return "local"
    raise LaunchError(
        f"world size {info.world_size} on CPU needs an MPI world, but this process was started by "
        f"{info.launcher} without MPI: launch with `blurun` (it uses mpiexec on CPU) or `mpirun`"
        + ("" if mpi4py_available() else f"; {MPI_HINT}")
        + (f" ({n} GPU(s) for {info.local_world_size} local ranks)" if n else "")
    )


class _SingleBootstrap:
    """Bootstrap for a NCCL group of one process: no exchange needed."""

    def share(self, uid: bytes | None) -> bytes | None:
        return uid

    def split(self, ranks: list[int], index: int, my_rank: int) -> _SingleBootstrap:
        return self


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def get_store(timeout: float | None = None) -> TCPStore | None:
    """The job's rendezvous store (client), from MASTER_ADDR/MASTER_PORT and BLUTRAIN_STORE_SECRET.

    Under blurun the launcher hosts it; under srun/mpirun rank 0 hosts it when the address is set.
    None when no address is known."""
    if _state["store"] is not None:
        return _state["store"]
    info = _state["info"] or detect_launch()
    if not info.has_store:
        return None
    if not os.environ.get(SECRET_ENV):
        raise LaunchError(f"MASTER_ADDR/MASTER_PORT are set but {SECRET_ENV} is not: every rank needs the "
                          "job's store secret (blurun generates one; with srun/mpirun export the same value)")
    t = 300.0 if timeout is None else timeout
    hosted = os.environ.get("BLUTRAIN_STORE_HOSTED") == "1"
    if not hosted and info.rank == 0:
        bind = info.master_addr if _is_loopback(info.master_addr) else "0.0.0.0"
        store = TCPStore(info.master_addr, info.master_port, is_server=True, timeout=t, bind_host=bind)
    else:
        store = TCPStore(info.master_addr, info.master_port, timeout=t)
    _state["store"] = store
    return store


def init_process_group(backend: str | None = None, *, store: TCPStore | None = None,
                       timeout: float = 300.0, device: int | None = None) -> ProcessGroup:
    """Create the default group for this job, detecting blurun / mpirun / srun from the environment.

    backend: 'nccl' | 'mpi' | 'local' | None (default: $BLUTRAIN_DIST_BACKEND, else nccl with a GPU,
    mpi under an MPI launcher, local for one process). Returns the group (also the default)."""
    if _state["pg"] is not None:
        raise RuntimeError("dtms.init_process_group() was already called; call destroy_process_group() first")
    info = detect_launch()
    source = "backend argument" if backend else "$BLUTRAIN_DIST_BACKEND"
    backend = (backend or os.environ.get("BLUTRAIN_DIST_BACKEND") or default_backend(info)).lower()
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} (from the {source}); choose one of {BACKENDS}")
    if store is not None:
        _state["store"] = store
    if backend == "local":
        if info.world_size != 1:
            raise LaunchError(f"backend 'local' runs one process, but the {info.launcher} environment "
                              f"says world size {info.world_size}")
        from .backends.local import LocalProcessGroup

        pg: ProcessGroup = LocalProcessGroup()
    elif backend == "mpi":
        from .backends.mpi import MPIProcessGroup

        pg = MPIProcessGroup()
        if (pg.rank(), pg.size()) != (info.rank, info.world_size) and info.launcher != "single":
            raise LaunchError(
                f"world/rank mismatch: the {info.launcher} environment says rank {info.rank} of "
                f"{info.world_size} but MPI says rank {pg.rank()} of {pg.size()} (was it started by mpiexec?)"
            )
    else:
        pg = _init_nccl(info, timeout, device)
    _state["pg"], _state["info"] = pg, info
    if pg.size() > 1:
        from .runscript import install_excepthook

        install_excepthook()  # a rank that raises exits at once instead of hanging in MPI_Finalize
    return pg


def _init_nccl(info: LaunchInfo, timeout: float, device: int | None) -> ProcessGroup:
    from .backends.nccl import MPIBootstrap, NCCLProcessGroup, StoreBootstrap, import_nccl

    cupy, _ = import_nccl()
    if device is None:
        n = cupy.cuda.runtime.getDeviceCount()
        if n == 0:
            raise RuntimeError("backend 'nccl' needs a GPU, but CuPy sees none")
        device = info.local_rank % n
    _state["info"] = info
    if info.world_size == 1:
        boot: Any = _SingleBootstrap()
    elif _state["store"] is not None or info.has_store:
        store = _state["store"] or get_store(timeout)
        boot = StoreBootstrap(store, f"dtms/{info.run_id or 'job'}/world", timeout)
    elif info.under_mpi and mpi4py_available():
        from .backends.mpi import import_mpi

        MPI = import_mpi()
        boot = MPIBootstrap(MPI.COMM_WORLD.Dup(), MPI)
    else:
        raise LaunchError(
            f"backend 'nccl' with world size {info.world_size} needs a rendezvous: set MASTER_ADDR, "
            f"MASTER_PORT and {SECRET_ENV} (blurun does), or launch under mpirun with mpi4py"
        )
    return NCCLProcessGroup(info.rank, info.world_size, boot, device=device)


def is_initialized() -> bool:
    """True once ``init_process_group`` has run (and not been destroyed)."""
    return _state["pg"] is not None


def get_default_group() -> ProcessGroup:
    """The group created by ``init_process_group``."""
    if _state["pg"] is None:
        raise RuntimeError("dtms.init_process_group() has not been called")
    return _state["pg"]


def _g(group: ProcessGroup | None) -> ProcessGroup:
    return group if group is not None else get_default_group()


def get_rank(group: ProcessGroup | None = None) -> int:
    """Rank of this process in ``group`` (default: the world)."""
    return _g(group).rank()


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of processes in ``group`` (default: the world)."""
    return _g(group).size()


def get_local_rank() -> int:
    """Rank of this process on its node (selects its GPU)."""
    return (_state["info"] or detect_launch()).local_rank


def get_local_world_size() -> int:
    """Number of processes on this node."""
    return (_state["info"] or detect_launch()).local_world_size


def get_backend(group: ProcessGroup | None = None) -> str:
    """'nccl', 'mpi' or 'local'."""
    return _g(group).backend


def new_group(ranks: list[int], group: ProcessGroup | None = None) -> ProcessGroup | None:
    """Sub-group of ``ranks`` (ranks of ``group``, default the world); all ranks must call it."""
    return _g(group).new_group(ranks)


def all_reduce(tensor: Any, op: str = "sum", group: ProcessGroup | None = None,
               async_op: bool = False) -> Work | None:
    """In-place all-reduce on the default (or given) group."""
    return _g(group).all_reduce(tensor, op, async_op)


def reduce_scatter(output: Any, input: Any, op: str = "sum", group: ProcessGroup | None = None,
                   async_op: bool = False) -> Work | None:
    """Reduce-scatter of a flat ``input`` into ``output`` (1/size of it)."""
    return _g(group).reduce_scatter(output, input, op, async_op)


def all_gather(output: Any, input: Any, group: ProcessGroup | None = None,
               async_op: bool = False) -> Work | None:
    """All-gather every rank's ``input`` into ``output`` in rank order."""
    return _g(group).all_gather(output, input, async_op)


def broadcast(tensor: Any, src: int = 0, group: ProcessGroup | None = None,
              async_op: bool = False) -> Work | None:
    """Broadcast ``tensor`` from rank ``src`` of the group."""
    return _g(group).broadcast(tensor, src, async_op)


def all_to_all(output: Any, input: Any, group: ProcessGroup | None = None,
               async_op: bool = False) -> Work | None:
    """Equal-split all-to-all."""
    return _g(group).all_to_all(output, input, async_op)


def send(tensor: Any, dst: int, tag: int = 0, group: ProcessGroup | None = None) -> None:
    """Blocking send to rank ``dst`` of the group."""
    _g(group).send(tensor, dst, tag)


def recv(tensor: Any, src: int, tag: int = 0, group: ProcessGroup | None = None) -> None:
    """Blocking receive from rank ``src`` of the group."""
    _g(group).recv(tensor, src, tag)


def isend(tensor: Any, dst: int, tag: int = 0, group: ProcessGroup | None = None) -> Work:
    """Nonblocking send; returns a Work."""
    return _g(group).isend(tensor, dst, tag)


def irecv(tensor: Any, src: int, tag: int = 0, group: ProcessGroup | None = None) -> Work:
    """Nonblocking receive; returns a Work."""
    return _g(group).irecv(tensor, src, tag)


def barrier(group: ProcessGroup | None = None, async_op: bool = False) -> Work | None:
    """Wait for every rank of the group."""
    return _g(group).barrier(async_op)


def destroy_process_group() -> None:
    """Tear down the default group and close the store connection (idempotent)."""
    pg, store = _state["pg"], _state["store"]
    _state.update(pg=None, info=None, store=None)
    if pg is not None:
        pg.destroy()
    if store is not None:
        store.close()
