"""bluallocator on a CUDA GPU: allocation throughput and the peak memory of a transformer-like trace.

    python3 benchmarks/bluallocator/bench_alloc_gpu.py OUTDIR

1. allocation throughput: our CachingAllocator vs CuPy's default pool, raw and through cupy.empty;
2. a transformer-like allocation trace (packages/bluallocator/dev/alloc_trace.py) replayed with real CuPy
   arrays: peak memory reserved in the steady state (steps >= 1) by our allocator (with and without the step-0
   profile + flush) vs CuPy's pool.
Prints a compact summary and writes OUTDIR/bench_alloc_gpu.json. The allocator's correctness on the GPU is the
`cuda`-marked tests (packages/bluallocator/tests, and blumodels' test_memory.py through the Trainer).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "packages", "bluallocator")
sys.path.insert(0, os.path.join(PKG, "dev"))  # alloc_trace: the trace generator and its NumPy replay
try:
    import bluallocator  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(PKG, "src"))

import bluallocator  # noqa: E402
import cupy  # noqa: E402
import numpy as np  # noqa: E402
from alloc_trace import replay, transformer_trace  # noqa: E402
from bluallocator import CachingAllocator, CudaBackend  # noqa: E402

MiB = 1 << 20


SIZES = [4096, 65536, 768 * 4, 3 * 768 * 4, 768 * 768 * 4, 768 * 3072 * 4,
         4 * 1024 * 768 * 4, 4 * 1024 * 3072 * 4]


def bench_raw(n_rounds: int = 30) -> dict:
    """malloc/free pairs per second without CuPy array objects: our allocator vs CuPy pool.malloc."""
    sizes = SIZES * 16
    ours = CachingAllocator(CudaBackend())
    for s in sizes:
        ours.free(ours.malloc(s, 0))
    t = time.perf_counter()
    for _ in range(n_rounds):
        ps = [ours.malloc(s, 0) for s in sizes]
        for p in ps:
            ours.free(p)
    t_ours = (time.perf_counter() - t) / (n_rounds * len(sizes))
    pool = cupy.cuda.MemoryPool()
    for s in sizes:
        pool.malloc(s)
    t = time.perf_counter()
    for _ in range(n_rounds):
        ms = [pool.malloc(s) for s in sizes]
        del ms
    t_cupy = (time.perf_counter() - t) / (n_rounds * len(sizes))
    # one exact-size pair in a loop (the fast path alone), ours vs CuPy's pool, best of 3
    pairs = {}
    for name, mal, fre in (("ours", lambda: ours.malloc(3072, 0), ours.free),
                           ("cupy_pool", lambda: pool.malloc(3072), lambda m: None)):
        best = 1e9
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(20000):
                fre(mal())
            best = min(best, (time.perf_counter() - t) / 20000)
        pairs[name] = best * 1e6
    # the same with one listener installed (profiler cost), and after removing it (must be back to fast)
    seen = [0]

    def listener(ev, ptr, size, stream, ts):
        seen[0] += 1

    bluallocator.add_listener(listener)
    t = time.perf_counter()
    for _ in range(20000):
        ours.free(ours.malloc(3072, 0))
    with_listener = (time.perf_counter() - t) / 20000 * 1e6
    bluallocator.remove_listener(listener)
    ours.empty_cache()
    pool.free_all_blocks()
    return {"us_per_pair_ours": t_ours * 1e6, "us_per_pair_cupy_pool": t_cupy * 1e6,
            "ratio_ours_over_cupy": t_ours / t_cupy, "us_single_pair_ours": pairs["ours"],
            "us_single_pair_cupy_pool": pairs["cupy_pool"], "us_single_pair_ours_with_listener": with_listener,
            "listener_events": seen[0], "target_us_per_pair": 3.0, "meets_target": t_ours * 1e6 <= 3.0}


def _bench_cupy_empty(n_rounds: int) -> float:
    sizes = SIZES * 16
    for s in sizes:
        cupy.empty(s, dtype=cupy.uint8)
    t = time.perf_counter()
    for _ in range(n_rounds):
        arrs = [cupy.empty(s, dtype=cupy.uint8) for s in sizes]
        del arrs
    return (time.perf_counter() - t) / (n_rounds * len(sizes))


def bench_cupy_arrays(n_rounds: int = 30) -> dict:
    """cupy.empty + release per second: our allocator installed vs CuPy's default pool."""
    cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
    t_cupy = _bench_cupy_empty(n_rounds)
    cupy.get_default_memory_pool().free_all_blocks()
    a = bluallocator.install(CachingAllocator(CudaBackend()))
    try:
        t_ours = _bench_cupy_empty(n_rounds)
    finally:
        bluallocator.uninstall()
        gc.collect()
        a.empty_cache()
    return {"us_per_array_ours": t_ours * 1e6, "us_per_array_cupy_pool": t_cupy * 1e6,
            "ratio_ours_over_cupy": t_ours / t_cupy}


