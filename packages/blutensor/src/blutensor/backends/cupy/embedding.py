"""Embedding lookup on CUDA (kernels/embedding.cu): vectorised gather and a deterministic backward
(stable radix sort of the indices, then a segmented reduction over fixed pieces of the sorted positions, no float
atomics), which adds into an existing float32 gradient buffer."""

from __future__ import annotations

import math

import numpy as np

from blutensor.autograd.node import ACCUMULATED
from blutensor.backends.cupy import _fallback
from blutensor.backends.cupy._loader import aligned16, capturing, cupy, first_bad_index, launch, num_sms, suffix
from blutensor.backends.cupy.sort import stable_argsort, thrust_capturable
from blutensor.errors import ShapeError
from blutensor.ops import nn_ops
from blutensor.ops.table import Kernel

FILE = "embedding.cu"
_STORAGE = (np.dtype(np.float32), np.dtype(np.uint16))


def embedding_forward(idx, weight):
    """out[i] = weight[idx[i]] for int64 ``idx`` (N,), contiguous ``weight`` (V, C); bad index: NaN row."""
    cp = cupy()
    V, C = weight.shape
    N = idx.size
    out = cp.empty((N, C), dtype=weight.dtype)
    if N and C:
        vec = aligned16(weight, out) and C % (16 // weight.dtype.itemsize) == 0
        wpb = 8
        launch(
            FILE,
            f"blu_embedding_forward_{suffix(weight)}",
            min(math.ceil(N / wpb), num_sms() * 16),
            wpb * 32,
            (idx, weight, out, np.int64(N), np.int64(V), np.int32(C), np.int32(vec)),
        )
    return out


#: the policy's ``embedding_backward`` (BLUTRAIN_EMBEDDING_BWD):
#: 'segments' (default: fixed pieces of SEG_PIECE sorted positions, one block each, whole runs
#: added at once and runs across pieces finished by a second pass: balanced however the tokens repeat, and it adds
#: into an existing gradient buffer), 'runs' (one block per run of an index sums it serially) or 'pieces' (runs cut
#: into PIECE sorted positions, summed in two passes). All are bitwise deterministic.
EMBEDDING_BWD = ("segments", "runs", "pieces")
PIECE = 32
#: sorted positions per block of the 'segments' backward (EMB_SEG_P in kernels/embedding.cu)
SEG_PIECE = 16
#: columns per block of the 'segments' second pass: a long run's row is summed by C / RUNS_COLS blocks at once
RUNS_COLS = 32


def backward_mode() -> str:
    """The embedding backward's algorithm ('segments', 'runs' or 'pieces'): the current execution policy's
    ``embedding_backward`` (BLUTRAIN_EMBEDDING_BWD)."""
    from blutensor.policy import current

    return current().embedding_backward


def radix_sort() -> bool:
    """Whether the sync-free radix argsort (backends/cupy/sort.py) runs eagerly too, not only in graphs: the policy's
    ``embedding_sort`` is 'radix' (BLUTRAIN_EMBEDDING_SORT=radix)."""
    from blutensor.policy import current

    return current().embedding_sort == "radix"


def _sorted(idx, num_embeddings: int, cp):
    """(sorted indices, order) of the flat int64 indices: a stable sort, capture-safe."""
    cap = capturing()
    # Thrust (cupy.argsort) syncs the stream on older CuPy builds: inside a graph only where the probe (run
    # once, eagerly) showed it captures and replays correctly; the sync-free radix argsort otherwise
    if radix_sort() or (cap and not thrust_capturable(cp, probe=False)):
        order = stable_argsort(idx, num_embeddings, cp)
    else:
        if not cap:
            thrust_capturable(cp)  # probe before the first capture (cached)
        order = cp.argsort(idx)  # CuPy's sort is a stable radix sort
    return cp.ascontiguousarray(idx[order]), cp.ascontiguousarray(order, dtype=cp.int64)


def embedding_backward(idx, g, num_embeddings: int, out=None):
    """dweight (V, C) = sum of the rows of ``g`` (N, C) per index, bitwise deterministic.

    ``out`` (float32 (V, C), C-contiguous; 'segments' only): the sums are added into it (a gradient buffer that
    already holds, say, the tied lm_head's weight gradient) and it is returned: no dense (V, C) zero, no
    separate add. Without it a zeroed array of ``g``'s dtype is returned."""
    cp = cupy()
    N, C = g.shape
    mode = backward_mode()
    if out is not None and (mode != "segments" or out.dtype != np.float32 or not out.flags.c_contiguous
                            or tuple(out.shape) != (num_embeddings, C)):
        out += embedding_backward(idx, g, num_embeddings).astype(np.float32, copy=False)
        return out
    dw = out if out is not None else cp.zeros((num_embeddings, C), dtype=g.dtype)
    if N == 0 or C == 0:
        return dw
    sorted_idx, order = _sorted(idx, num_embeddings, cp)
    block = 128 if C >= 128 else 32 * math.ceil(C / 32)
    if mode == "segments":
        pieces = -(-N // SEG_PIECE)
        part = cp.empty((pieces, 2, C), dtype=cp.float32)  # boundary segments' partial sums
        args = (np.int64(N), np.int64(num_embeddings), np.int32(C))
        launch(FILE, f"blu_embedding_backward_seg_{suffix(g)}_{suffix(dw)}", pieces, block,
               (sorted_idx, order, g, dw, part) + args)
        if pieces > 1:
            launch(FILE, f"blu_embedding_backward_seg_runs_{suffix(dw)}", (pieces, math.ceil(C / RUNS_COLS)),
                   RUNS_COLS, (sorted_idx, dw, part) + args)
        return dw
    if mode == "pieces":
        part = cp.empty((N, C), dtype=cp.float32)  # piece sums (only the rows of piece starts are written)
        grid = (N, math.ceil(C / block))
        launch(FILE, f"blu_embedding_backward_pieces_{suffix(g)}", grid, block,
               (sorted_idx, order, g, part, np.int64(N), np.int64(num_embeddings), np.int32(C), np.int32(PIECE)))
        launch(FILE, f"blu_embedding_backward_runs_{suffix(g)}", grid, block,
               (sorted_idx, part, dw, np.int64(N), np.int64(num_embeddings), np.int32(C), np.int32(PIECE)))
        return dw
    launch(
        FILE,
        f"blu_embedding_backward_{suffix(g)}",
        (N, math.ceil(C / block)),
        block,
        (sorted_idx, order, g, dw, np.int64(N), np.int64(num_embeddings), np.int32(C)),
    )
    return dw


class EmbeddingCuda(Kernel):
    """embedding on CUDA, fp32 and bf16 weights; backward adds into the float32 ``.grad`` the engine offers."""

    PLUGIN_NAME = "blutensor.cuda.embedding"
    OP = "embedding"
    BACKEND = "cuda"
    DTYPES = ("float32", "bfloat16")
    PRIORITY = 10
    BF16_NATIVE = True
    DTYPE_ARG = 1
    GRAD_INTO = True

    @staticmethod
    def forward(ctx, idx, weight):
        if weight.dtype not in _STORAGE or weight.ndim != 2 or idx.dtype.kind not in "iu":
            return _fallback.forward(
                ctx,
                nn_ops.embedding_forward,
                (idx, weight),
                {},
                bf16_inputs=(False, weight.dtype == np.uint16),
            )
        cp = cupy()
        flat = cp.ascontiguousarray(idx.reshape(-1), dtype=cp.int64)
        bad = first_bad_index(flat, 0, weight.shape[0], what="embedding")
        if bad is not None:
            raise ShapeError(
                f"embedding: index {bad} out of range [0, {weight.shape[0]}) for a weight of shape "
                f"{tuple(weight.shape)}"
            )
        out = embedding_forward(flat, cp.ascontiguousarray(weight))
        ctx.saved = (flat, weight.shape)
        return out.reshape(tuple(idx.shape) + (weight.shape[1],))

    @staticmethod
    def backward(ctx, g):
        if _fallback.used(ctx):
            return _fallback.backward(ctx, nn_ops.embedding_backward, g)
        flat, wshape = ctx.saved
        if len(ctx.needs) > 1 and not ctx.needs[1]:
            return None, None
        g2 = cupy().ascontiguousarray(g).reshape(-1, wshape[1])
        into = getattr(ctx, "grad_into", None)
        buf = into[1] if into is not None and len(into) > 1 else None
        if buf is not None:  # the float32 .grad (tied: already holding the lm_head's gradient): added into
            embedding_backward(flat, g2, wshape[0], out=buf)
            return None, ACCUMULATED
        return None, embedding_backward(flat, g2, wshape[0])
