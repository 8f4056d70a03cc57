"""CPU threads: ``set_num_threads`` / ``get_num_threads`` (PyTorch's names) for GEMM and blutensor's kernels.

One setting serves both kinds of CPU work in a step: the GEMMs (split into row blocks on blutensor's threads,
the BLAS library itself limited to one thread through threadpoolctl, see ``backends/numpy/gemm.py``) and blutensor's
compiled CPU kernels (OpenMP). The default is ``OMP_NUM_THREADS`` when set (PyTorch's rule), else the cores this
process may run on (``os.sched_getaffinity``) divided by the ranks sharing this node (``LOCAL_WORLD_SIZE``, as
set by torchrun-style launchers and dtms blurun, or Open MPI's ``OMPI_COMM_WORLD_LOCAL_SIZE``), at least 1, so
ranks do not oversubscribe the cores. Launchers call :func:`set_num_threads` once per rank before the first
step; ``blutrain train`` and ``blutrain profile`` call it with ``train.threads``.
"""

from __future__ import annotations

import os

_threads: list[int] = []  # the explicit setting, once made


def local_ranks() -> int:
    """Ranks of this job on this node (1 outside a launcher)."""
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"):
        v = os.environ.get(name, "").strip()
        if v.isdigit() and int(v) > 0:
            return int(v)
    return 1


def default_num_threads() -> int:
    """``OMP_NUM_THREADS`` when set (as PyTorch does), else the cores this process may use divided by the
    local ranks (at least 1)."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores // local_ranks())


def get_num_threads() -> int:
    """Threads used for intra-op parallelism on the CPU (GEMM and blutensor's kernels)."""
    return _threads[0] if _threads else default_num_threads()


def set_num_threads(n: int) -> None:
    """Use ``n`` threads (>= 1) for CPU GEMMs and blutensor's CPU kernels from now on (PyTorch's
    ``torch.set_num_threads``). Same ``n``, same results: reductions run in a fixed order."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        from blutensor.errors import ArgumentError

        raise ArgumentError(f"set_num_threads: expected an int >= 1, got {type(n).__name__} {n!r:.40}")
    _threads[:] = [n]
    _apply(n)


def apply_default() -> None:
    """Limit the pools to :func:`get_num_threads` (the default unless set): run before the first CPU step."""
    _apply(get_num_threads())


def _apply(n: int) -> None:
    from blutensor.ops import linalg

    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # without threadpoolctl the BLAS keeps its own setting (OPENBLAS_NUM_THREADS etc.)
        linalg._threads[0] = 1
    else:
        # the BLAS runs single-threaded, GEMMs are split into row blocks on blutensor's threads (backends/numpy/gemm.py)
        threadpool_limits(limits=1, user_api="blas")
        linalg._threads[0] = n
    from blutensor.backends.numpy import _build

    lib = _build._state.get("lib")
    if lib is not None:
        lib.blu_set_num_threads(_build.omp_threads(n))