def replay_cupy(ev, mode: str) -> dict:
    """Replay a trace with real cupy arrays; mode: 'cupy', 'ours', 'ours+profile'."""
    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()
    peak = {"reserved": 0, "steady": 0, "in_steady": False}
    a = None
    if mode == "cupy":
        pool = cupy.cuda.MemoryPool()
        cupy.cuda.set_allocator(pool.malloc)

        def reserved() -> int:
            return int(pool.total_bytes())
    else:
        a = bluallocator.install(CachingAllocator(CudaBackend()))

        def reserved() -> int:
            return a._reserved_bytes

    def malloc(n: int):
        arr = cupy.empty(n, dtype=cupy.uint8)
        r = reserved()
        if r > peak["reserved"]:
            peak["reserved"] = r
        if peak["in_steady"] and r > peak["steady"]:
            peak["steady"] = r
        return arr

    def on_step(k: int) -> None:
        if a is not None and mode == "ours+profile":
            if k == 0:
                a.begin_profile()
            elif k == 1:
                a.flush_after_step0()
        if k == 1:
            peak["in_steady"] = True
            peak["steady"] = reserved()
            peak["after_step0"] = reserved()

    t = time.perf_counter()
    try:
        replay(ev, malloc, lambda arr: None, on_step)
        cupy.cuda.Device().synchronize()
    finally:
        dt = time.perf_counter() - t
        gc.collect()
        res = {"mode": mode, "peak_reserved_MiB": peak["reserved"] / MiB,
               "steady_peak_reserved_MiB": peak["steady"] / MiB,
               "reserved_after_step0_MiB": peak.get("after_step0", 0) / MiB, "seconds": dt}
        if a is not None:
            st = a.memory_stats()
            res.update(granularity=[st["granularity_small"], st["granularity_large"]],
                       steady_peak_allocated_MiB=st["peak_allocated_bytes"] / MiB,
                       device_mallocs=st["num_device_mallocs"])
            bluallocator.uninstall()
            a.empty_cache()
        else:
            pool.free_all_blocks()
            cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
    return res


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "bench_alloc_gpu_out"
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    result: dict = {"gpu": name.decode() if isinstance(name, bytes) else str(name),
                    "cupy": cupy.__version__, "numpy": np.__version__,
                    "bluallocator": bluallocator.__version__}
    for name, fn in (("raw_throughput", bench_raw), ("cupy_array_throughput", bench_cupy_arrays)):
        try:
            result[name] = fn()
        except Exception:  # noqa: BLE001 - record and continue with the other checks
            result[name] = {"error": traceback.format_exc()[-2000:]}
    traces = {"fixed_T1024": (1024,), "bucketed_T": (1024, 1000, 968, 1016, 936, 992, 1008, 960)}
    result["trace"] = {}
    for tname, seqs in traces.items():
        ev = transformer_trace(batch=4, seq_lens=seqs, steps=6)
        rows = []
        for mode in ("cupy", "ours", "ours+profile"):
            try:
                rows.append(replay_cupy(ev, mode))
            except Exception:  # noqa: BLE001
                rows.append({"mode": mode, "error": traceback.format_exc()[-2000:]})
        result["trace"][tname] = rows
    result["seconds_total"] = time.perf_counter() - t0
    with open(os.path.join(out, "bench_alloc_gpu.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"bluallocator benchmark on {result['gpu']} (cupy {result['cupy']}), "
          f"{result['seconds_total']:.1f} s")
    for k in ("raw_throughput", "cupy_array_throughput"):
        print(k, json.dumps({a: (round(b, 3) if isinstance(b, float) else b) for a, b in result[k].items()}))
    for tname, rows in result["trace"].items():
        for r in rows:
            row = {a: (round(b, 1) if isinstance(b, float) else b) for a, b in r.items()}
            print("trace", tname, json.dumps(row))


if __name__ == "__main__":
    main()
