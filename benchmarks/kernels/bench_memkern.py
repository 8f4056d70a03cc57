"""blutensor's memory-bound CUDA kernels (LayerNorm, GELU, fused cross-entropy, gradient norm) on GPT-2 124M's
training shapes: time, bandwidth as a fraction of a device copy, and PyTorch's time for the same work.

    python3 benchmarks/kernels/bench_memkern.py [--only layer_norm,gelu,cross_entropy,grad_norm] [--out OUT.json]

Per op: ``ms``, the op as called from Python (allocation and host launch cost included); ``kernel_ms``, the same
call replayed from a CUDA graph of 10 back-to-back calls (host launch gaps out; the pool's blocks are warmed on the
capture stream first, so the capture allocates nothing new), falling back to eager batches where this CuPy cannot
capture (listed in ``graph_errors``); ``bytes``, what must cross HBM (inputs read once, outputs written once, fp32
mean/rstd, targets); ``frac_copy_bw``, bytes / kernel_ms against a 2 GiB device copy measured in the same run, and
``frac_same_size_copy`` against a copy of the same byte count; PyTorch timed in a CUDA graph where it captures
(``torch_graph_ms``), else eagerly (``torch_ms``). The correctness of every launch path is the cuda-marked
packages/blutensor/tests/test_cuda_kernels.py. The JSON (default ``benchmarks/results/blutensor_memkern_<gpu>.json``)
is rewritten after every family.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("layer_norm", "gelu", "cross_entropy", "grad_norm")
RES: dict = {"bench": [], "errors": [], "graph_errors": []}


def _cp():
    import cupy

    return cupy


def time_eager(fn, iters: int = 20) -> float:
    """Median ms of fn() as called from Python (batches of 5 back-to-back calls between CUDA events)."""
    cp = _cp()
    fn()
    cp.cuda.get_current_stream().synchronize()
    ts = []
    for _ in range(max(3, iters // 5)):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        for _ in range(5):
            fn()
        b.record()
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b) / 5)
    return float(np.median(ts))


def time_graph(fn, reps: int = 10, trials: int = 5) -> float:
    """Median device ms per call of fn() replayed from a CUDA graph of ``reps`` calls; eager if capture fails."""
    cp = _cp()
    try:
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            for _ in range(2):  # warm-up on this stream: compiles, and caches the pool blocks the capture reuses
                fn()
            s.synchronize()
            s.begin_capture()
            for _ in range(reps):
                fn()
            graph = s.end_capture()
            graph.launch(s)
            ts = []
            for _ in range(trials):
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record(s)
                graph.launch(s)
                b.record(s)
                b.synchronize()
                ts.append(cp.cuda.get_elapsed_time(a, b) / reps)
        return float(np.median(ts))
    except Exception as e:  # noqa: BLE001 - recorded; the eager time stands in
        RES["graph_errors"].append(f"{type(e).__name__}: {e}"[:300])
        cp.cuda.Device().synchronize()
        return time_eager(fn)


def time_torch(fn, reps: int = 10, graph: bool = True) -> tuple[float, bool]:
    """(median ms, graphed) of a torch callable: a CUDA graph if it captures, else eager batches."""
    import torch

    def ev():
        return torch.cuda.Event(enable_timing=True)

    try:
        if not graph:
            raise RuntimeError("eager timing asked for")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        g.replay()
        ts = []
        for _ in range(5):
            a, b = ev(), ev()
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / reps)
        return float(np.median(ts)), True
    except Exception:  # noqa: BLE001 - eager timing instead
        torch.cuda.synchronize()
        fn()
        ts = []
        for _ in range(4):
            a, b = ev(), ev()
            a.record()
            for _ in range(5):
                fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 5)
        return float(np.median(ts)), False


_SAME_COPY: dict[int, float] = {}


def same_size_copy_ms(nbytes: int) -> float:
    """A device copy moving ``nbytes`` (half read, half written), eager: a memcpy captured in a CUDA graph runs
    on the copy engines, not the SMs."""
    n = max(1, nbytes // 2 // 4)
    if n not in _SAME_COPY:
        cp = _cp()
        a = cp.ones(n, cp.float32)
        b = cp.empty_like(a)
        _SAME_COPY[n] = time_eager(lambda: cp.copyto(b, a))
    return _SAME_COPY[n]


def copy_bw() -> float:
    """GB/s of a 2 GiB device copy (bytes read + written), eager."""
    cp = _cp()
    a = cp.ones(2 * 1024**3 // 4, cp.float32)
    b = cp.empty_like(a)
    ms = time_eager(lambda: cp.copyto(b, a), iters=10)
    return 2 * a.nbytes / ms / 1e6


def bench(name, shape, op_fn, nbytes, torch_fn=None, torch_note="", torch_graph=True) -> None:
    row: dict = dict(name=name, shape=shape, bytes=nbytes)
    try:
        row["ms"] = time_eager(op_fn)
        row["kernel_ms"] = time_graph(op_fn)
        row["GBps"] = nbytes / row["kernel_ms"] / 1e6
        row["frac_copy_bw"] = row["GBps"] / RES["copy_bw_GBps"]
        row["same_size_copy_ms"] = same_size_copy_ms(nbytes)
        row["frac_same_size_copy"] = row["same_size_copy_ms"] / row["kernel_ms"]
        if torch_fn is not None:
            tms, graphed = time_torch(torch_fn, graph=torch_graph)
            row["torch_graph_ms" if graphed else "torch_ms"] = tms
            row["speedup_vs_torch"] = tms / row["kernel_ms"]
            row["torch_note"] = torch_note
    except Exception as e:  # noqa: BLE001 - one op's failure is recorded; the others still run
        row["error"] = f"{type(e).__name__}: {e}"[:400]
        RES["errors"].append(dict(where=name, error=row["error"], tb=traceback.format_exc()[-2000:]))
    RES["bench"].append(row)
    txt = f"{name:36s} {shape:16s}"
    if "kernel_ms" in row:
        txt += f" op {row['ms']:7.3f} ms  graph {row['kernel_ms']:7.3f} ms  {row['GBps']:6.0f} GB/s"
        txt += f" ({100 * row['frac_copy_bw']:3.0f}% copy)"
        if "speedup_vs_torch" in row:
            txt += f"  torch {row.get('torch_graph_ms', row.get('torch_ms')):7.3f} ms x{row['speedup_vs_torch']:4.2f}"
    print(txt + (f"  ERROR {row['error']}" if "error" in row else ""), flush=True)


def ddev(shape, storage: str):
    """Standard-normal data made on the device, in the storage of ``storage`` ('f32' or bf16 bits)."""
    import blutensor as bt

    cp = _cp()
    a = cp.random.standard_normal(shape, dtype=cp.float32)
    return bt.ext.f32_to_bf16_bits(a, cp) if storage == "bf16" else a


def _tdt(storage: str):
    import torch

    return torch.float32 if storage == "f32" else torch.bfloat16


def bench_layer_norm(storage: str) -> None:
    import blutensor as bt
    import torch

    fwd, bwd = bt.ext.layer_norm_forward, bt.ext.layer_norm_backward
    N, C = 16384, 768
    x, r, g = ddev((N, C), storage), ddev((N, C), storage), ddev((N, C), storage)
    w, b = ddev(C, storage), ddev(C, storage)
    es = x.dtype.itemsize
    _, mean, rstd, s = fwd(x, w, b, 1e-5, residual=r)
    tdt = _tdt(storage)
    tx = torch.randn(N, C, device="cuda", dtype=tdt, requires_grad=True)
    tr = torch.randn(N, C, device="cuda", dtype=tdt)
    tw = torch.randn(C, device="cuda", dtype=tdt, requires_grad=True)
    tb = torch.randn(C, device="cuda", dtype=tdt, requires_grad=True)
    F = torch.nn.functional
    txd, twd, tbd = tx.detach(), tw.detach(), tb.detach()
    ty, tmean, trstd = torch.ops.aten.native_layer_norm(txd, (C,), twd, tbd, 1e-5)
    tg = torch.randn_like(ty)
    nc, sh = N * C * es, f"{N}x{C}"
    bench(f"layer_norm.fwd {storage}", sh, lambda: fwd(x, w, b, 1e-5), 2 * nc + 8 * N,
          lambda: F.layer_norm(tx, (C,), tw, tb))
    bench(f"layer_norm.fwd +resid {storage}", sh, lambda: fwd(x, w, b, 1e-5, residual=r), 4 * nc + 8 * N,
          lambda: F.layer_norm(tx + tr, (C,), tw, tb), "torch: add then layer_norm")
    bench(f"layer_norm.bwd {storage}", sh, lambda: bwd(g, x, w, mean, rstd), 3 * nc + 8 * N,
          lambda: torch.ops.aten.native_layer_norm_backward(tg, txd, (C,), tmean, trstd, twd, tbd, [True] * 3),
          "torch: aten.native_layer_norm_backward")
    bench(f"layer_norm.bwd +grad_sum {storage}", sh, lambda: bwd(g, s, w, mean, rstd, grad_sum=g), 4 * nc + 8 * N)


def bench_gelu(storage: str) -> None:
    import blutensor as bt
    import torch

    fwd, bwd = bt.ext.gelu_forward, bt.ext.gelu_backward
    n = 16 * 1024 * 3072
    x, g = ddev(n, storage), ddev(n, storage)
    es = x.dtype.itemsize
    tx = torch.randn(16, 1024, 3072, device="cuda", dtype=_tdt(storage))
    tg = torch.randn_like(tx)
    F, sh = torch.nn.functional, "16x1024x3072"
    bench(f"gelu.fwd tanh {storage}", sh, lambda: fwd(x, "tanh"), 2 * n * es, lambda: F.gelu(tx, approximate="tanh"))
    bench(f"gelu.bwd tanh {storage}", sh, lambda: bwd(g, x, "tanh"), 3 * n * es,
          lambda: torch.ops.aten.gelu_backward(tg, tx, approximate="tanh"))
    bench(f"gelu.fwd erf {storage}", sh, lambda: fwd(x, "none"), 2 * n * es, lambda: F.gelu(tx))
    bench(f"gelu.bwd erf {storage}", sh, lambda: bwd(g, x, "none"), 3 * n * es,
          lambda: torch.ops.aten.gelu_backward(tg, tx))


def bench_cross_entropy(storage: str) -> None:
    import blutensor as bt
    import torch

    ce = bt.ext.cuda_cross_entropy_forward
    cp = _cp()
    N, C = 16384, 50304
    z = ddev((N, C), storage)
    t = cp.asarray(np.random.default_rng(0).integers(0, 50257, N).astype(np.int64))
    es = z.dtype.itemsize
    tz = torch.randn(N, C, device="cuda", dtype=_tdt(storage), requires_grad=True)
    tt = torch.from_dlpack(t)

    def tstep():
        torch.nn.functional.cross_entropy(tz, tt).backward()
        tz.grad = None

    bench(f"cross_entropy fwd+grad inplace {storage}", f"{N}x{C}",
          lambda: ce(z, t, want_grad=True, inplace_grad=True), 2 * N * C * es + 16 * N, tstep,
          "torch: loss + backward (eager)", torch_graph=False)
    bench(f"cross_entropy loss only {storage}", f"{N}x{C}", lambda: ce(z, t, want_grad=False), N * C * es + 16 * N)


def _gpt2_param_shapes() -> list[tuple[int, ...]]:
    """GPT-2 124M's parameter shapes in model order (blutensor's dev/kernel_reference.py, shared with the tests)."""
    sys.path.insert(0, str(ROOT / "packages" / "blutensor" / "dev"))
    from kernel_reference import gpt2_param_shapes

    return gpt2_param_shapes()


def bench_grad_norm(storage: str) -> None:
    import blutensor as bt
    import torch

    shapes = _gpt2_param_shapes()
    sizes = [math.prod(s) for s in shapes]
    gs = [ddev(n, storage) for n in sizes]
    tg = [torch.randn(s, device="cuda", dtype=_tdt(storage)) for s in shapes]
    bench(f"grad_norm multi-tensor {storage}", "GPT-2 124M", lambda: bt.ext.global_grad_norm(gs),
          gs[0].dtype.itemsize * sum(sizes), lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tg))))


BENCHES = {"layer_norm": bench_layer_norm, "gelu": bench_gelu, "cross_entropy": bench_cross_entropy,
           "grad_norm": bench_grad_norm}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(FAMILIES), help="comma list of kernel families")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    fams = [f for f in args.only.split(",") if f]
    bad = sorted(set(fams) - set(FAMILIES))
    if bad:
        ap.error(f"unknown kernel families {bad}; choose from {', '.join(FAMILIES)}")
    import torch

    cp = _cp()
    props = cp.cuda.runtime.getDeviceProperties(0)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    out = args.out or ROOT / "benchmarks" / "results" / f"blutensor_memkern_{gpu.split()[-1].lower()}.json"
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    RES.update(command="python3 benchmarks/kernels/bench_memkern.py --only " + ",".join(fams), commit=commit,
               device=gpu, cupy=cp.__version__, torch=torch.__version__, copy_bw_GBps=copy_bw())
    cp.get_default_memory_pool().free_all_blocks()
    print(f"device {gpu}, CuPy {cp.__version__}, torch {torch.__version__}; copy {RES['copy_bw_GBps']:.0f} GB/s")
    out.parent.mkdir(parents=True, exist_ok=True)
    for fam in fams:
        for storage in ("bf16", "f32"):
            BENCHES[fam](storage)
            cp.get_default_memory_pool().free_all_blocks()
            torch.cuda.empty_cache()
        out.write_text(json.dumps(RES, indent=1, default=str) + "\n")
    print(f"{len(RES['bench'])} rows, {len(RES['errors'])} errors -> {out}")
    return 1 if RES["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
