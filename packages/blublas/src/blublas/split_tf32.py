"""The ``3xtf32`` precision: fp32-accurate GEMMs emulated on the TF32 tensor cores (not TF32).

Each fp32 operand is split into TF32 parts, x = hi + lo (kernels/split_tf32.cu), and
``op(A) @ op(B) ~= hi(A) hi(B) + hi(A) lo(B) + lo(A) hi(B)`` (exact TF32 products, fp32 accumulation; the
lo*lo term is below fp32 precision) runs as TF32 GEMMs of the chosen provider (cuBLASLt or our kernels):

* ``two`` (default): ``[A_lo | A_hi] @ [B_hi ; B_lo]`` (the small terms, over 2K) then ``A_hi @ B_hi`` with
  beta = 1 (views into the same buffers), 2/3 of the temporary memory;
* ``concat``: ONE GEMM over 3K, ``[A_hi | A_lo | A_hi] @ [B_hi ; B_hi ; B_lo]`` (~5% faster, but the tensor
  cores sum each k-group's products aligned to the largest exponent, so the small terms lose bits next to the
  big ones: its error is several times ``two``'s; measured: see benchmarks/results/blublas_3xtf32_h200.json).

``BLUBLAS_3XTF32=concat|two`` chooses. alpha, beta*out, bias, GELU and the pre-activation are applied to the
final result exactly as for ``fp32``. The split operands are temporaries from the current CuPy allocator on
the caller's stream (stream-ordered reuse), nothing synchronises the host: usable inside graph capture.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from . import settings as _settings
from .api import MatInfo, Problem

KERNEL_FILE = "split_tf32.cu"
MODES = _settings.SPLIT_MODES
MIN_CHUNK_K = 256


def max_temp_bytes() -> int:
    """BLUBLAS_3XTF32_MAX_TEMP_MB (default 1024; blublas.settings, read once): cap on the split operands of one
    GEMM, in bytes; longer K runs in chunks."""
    return _settings.get().max_3xtf32_temp_bytes


def mode() -> str:
    """BLUBLAS_3XTF32 (default 'two'; blublas.settings, read once): 'two' GEMMs (2K, then K with beta = 1), or
    one GEMM over 3K ('concat')."""
    return _settings.get().split_3xtf32


def split_geometry(info: MatInfo, k_along_cols: bool, parts: int) -> tuple[int, int, int, int]:
    """(rows, cols, ld, batch stride) of the dense P-part operand written for ``info`` (elements)."""
    if k_along_cols:
        rows, cols = info.rows, parts * info.cols
    else:
        rows, cols = parts * info.rows, info.cols
    return rows, cols, cols, (parts * info.rows * info.cols if info.batch else 0)


def split_operand(x: MatInfo, k_along_cols: bool, parts: int, lo_mask: int, stream: Any) -> tuple[Any, MatInfo]:
    """Launch the split kernel for one stored operand; returns (buffer, its MatInfo) with K lengthened P times.

    Bit j of ``lo_mask``: part j (along K) holds lo, else hi. A transposed operand stays transposed."""
    import cupy

    from . import loader

    nb = max(x.batch, 1)
    rows, cols, ld, bstride = split_geometry(x, k_along_cols, parts)
    buf = cupy.empty(nb * parts * x.rows * x.cols, dtype=cupy.float32)
    vec = 4 if (x.cols % 4 == 0 and x.ld % 4 == 0 and x.bstride % 4 == 0 and x.ptr % 16 == 0) else 1
    name = "blu_split_tf32_concat_v4" if vec == 4 else "blu_split_tf32_concat"
    fn = loader.get_function(KERNEL_FILE, name)
    nvec = x.cols // vec
    threads = int(min(256, max(32, -(-nvec // 32) * 32)))
    gx = int(max(1, min(-(-nvec // threads), 1024)))
    gy = int(max(1, min(nb * x.rows, 65535)))
    with stream:
        fn(
            (gx, gy),
            (threads,),
            (
                np.uint64(x.ptr),
                np.uint64(int(buf.data.ptr)),
                np.int32(x.rows),
                np.int32(x.cols),
                np.int64(x.ld),
                np.int64(x.bstride),
                np.int32(nb),
                np.int32(parts),
                np.int32(lo_mask),
                np.int32(1 if k_along_cols else 0),
            ),
        )
    info = MatInfo(rows, cols, ld, x.batch, bstride, 4, int(buf.data.ptr), buf.nbytes)
    return buf, info


def part_view(info: MatInfo, k_along_cols: bool, parts: int, j: int) -> MatInfo:
    """MatInfo of part ``j`` inside a P-part operand written by :func:`split_operand` (a strided view)."""
    if k_along_cols:
        k = info.cols // parts
        return replace(info, cols=k, ptr=info.ptr + 4 * j * k)
    k = info.rows // parts
    return replace(info, rows=k, ptr=info.ptr + 4 * j * k * info.cols)


def k_slice(info: MatInfo, k_along_cols: bool, k0: int, kc: int) -> MatInfo:
    """MatInfo of the K range [k0, k0 + kc) of a stored operand (a strided view, nothing copied)."""
    if k_along_cols:
        return replace(info, cols=kc, ptr=info.ptr + info.itemsize * k0)
    return replace(info, rows=kc, ptr=info.ptr + info.itemsize * k0 * info.ld)


def k_chunks(p: Problem, parts: int, cap: int) -> list[Problem]:
    """Split ``p`` along K so each chunk's split operands stay under ``cap`` bytes.

    Chunk 0 keeps beta; later chunks accumulate (beta = 1); only the last one carries bias, GELU and the
    pre-activation, so the epilogue sees the full sum exactly as the unchunked GEMM would."""
    per_k = parts * 4 * max(p.batch, 1) * (p.M + p.N)
    if per_k * p.K <= cap:
        return [p]
    kc = max(MIN_CHUNK_K, (cap // per_k) // 32 * 32)
    out = []
    for i, k0 in enumerate(range(0, p.K, kc)):
        k = min(kc, p.K - k0)
        q = replace(p, A=k_slice(p.A, not p.trans_a, k0, k), B=k_slice(p.B, p.trans_b, k0, k), K=k,
                    beta=p.beta if i == 0 else 1.0)
        if k0 + k < p.K:
            q = replace(q, bias=None, bias_tag=None, gelu=False, preact=None, P=None)
        out.append(q)
    return out


def plans_3xtf32(p: Problem, split_a: Any, split_b: Any, how: str) -> tuple[list[Problem], list[Any]]:
    """The TF32 problems computing 3xtf32 problem ``p``; ``split_a/split_b(parts, lo_mask)`` -> (buf, MatInfo).

    Returns (problems to run in order, buffers to keep alive until they are enqueued)."""
    a_cols, b_cols = not p.trans_a, p.trans_b  # is K the stored operand's column axis?
    if how == "concat":  # [a_hi | a_lo | a_hi] @ [b_hi ; b_hi ; b_lo]
        abuf, A3 = split_a(3, 0b010)
        bbuf, B3 = split_b(3, 0b100)
        return [replace(p, A=A3, B=B3, K=3 * p.K, precision="tf32")], [abuf, bbuf]
    # two: [a_lo | a_hi] @ [b_hi ; b_lo] carries the small terms and beta*out; then a_hi @ b_hi, beta = 1,
    # with bias / GELU / pre-activation on the final sum
    abuf, A2 = split_a(2, 0b01)
    bbuf, B2 = split_b(2, 0b10)
    small = replace(p, A=A2, B=B2, K=2 * p.K, precision="tf32", bias=None, bias_tag=None, gelu=False,
                    preact=None, P=None)
    big = replace(p, A=part_view(A2, a_cols, 2, 1), B=part_view(B2, b_cols, 2, 0), precision="tf32", beta=1.0)
    return [small, big], [abuf, bbuf]


def run_3xtf32(p: Problem, stream: Any, run: Any) -> None:
    """Compute a validated 3xtf32 Problem (CuPy, output allocated) with ``run(problem)`` doing TF32 GEMMs."""
    import cupy

    s = stream if stream is not None else cupy.cuda.get_current_stream()
    if p.K == 0:  # nothing to split: out = beta*out + bias (+ GELU) as fp32 does it
        run(replace(p, precision="fp32"))
        return
    how = mode()
    with cupy.cuda.Device(p.device_id):
        for c in k_chunks(p, 3 if how == "concat" else 2, max_temp_bytes()):
            probs, keep = plans_3xtf32(
                c,
                lambda parts, mask, c=c: split_operand(c.A, not c.trans_a, parts, mask, s),
                lambda parts, mask, c=c: split_operand(c.B, c.trans_b, parts, mask, s),
                how,
            )
            for q in probs:
                run(q)
            del keep  # freed to the pool in stream order: the GEMMs above were enqueued first
