"""dtms: process groups (NCCL, MPI, local), an authenticated store and the ``blurun`` launcher."""

from .__about__ import __version__
from .env import LaunchError, LaunchInfo, detect_launch
from .mpi import find_mpiexec
from .process_group import (
    CollectiveError,
    CollectiveRecord,
    ProcessGroup,
    ReduceOp,
    Work,
    add_collective_observer,
    remove_collective_observer,
)
from .store import StoreError, StoreTimeout, TCPStore
from .world import (
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    cuda_available,
    destroy_process_group,
    get_backend,
    get_default_group,
    get_local_rank,
    get_local_world_size,
    get_rank,
    get_store,
    get_world_size,
    init_process_group,
    irecv,
    is_initialized,
    isend,
    new_group,
    recv,
    reduce_scatter,
    send,
)

__all__ = [
    "__version__", "LaunchError", "LaunchInfo", "detect_launch", "find_mpiexec", "CollectiveError",
    "ProcessGroup", "ReduceOp", "Work", "StoreError", "StoreTimeout", "TCPStore", "all_gather",
    "all_reduce", "all_to_all", "barrier", "broadcast", "cuda_available", "destroy_process_group",
    "get_backend", "get_default_group", "get_local_rank", "get_local_world_size", "get_rank",
    "get_store", "get_world_size", "init_process_group", "irecv", "is_initialized", "isend",
    "new_group", "recv", "reduce_scatter", "send",
    "CollectiveRecord", "add_collective_observer", "remove_collective_observer",
]
