"""The launch memo: a repeated GEMM call (same arrays, strides, options, stream) replays its recorded launches.

Planning a call (validation, config choice, flags, tensor maps: api.plan and launch.select/launch) costs tens of
microseconds of Python, as much as a small GEMM's kernel. launch.launch records the kernel launches of a call
under its key; the next identical call (api._planned_gemm) replays them without planning. Nothing is recorded
while capturing (launch.run_blublas); launches that use the stream's workspace (split-K partials, K-major copies)
replay only while that buffer is unchanged; every switch that changes the plan is part of the key.
``BLUBLAS_LAUNCH_MEMO=0`` turns it off; :func:`clear` forgets everything (and so does blublas.settings.reset: the
switches are read once, so a recorded plan stays valid until they are read again).
"""

from __future__ import annotations

from typing import Any

from . import loader
from . import settings as _settings

_launch_memo: dict[tuple, tuple] = {}
_MEMO_MAX = 4096


def clear() -> None:
    """Forget every recorded launch and memoized config choice (tests; after changing tuned tables by hand)."""
    from . import launch

    _launch_memo.clear()
    launch._choice_memo.clear()


def _arr_key(x: Any) -> tuple | None:
    return None if x is None else (x.data.ptr, x.shape, x.strides, x.dtype.char)


def key(a: Any, b: Any, out: Any, bias: Any, save_preact: Any, stream: Any, opts: tuple) -> tuple | None:
    """The memo key of a CuPy GEMM call (None: do not memoize); ``opts``: every scalar argument."""
    if not _settings.get().launch_memo:
        return None
    import cupy

    st = stream if stream is not None else cupy.cuda.get_current_stream()
    try:
        k = (st.ptr, _arr_key(a), _arr_key(b), _arr_key(out), _arr_key(bias), _arr_key(save_preact), opts)
        hash(k)
    except (AttributeError, TypeError):  # not arrays / unhashable options: plan() names what is wrong
        return None
    return k


def record(k: tuple, launches: list, device_id: int) -> None:
    """Remember ``launches`` [(fn, grid, block, args, smem)] of the call keyed ``k``, with the stream
    workspace they may point into (valid while that buffer stays the same)."""
    if len(_launch_memo) >= _MEMO_MAX:
        _launch_memo.clear()
    _launch_memo[k] = (tuple(launches), device_id, loader.workspace_token())


def replay(k: tuple | None, stream: Any) -> bool:
    """Launch the recorded kernels of ``k`` on ``stream`` (default: the current one); False if none."""
    hit = _launch_memo.get(k) if k is not None else None
    if hit is None:
        return False
    import cupy

    launches, dev, ws_token = hit
    with cupy.cuda.Device(dev):
        if stream is not None:
            stream.__enter__()
        try:
            if ws_token is not None and loader.workspace_token() != ws_token:
                return False  # the workspace was reallocated since: plan again
            for fn, grid, block, args, smem in launches:
                fn(grid, block, args, shared_mem=smem)
        finally:
            if stream is not None:
                stream.__exit__(None, None, None)
    return True
