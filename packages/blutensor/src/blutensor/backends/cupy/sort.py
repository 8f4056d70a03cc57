"""Stable argsort of small non-negative integer keys without a host sync (capture-safe).

CuPy's sorts go through Thrust, which synchronises the stream at the end on CuPy builds without cupy#9497
(a host sync in every embedding backward, and a failed CUDA-graph capture). This LSD radix sort uses only
array-module primitives (compare, cumsum, gather, scatter): 8-bit digits, one pass per digit of the largest
key, each pass a stable counting sort (rank of an element = count of equal digits before it, from a cumsum
over a one-hot (n, 256) table). Works on NumPy too (the CPU reference used by the tests).

It is slow on a GPU (a one-hot table per pass: tens of times Thrust's time for 16K keys),
so ``thrust_capturable`` probes once whether this CuPy's Thrust sort can be captured and replayed; where it
can, graphs use Thrust too and this sort is the fallback.
"""

from __future__ import annotations

import numpy as np

RADIX_BITS = 8

#: per device: None = not probed yet, else whether cupy.argsort was captured and replayed correctly
_thrust_ok: dict[int, bool] = {}


def thrust_capturable(cp, probe: bool = True) -> bool:
    """Whether ``cupy.argsort`` works inside a CUDA graph here (cached per device).

    The probe captures a sort of a reversed range into a throwaway graph, replays it and compares. It must run
    outside any capture: with ``probe=False`` (inside a capture) an unprobed device answers False."""
    dev = cp.cuda.runtime.getDevice()
    hit = _thrust_ok.get(dev)
    if hit is not None or not probe:
        return bool(hit)
    from blutensor.cuda_graph import CUDAGraph, graph

    ok = False
    try:
        keys = cp.arange(4096, dtype=np.int64)[::-1].copy()
        g = CUDAGraph()
        with graph(g):
            order = cp.argsort(keys)
        g.replay()
        cp.cuda.get_current_stream().synchronize()
        ok = bool((order == cp.arange(4095, -1, -1, dtype=order.dtype)).all())
        g.reset()
    except Exception:  # noqa: BLE001 - any failure (a sync inside the capture, an allocator refusal) -> radix
        ok = False
    _thrust_ok[dev] = ok
    return ok


def stable_argsort(keys, num_keys: int, xp=None):
    """Indices that sort int ``keys`` (1-D, values in [0, num_keys)) stably: equal keys keep their order.

    Values outside [0, num_keys) are sorted by their low bits (no error: index checks happen elsewhere)."""
    if xp is None:
        xp = np if isinstance(keys, np.ndarray) else __import__("cupy")
    n = int(keys.size)
    order = xp.arange(n, dtype=np.int64)
    if n <= 1:
        return order
    keys = keys.astype(np.int64, copy=False)
    passes = max(1, -(-max(int(num_keys) - 1, 1).bit_length() // RADIX_BITS))
    buckets = xp.arange(1 << RADIX_BITS, dtype=np.int64)
    rows = xp.arange(n, dtype=np.int64)
    cur = keys
    for p in range(passes):
        digit = (cur >> (p * RADIX_BITS)) & ((1 << RADIX_BITS) - 1)
        onehot = (digit[:, None] == buckets[None, :]).astype(np.int32)
        csum = xp.cumsum(onehot, axis=0, dtype=np.int32)  # csum[i, d]: elements <= i with digit d
        counts = csum[-1].astype(np.int64)
        starts = xp.cumsum(counts) - counts
        pos = starts[digit] + csum[rows, digit].astype(np.int64) - 1
        new_order = xp.empty_like(order)
        new_cur = xp.empty_like(cur)
        new_order[pos] = order
        new_cur[pos] = cur
        order, cur = new_order, new_cur
    return order
