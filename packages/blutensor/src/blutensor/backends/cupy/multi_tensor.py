"""Multi-tensor apply: one launch over many tensors through a table of equal-size chunks.

:func:`build_chunk_table` is pure NumPy (tested on CPU); :class:`TensorTable` holds the device copies
(pointers, flags, sizes, chunks) for one list of arrays and is cached by the arrays' addresses.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from blutensor.errors import ShapeError

#: elements per chunk: 16 Ki elements = 64 KiB of fp32 per tensor stream; GPT-2 124M -> ~7.6k chunks, tens of
#: waves of blocks on a large GPU, so the last partial wave costs little (65536 gives a few waves and a long tail)
CHUNK = 16384


def build_chunk_table(numels, chunk: int = CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """(chunk_tensor int32, chunk_start int64): chunk b covers tensor chunk_tensor[b] elements
    [chunk_start[b], min(chunk_start[b] + chunk, numel)). Empty tensors get no chunk."""
    if chunk <= 0:
        raise ValueError(f"chunk size must be positive, got {chunk}")
    numels = np.asarray(list(numels), dtype=np.int64)
    if (numels < 0).any():
        raise ValueError(f"negative tensor size in {numels.tolist()}")
    counts = -(-numels // chunk)
    tensor = np.repeat(np.arange(len(numels), dtype=np.int32), counts)
    first = np.concatenate(([0], np.cumsum(counts)[:-1])) if len(counts) else np.zeros(0, np.int64)
    local = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(first, counts)
    return tensor, local * chunk


class TensorTable:
    """Device-side description of lists of same-shaped arrays (e.g. params, grads, m, v)."""

    def __init__(self, lists, flags, chunk: int = CHUNK):
        import cupy as cp

        n = len(lists[0])
        for li, lst in enumerate(lists):
            if len(lst) != n:
                raise ShapeError(f"multi-tensor apply: list {li} has {len(lst)} arrays, list 0 has {n}")
            for i, a in enumerate(lst):
                if a.size != lists[0][i].size:
                    raise ShapeError(
                        f"multi-tensor apply: array {i} of list {li} has {a.size} elements, "
                        f"list 0's has {lists[0][i].size}"
                    )
                if not a.flags.c_contiguous:
                    raise ShapeError(f"multi-tensor apply: array {i} of list {li} (shape {a.shape}) is not contiguous")
        numels = [a.size for a in lists[0]]
        ct, cs = build_chunk_table(numels, chunk)
        self.n_chunks = len(ct)
        self.chunk = chunk
        self.ptrs = [cp.asarray(np.array([a.data.ptr for a in lst], dtype=np.uint64)) for lst in lists]
        self.flags = cp.asarray(np.asarray(flags, dtype=np.int32))
        self.numel = cp.asarray(np.asarray(numels, dtype=np.int64))
        self.chunk_tensor = cp.asarray(ct)
        self.chunk_start = cp.asarray(cs)

    def args(self) -> tuple:
        """The table's leading kernel arguments: one pointer array per list, flags, sizes, the chunk map and
        the chunk length (the multi-tensor kernels' shared signature head)."""
        return (*self.ptrs, self.flags, self.numel, self.chunk_tensor, self.chunk_start, np.int64(self.chunk))


_cache: OrderedDict = OrderedDict()
_CACHE_MAX = 16


def table_for(lists, flags, chunk: int = CHUNK) -> TensorTable:
    """The cached TensorTable of these arrays (built once per distinct list of addresses/sizes/dtypes)."""
    import cupy as cp

    key = (
        cp.cuda.runtime.getDevice(),
        chunk,
        tuple(flags),
        tuple(tuple((a.data.ptr, a.size, a.dtype.char) for a in lst) for lst in lists),
    )
    t = _cache.get(key)
    if t is None:
        t = _cache[key] = TensorTable(lists, flags, chunk)
        while len(_cache) > _CACHE_MAX:
            _cache.popitem(last=False)
    else:
        _cache.move_to_end(key)
    return t
