"""Wrap-time check that every rank holds the same parameters (names, shapes, dtypes), as PyTorch's DDP does.

Run once before the first broadcast: a model that differs between ranks would otherwise make the
per-parameter broadcasts or the bucketed all-reduces hang or silently mix unrelated numbers. Costs two
small all-gathers (the second only when something differs); every rank raises the same kind of error.
"""

from __future__ import annotations

import importlib
import zlib
from typing import Any

import numpy as np

from dtms.process_group import _DTYPE_NAMES, CollectiveError, ProcessGroup, _dtype_code

SLOTS = 256  # parameters compared one by one; beyond, only a checksum over all of them


def _crc(name: str, a: Any) -> int:
    return zlib.crc32(f"{name}|{tuple(int(s) for s in a.shape)}|{a.dtype}".encode())


def _gather(group: ProcessGroup, vec: np.ndarray, like: Any) -> np.ndarray:
    """All-gather an int64 vector on the device the parameters live on; (size, len) on the host."""
    xp = np if isinstance(like, np.ndarray) else importlib.import_module(type(like).__module__.split(".")[0])
    mine = xp.asarray(vec)
    out = xp.empty(group.size() * vec.size, dtype=mine.dtype)
    group.all_gather(out, mine)
    out = out.get() if hasattr(out, "get") else out
    return np.asarray(out).reshape(group.size(), vec.size)


def _describe(d: np.ndarray) -> str:
    if d[0] == 0:
        return "no such parameter"
    shape = tuple(int(s) for s in d[3 : 3 + int(d[1])])
    code = int(d[2])
    return f"shape {shape} {_DTYPE_NAMES[code - 1] if 0 < code <= len(_DTYPE_NAMES) else f'dtype#{code}'}"


def verify_params_across_ranks(group: ProcessGroup, named: list[tuple[str, Any]], who: str) -> None:
    """Raise ``CollectiveError`` on every rank when the (name, shape, dtype) lists differ between ranks."""
    if group.size() == 1 or not named:
        return
    arrays = [(n, getattr(p, "_data", p)) for n, p in named]
    vec = np.full(2 + SLOTS, -1, dtype=np.int64)
    vec[0] = len(arrays)
    crcs = [_crc(n, a) for n, a in arrays]
    vec[1] = zlib.crc32(np.asarray(crcs, dtype=np.int64).tobytes())
    vec[2 : 2 + min(SLOTS, len(crcs))] = crcs[:SLOTS]
    table = _gather(group, vec, arrays[0][1])
    bad = [r for r in range(1, group.size()) if not np.array_equal(table[r], table[0])]
    if not bad:
        return
    counts = {r: int(table[r, 0]) for r in [0, *bad]}
    diff = [i for i in range(SLOTS) if any(table[r, 2 + i] != table[0, 2 + i] for r in bad)]
    if not diff:  # same first SLOTS parameters: a later one (or the count) differs
        raise CollectiveError(
            f"{who}: the model's parameters differ across ranks (ranks {bad} differ from rank 0 beyond the first "
            f"{SLOTS} parameters; counts {counts}); every rank must build the same model"
        )
    i = diff[0]
    desc = np.zeros(9, dtype=np.int64)  # has, ndim, dtype, shape[:6]
    if i < len(arrays):
        a = arrays[i][1]
        desc[:3] = (1, min(a.ndim, 6), _dtype_code(a.dtype))
        desc[3 : 3 + min(a.ndim, 6)] = tuple(int(s) for s in a.shape)[:6]
    descs = _gather(group, desc, arrays[0][1])
    r = next(k for k in bad if table[k, 2 + i] != table[0, 2 + i])
    mine = f"'{arrays[i][0]}'" if i < len(arrays) else "nothing"
    what = "another name" if np.array_equal(descs[r], descs[0]) else _describe(descs[r])
    raise CollectiveError(
        f"{who}: the model's parameters differ across ranks: parameter #{i} is {_describe(descs[0])} on rank 0 "
        f"but {what} on rank {r} (ranks differing from rank 0: {bad}; parameter counts {counts}; "
        f"here, rank {group.rank()}, #{i} is {mine}); every rank must build the same model"
    )
