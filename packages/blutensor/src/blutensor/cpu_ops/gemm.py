"""Threaded host GEMM: ``a @ b`` split into row blocks, one per thread, each a single-threaded BLAS call.

The BLAS library itself runs single-threaded (``blutensor.threads`` limits it to 1): its own worker threads
busy-wait after every call and would take the cores from the compiled kernels that run between GEMMs (on two
cores a two-thread LayerNorm then ran slower than a one-thread one). Here the blocks run on a pool of
``get_num_threads() - 1`` Python threads plus the caller (NumPy releases the GIL inside BLAS), and idle
workers sleep. Each output row is computed by one BLAS call whatever the split, so results equal
``np.matmul``'s for the same shapes; the split depends only on the thread count.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

#: below this many multiply-adds a GEMM runs in one call (the hand-off costs ~10-20 us)
MIN_MACS = 1 << 19
_ROW_ALIGN = 16
_pool: list = []  # [(threads, pid, executor)]
_lock = threading.Lock()
_SPLIT = (np.dtype(np.float32), np.dtype(np.float64))


def _executor(n: int) -> ThreadPoolExecutor:
    """The worker pool for ``n`` threads, made again after a fork (a forked child has none of the threads)."""
    pid = os.getpid()
    if _pool and _pool[0][:2] == (n, pid):
        return _pool[0][2]
    with _lock:
        if _pool and _pool[0][1] == pid:
            _pool[0][2].shutdown(wait=False)
        ex = ThreadPoolExecutor(max_workers=n - 1, thread_name_prefix="blutensor-gemm")
        _pool[:] = [(n, pid, ex)]
    return ex


def _batched(a, b, threads: int):
    """Batched ``a @ b`` split along the leading batch dim (``b`` 2-D or with the same leading dim)."""
    Bn = a.shape[0]
    lead = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    out = np.empty((*lead, a.shape[-2], b.shape[-1]), a.dtype)
    step = -(-Bn // min(threads, Bn))
    ex = _executor(threads)
    futs = [ex.submit(np.matmul, a[i:i + step], b if b.ndim == 2 else b[i:i + step], out=out[i:i + step])
            for i in range(step, Bn, step)]
    np.matmul(a[:step], b if b.ndim == 2 else b[:step], out=out[:step])
    for f in futs:
        f.result()
    return out


def matmul(a, b, threads: int):
    """``np.matmul(a, b)``: 2-D operands in row blocks, batched ones in batch blocks, on ``threads`` threads
    (small or other products: one call)."""
    if threads <= 1 or a.ndim < 2 or b.ndim < 2 or a.dtype not in _SPLIT or b.dtype != a.dtype:
        return np.matmul(a, b)
    if a.ndim >= 3 or b.ndim >= 3:
        if (a.ndim >= 3 and a.shape[0] >= 2 and a.shape[-1] == b.shape[-2] and a.size * b.shape[-1] >= MIN_MACS
                and (b.ndim == 2 or (b.ndim == a.ndim and b.shape[0] == a.shape[0]))):
            return _batched(a, b, threads)
        return np.matmul(a, b)
    M, K = a.shape
    N = b.shape[1]
    if M * K * N < MIN_MACS or M < 2 * _ROW_ALIGN or K != b.shape[0]:
        return np.matmul(a, b)
    parts = min(threads, M // _ROW_ALIGN)
    step = -(-M // parts)
    step = -(-step // _ROW_ALIGN) * _ROW_ALIGN
    out = np.empty((M, N), a.dtype)
    bounds = [(r, min(r + step, M)) for r in range(0, M, step)]
    ex = _executor(threads)
    futs = [ex.submit(np.matmul, a[r0:r1], b, out=out[r0:r1]) for r0, r1 in bounds[1:]]
    r0, r1 = bounds[0]
    np.matmul(a[r0:r1], b, out=out[r0:r1])
    for f in futs:
        f.result()
    return out
