"""An op's time on the GPU in the profiler is the CUDA-event time of its kernels: a 4096^3 matmul timed by the profiler
matches the same matmul timed with raw CuPy events (within 0.8x-1.25x), one op span per call."""

from __future__ import annotations

import statistics

import blutensor as bt
import pytest
from bluprofiler import profile


@pytest.mark.cuda
def test_profiler_gpu_time_of_a_matmul_matches_raw_cuda_events():
    import cupy as cp

    n = 4096
    a = bt.randn(n, n, device="cuda")
    bt.matmul(a, a)
    cp.cuda.Device().synchronize()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record()
    for _ in range(5):
        bt.matmul(a, a)
    e1.record()
    e1.synchronize()
    raw_ms = cp.cuda.get_elapsed_time(e0, e1) / 5
    with profile() as prof:
        for _ in range(5):
            bt.matmul(a, a)
    ops = prof.result.ops()
    assert len(ops) == 5, [e.key for e in ops]
    prof_ms = statistics.median(e.gpu_ms for e in ops)
    assert 0.8 < prof_ms / raw_ms < 1.25, (prof_ms, raw_ms)
