"""TMA tensor maps (CUtensorMap) of the sm_90a GEMM operands (kernels/gemm_wgmma.cuh), encoded by blutensor's encoder.

Each GEMM operand is described as a 3-D tensor (contiguous columns, rows, batch) with a box of one 128-byte
swizzled tile row set: the box's inner extent is 128 bytes (64 bf16 or 32 fp32, the 128-byte swizzle span,
which the kernels' wgmma descriptors assume) and its outer extent is the tile's rows (K-major operands:
BM or BN rows; M/N-major operands: BK k rows of one 64-column atom). The map is passed by value as a
``__grid_constant__`` kernel parameter, so a launch needs no device memory and stays capture-safe.

The encoding itself (the driver's ``cuTensorMapEncodeTiled`` through ctypes, its rules, the cache of encoded
maps) is blutensor's, ``blutensor.ext.tma``: one encoder for blutensor's and blublas's kernels. BluBLAS does not
import blutensor; the plugin host hands the encoder over through the ``blutrain_tma_encoder`` hook when it loads
blublas (``bt.ext.get_host()``, done by any use of blutensor's GEMM dispatch); a process without a plugin host
(blublas called directly, its self-test child, its tools) loads the encoder registered under the entry-point group
``blutrain.tma_encoder`` (blutensor registers ``blutensor.ext:tma``) on first need, and ``use_encoder(module)``
sets one explicitly. Without an encoder :func:`available` is False, the automatic choice runs the sm_90 GEMMs on
the mma.sync kernels and a forced TMA config is a GemmError saying so.
"""

from __future__ import annotations

import sys
from typing import Any

from .errors import GemmError

#: what an encoder module provides (blutensor.ext.tma)
_ENCODER_API = ("tensor_spec", "spec_problem", "encode", "encode_args", "TmaError", "SWIZZLE_SPAN", "TMAP_DTYPE")
#: entry-point group of installed encoders (blutensor's pyproject registers ``blutensor.ext:tma``)
ENTRY_POINT_GROUP = "blutrain.tma_encoder"
_encoder: Any = None
_searched = False  # the entry points were looked at once (found or not)
_checked: set = set()  # specs that passed check_spec (encode runs on every TMA launch)


def use_encoder(module: Any) -> None:
    """Encode the GEMMs' tensor maps with ``module`` (``blutensor.ext.tma``); raises GemmError naming what a
    module without the encoder's interface lacks."""
    _check_interface(module)
    _install(module)
    memo = sys.modules.get(__package__ + ".memo")
    if memo is not None:  # launches planned without an encoder took the mma.sync kernels
        memo.clear()


def _check_interface(module: Any) -> None:
    missing = [n for n in _ENCODER_API if not hasattr(module, n)]
    if missing:
        raise GemmError(f"{getattr(module, '__name__', module)!r} is not a TMA tensor-map encoder: it lacks "
                        f"{', '.join(missing)} (pass blutensor.ext.tma)")


def _install(module: Any) -> None:
    global _encoder
    _encoder = module
    _checked.clear()


def _discover() -> None:
    """Use the first encoder registered under ENTRY_POINT_GROUP (by name) that loads; once per process."""
    global _searched
    if _searched:
        return
    _searched = True
    from importlib.metadata import entry_points

    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            module = ep.load()
            _check_interface(module)
        except Exception as exc:  # noqa: BLE001 - a broken or foreign registration: say so, try the next
            import warnings

            warnings.warn(f"blublas: TMA encoder entry point {ep.name} = {ep.value} unusable ({exc})", stacklevel=3)
            continue
        _install(module)
        return


def available() -> bool:
    """Whether a tensor-map encoder was given or found (see the module docstring)."""
    if _encoder is None:
        _discover()
    return _encoder is not None


def missing_reason() -> str:
    """Why the TMA kernels cannot run without an encoder (tma_ok's and the forced-config error's wording)."""
    return ("needs a TMA tensor-map encoder: none was handed over by a plugin host and none is registered under "
            f"the {ENTRY_POINT_GROUP!r} entry points (install blutensor, or call blublas.tma.use_encoder(module))")


def encoder() -> Any:
    """The encoder module in use (given, or found on first need); GemmError when there is none."""
    if not available():
        raise GemmError(f"TMA tensor maps: {missing_reason()}")
    return _encoder


def operand_spec(ptr: int, rows: int, cols: int, ld: int, batch: int, bstride: int, itemsize: int,
                 box_outer: int) -> Any:
    """The map spec of one stored operand (rows x cols, leading dimension ``ld``, ``batch`` entries ``bstride``
    elements apart, 0 = shared) whose boxes are 128 bytes of columns by ``box_outer`` rows: dims (cols, rows,
    batch entries), byte strides (between rows, between batch entries)."""
    enc = encoder()
    nb = max(batch, 1)
    row_bytes = ld * itemsize
    bs = bstride * itemsize if batch > 0 else row_bytes * max(rows, 1)
    box = (enc.SWIZZLE_SPAN // itemsize, box_outer, 1)
    return enc.tensor_spec(ptr, itemsize, (cols, rows, nb), (row_bytes, bs), box)


def spec_problem(spec: Any) -> str:
    """'' when the driver accepts ``spec`` (the encoder's rules for tiled maps with the 128-byte swizzle) and its
    rows and batch entries do not overlap (a GEMM operand's), else why not."""
    why = encoder().spec_problem(spec)
    if why:
        return why
    if spec.strides[0] < spec.dims[0] * spec.itemsize:
        return f"row stride {spec.strides[0]} B is shorter than a row of {spec.dims[0]} elements"
    if spec.dims[2] > 1 and spec.strides[1] < spec.strides[0] * spec.dims[1]:
        return f"batch stride {spec.strides[1]} B overlaps the {spec.dims[1]} rows of a batch entry"
    return ""


def check_spec(spec: Any, name: str) -> None:
    """Raise GemmError naming ``name`` when ``spec`` cannot be read by TMA (see :func:`spec_problem`)."""
    why = spec_problem(spec)
    if why:
        raise GemmError(f"{name}: cannot be read by TMA ({why}); the mma.sync kernels handle such operands")


def encode(spec: Any, name: str = "operand") -> Any:
    """The encoded map of ``spec`` as a kernel argument passed by value: a one-element array of the 128-byte
    TMAP_DTYPE (cached by the encoder, which calls the driver's cuTensorMapEncodeTiled)."""
    enc = encoder()
    if spec not in _checked:
        check_spec(spec, name)
        if len(_checked) >= 4096:
            _checked.clear()
        _checked.add(spec)
    try:
        return enc.encode(spec, name)
    except enc.TmaError as e:
        raise GemmError(f"{name}: {e}") from e
