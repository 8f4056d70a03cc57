"""Lazy index validation on CUDA: a kernel records the first out-of-range index in a device flag and the
host reads the flag only when asked (:func:`raise_pending`, e.g. at log time), so the training step never
waits for the GPU. The execution policy's ``validate_indices`` (``BLUTRAIN_VALIDATE_INDICES``, or
``bt.policy.scope(validate_indices=...)``): 'lazy' (default), 'sync' (check and raise at the call, one host sync per
call), 'off' (``BLUTRAIN_VALIDATE_INDICES=0``: a bad target then shows only as a NaN loss row).

Where the error surfaces (lazy mode): blumodels' Trainer calls :func:`raise_pending` after every step's loss
read (eager and CUDA-graph steps) and after each evaluation, so a bad batch stops the run at the step that
saw it, before the next checkpoint. Code driving ops directly calls it whenever it wants the check."""

from __future__ import annotations

import numpy as np

from blutensor.errors import ShapeError

FILE = "cross_entropy.cu"


def mode() -> str:
    """'lazy', 'sync' or 'off': the current execution policy's ``validate_indices`` (read at every call, so a
    policy scope decides per region)."""
    from blutensor.policy import current

    return current().validate_indices


_flags: dict[int, object] = {}  # device -> int64[4] flag (site, value, position, bound)
_sites: list[str] = [""]  # site id -> what was checked (id 0 = no error)


def _site(what: str) -> int:
    if what not in _sites:
        _sites.append(what)
    return _sites.index(what)


def flag_array():
    """The device's error flag (allocated once, zeroed; stays at a fixed address, so graphs may capture it)."""
    from blutensor.backends.cupy._loader import cupy

    cp = cupy()
    dev = cp.cuda.runtime.getDevice()
    f = _flags.get(dev)
    if f is None:
        f = _flags[dev] = cp.zeros(4, dtype=cp.int64)
    return f


def check_async(idx, lo: int, hi: int, what: str, allowed: int | None = None) -> None:
    """Record on device whether int64 ``idx`` has an element outside [lo, hi) (other than ``allowed``)."""
    from blutensor.backends.cupy._loader import launch, num_sms

    n = int(idx.size)
    if n == 0:
        return
    grid = max(1, min(-(-n // 256), num_sms() * 4))
    launch(
        FILE,
        "blu_cross_entropy_check_indices",
        grid,
        256,
        (
            idx,
            np.int64(n),
            np.int64(lo),
            np.int64(hi),
            np.int64(0 if allowed is None else allowed),
            np.int32(allowed is not None),
            np.int64(_site(what)),
            flag_array(),
        ),
    )


def pending() -> tuple[str, int, int, int] | None:
    """(what, index, position, bound) of a recorded bad index on the current device, or None; host sync."""
    if not _flags:
        return None
    from blutensor.backends.cupy._loader import cupy

    dev = cupy().cuda.runtime.getDevice()
    f = _flags.get(dev)
    if f is None:
        return None
    site, value, pos, bound = (int(x) for x in f.get())
    if site == 0:
        return None
    return _sites[site] if site < len(_sites) else f"site {site}", value, pos, bound


def raise_pending() -> None:
    """Raise ShapeError for an index recorded since the last call (and clear the flag); no-op on CPU-only runs."""
    p = pending()
    if p is None:
        return
    what, value, pos, bound = p
    flag_array().fill(0)
    raise ShapeError(
        f"{what}: index {value} at flat position {pos} out of range [0, {bound}) (detected on device by the "
        f"lazy index check; set BLUTRAIN_VALIDATE_INDICES=sync or bt.policy.scope(validate_indices='sync') to raise "
        f"at the failing call)"
    )
