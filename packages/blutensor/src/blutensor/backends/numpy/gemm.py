"""Threaded host GEMM: ``a @ b`` split into row blocks, one per thread, each a single-threaded BLAS call.

The BLAS library itself runs single-threaded (``blutensor.threads`` limits it to 1): its own worker threads
busy-wait after every call and would take the cores from the compiled kernels that run between GEMMs (on two
cores a two-thread LayerNorm then ran slower than a one-thread one). 2-D float32 products run their blocks on the
OpenMP threads of the compiled kernels (``kernels.c`` ``blu_gemm_rows``: each block one ``cblas_sgemm`` call of
the BLAS NumPy is linked with, found through NumPy's own extension module), so the whole CPU step uses one
thread pool and no block waits for the interpreter lock; a bias can be added to the rows in the same pass (the
epilogue of ``linear``). Other products, and every product when the library or the BLAS symbol is not found,
run their blocks on a pool of ``get_num_threads() - 1`` Python threads plus the caller (NumPy releases the GIL
inside BLAS). Each block is computed by one BLAS call with NumPy's arguments whatever runs it, so results equal
``np.matmul``'s on the same blocks; the split depends only on the thread count.
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


#: (fn pointer, ilp64) of the cblas_sgemm NumPy calls, None when not found; filled at the first use
_sgemm: list = []
_SGEMM_NAMES = (("scipy_cblas_sgemm64_", 1), ("cblas_sgemm64_", 1), ("scipy_cblas_sgemm", 0), ("cblas_sgemm", 0))


def _numpy_sgemm():
    """The ``cblas_sgemm`` of the BLAS library NumPy's extension module is linked with (looked up through that
    module, so the symbol is the one NumPy's matmul calls), with whether it takes 64-bit ints; None if absent."""
    if not _sgemm:
        import ctypes

        found = None
        try:
            from numpy._core import _multiarray_umath as mod
        except ImportError:  # NumPy 1.x
            from numpy.core import _multiarray_umath as mod
        try:
            handle = ctypes.CDLL(mod.__file__)
            for name, ilp64 in _SGEMM_NAMES:
                fn = getattr(handle, name, None)
                if fn is not None:
                    found = (ctypes.cast(fn, ctypes.c_void_p).value, ilp64)
                    break
        except OSError:
            pass
        _sgemm[:] = [found]
    return _sgemm[0]


def _lib_for_gemm():
    """The kernel library with NumPy's sgemm registered, or None (then the Python pool runs the blocks)."""
    from blutensor.backends.numpy import _build

    lib = _build.lib()
    if lib is None:
        return None
    if not _build._state.get("sgemm"):
        fn = _numpy_sgemm()
        if fn is None:
            return None
        lib.blu_set_sgemm(fn[0], fn[1])
        _build._state["sgemm"] = True
    return lib


def _layout(x):
    """(transposed, leading dim) of a 2-D float32 array as NumPy's matmul passes it to BLAS, None when NumPy
    would not call BLAS on it (then the array takes the Python pool, which calls np.matmul)."""
    s0, s1 = x.strides
    r, c = x.shape
    if s1 == 4 and s0 % 4 == 0 and s0 // 4 >= c:
        return 0, s0 // 4
    if s0 == 4 and s1 % 4 == 0 and s1 // 4 >= r:
        return 1, s1 // 4
    return None


def _gemm_c(a, b, bias, bounds, threads: int):
    """The row-block product on the compiled kernels' threads, or None when it does not apply."""
    if (a.dtype != np.float32 or type(a) is not np.ndarray or type(b) is not np.ndarray or b.shape[1] < 2
            or not (a.flags.aligned and b.flags.aligned)):
        return None
    if a.ctypes.data == b.ctypes.data:  # x.T @ x: NumPy's matmul takes its syrk path, keep its results
        return None
    la, lb = _layout(a), _layout(b)
    if la is None or lb is None or (bias is not None and (bias.dtype != a.dtype or bias.shape != (b.shape[1],))):
        return None
    from blutensor.backends.numpy import _build

    if _build._state.get("forked"):  # a forked child's OpenMP runs one thread: the Python pool splits its GEMMs
        return None
    lib = _lib_for_gemm()
    if lib is None:
        return None

    M, K = a.shape
    N = b.shape[1]
    out = np.empty((M, N), a.dtype)
    bias = None if bias is None else np.ascontiguousarray(bias)
    step = bounds[0][1] - bounds[0][0]
    lib.blu_gemm_rows(la[0], lb[0], M, N, K, a.ctypes.data, la[1], b.ctypes.data, lb[1], out.ctypes.data, N,
                      None if bias is None else bias.ctypes.data, step, min(threads, len(bounds)))
    return out


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


def matmul(a, b, threads: int, bias=None):
    """``np.matmul(a, b)`` (``+ bias`` on every row when given: 2-D ``a``, ``b``, bias of shape
    ``(b.shape[1],)``): 2-D operands in row blocks, batched ones in batch blocks, on ``threads`` threads (small
    or other products: one call)."""
    if bias is not None:
        if threads > 1 and a.ndim == b.ndim == 2 and a.dtype == b.dtype == np.float32:
            out = _matmul2d(a, b, threads, bias)
            if out is not None:
                return out
        out = matmul(a, b, threads)
        out += bias
        return out
    if threads <= 1 or a.ndim < 2 or b.ndim < 2 or a.dtype not in _SPLIT or b.dtype != a.dtype:
        return np.matmul(a, b)
    if a.ndim >= 3 or b.ndim >= 3:
        if (a.ndim >= 3 and a.shape[0] >= 2 and a.shape[-1] == b.shape[-2] and a.size * b.shape[-1] >= MIN_MACS
                and (b.ndim == 2 or (b.ndim == a.ndim and b.shape[0] == a.shape[0]))):
            return _batched(a, b, threads)
        return np.matmul(a, b)
    out = _matmul2d(a, b, threads, None)
    return np.matmul(a, b) if out is None else out


def _bounds(M: int, threads: int) -> list:
    parts = min(threads, M // _ROW_ALIGN)
    step = -(-M // parts)
    step = -(-step // _ROW_ALIGN) * _ROW_ALIGN
    return [(r, min(r + step, M)) for r in range(0, M, step)]


def _matmul2d(a, b, threads: int, bias):
    """The split 2-D product (+ bias), or None when it is too small to split (the caller makes one call)."""
    M, K = a.shape
    N = b.shape[1]
    if M * K * N < MIN_MACS or M < 2 * _ROW_ALIGN or K != b.shape[0]:
        return None
    bounds = _bounds(M, threads)
    out = _gemm_c(a, b, bias, bounds, threads)
    if out is not None:
        return out
    out = np.empty((M, N), a.dtype)
    ex = _executor(threads)
    futs = [ex.submit(np.matmul, a[r0:r1], b, out=out[r0:r1]) for r0, r1 in bounds[1:]]
    r0, r1 = bounds[0]
    np.matmul(a[r0:r1], b, out=out[r0:r1])
    for f in futs:
        f.result()
    if bias is not None:
        out += bias
    return out
