"""pytest-benchmark suite: BluBLAS kernels beside cuBLASLt on GPT-2 124M's GEMMs at B*T=16384.

Run on a GPU machine from the repo root:
    pytest benchmarks/blublas/bench_gemm.py --benchmark-json=/tmp/gemm.json
    python3 benchmarks/blublas/summarize_gemm.py /tmp/gemm.json benchmarks/results/blublas_gemm_h200.json
Each benchmark round replays a CUDA graph of ``GRAPH_CALLS`` calls of one GEMM, so the timed quantity is the
kernels' time with the host out of the loop (how a captured training step runs them); the per-call time of
plain eager calls, Python planning included, is measured beside it (``eager_ms``). ``extra_info`` holds the
shape, layout, precision, provider, both times and TFLOP/s, and for blublas the tile config and split-K. Without
CuPy or a GPU every benchmark is skipped. The autotuner runs once per shape before timing (BLUBLAS_AUTOTUNE=0
keeps the heuristic choice); its cache is reused across runs.
"""

from __future__ import annotations

import os

import pytest
from blublas.testing import gpt2_gemm_shapes, time_ms

GRAPH_CALLS = 10
SHAPES = gpt2_gemm_shapes()  # GPT-2 124M at B*T = 16384 (blublas.testing): fwd nt, dX nn, dW tn
PRECISIONS = ("fp32", "tf32", "bf16", "3xtf32")  # 3xtf32: BLUBLAS_3XTF32 picks concat (default) or two
PROVIDERS = ("blublas", "cublas")


def _cupy():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
        return cupy
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"needs CuPy and a CUDA GPU: {exc}")


_inputs: dict = {}


def _operands(cp, prec: str, layout: str, m: int, n: int, k: int):
    key = (prec, layout, m, n, k)
    if key not in _inputs:
        _inputs.clear()
        cp.get_default_memory_pool().free_all_blocks()
        ta, tb = layout[0] == "t", layout[1] == "t"
        a = cp.random.standard_normal((k, m) if ta else (m, k), dtype=cp.float32) * 0.5
        b = cp.random.standard_normal((n, k) if tb else (k, n), dtype=cp.float32) * 0.5
        dt = cp.float32
        if prec == "bf16":
            a = (a.view(cp.uint32) >> 16).astype(cp.uint16)
            b = (b.view(cp.uint32) >> 16).astype(cp.uint16)
            dt = cp.uint16
        _inputs[key] = (a, b, cp.empty((m, n), dt))
    return _inputs[key]


@pytest.mark.cuda
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_gemm_gpt2(benchmark, shape, precision, provider):
    cp = _cupy()
    from blublas import gemm, loader

    name, layout, m, n, k = shape
    a, b, out = _operands(cp, precision, layout, m, n, k)
    kw = dict(trans_a=layout[0] == "t", trans_b=layout[1] == "t", precision=precision, provider=provider)
    tune = os.environ.get("BLUBLAS_AUTOTUNE", "1") != "0"
    autotune = tune if provider == "blublas" and precision != "3xtf32" else None
    gemm(a, b, out, autotune=autotune, **kw)  # compile, tune, warm up
    cp.cuda.Device().synchronize()
    eager_ms = time_ms(cp, lambda: gemm(a, b, out, **kw))
    st = cp.cuda.Stream(non_blocking=True)
    with st:  # both providers are capture-safe: GRAPH_CALLS calls in one graph
        gemm(a, b, out, **kw)
        st.synchronize()
        st.begin_capture()
        for _ in range(GRAPH_CALLS):
            gemm(a, b, out, **kw)
        graph = st.end_capture()

    def run():
        graph.launch(st)
        st.synchronize()

    benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
    flops = 2.0 * m * n * k
    kernel_s = benchmark.stats.stats.median / GRAPH_CALLS
    benchmark.extra_info.update(
        name=name,
        layout=layout,
        M=m,
        N=n,
        K=k,
        precision=precision,
        provider=provider,
        graph_calls=GRAPH_CALLS,
        kernel_ms=round(kernel_s * 1e3, 5),
        tflops=round(flops / kernel_s / 1e12, 1),
        eager_ms=round(eager_ms, 5),
        tflops_eager=round(flops / eager_ms / 1e9, 1),
        gpu=cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode(),
        cc=loader.compute_capability(),
    )
    if provider == "blublas":
        from blublas import api, launch

        p = api.plan(
            a,
            b,
            out,
            alpha=1.0,
            beta=0.0,
            bias=None,
            epilogue="none",
            save_preact=None,
            batched=False,
            trans_a=kw["trans_a"],
            trans_b=kw["trans_b"],
            precision=precision,
        )
        cfg, s = launch.select(p, cp.cuda.get_current_stream(), None, None, False)
        benchmark.extra_info.update(config=cfg.name, splits=s)
