"""GPU check of the memory-bound kernels: layer_norm, gelu, cross_entropy, grad_norm.

Run from the repo root on the GPU machine:  python3 packages/blutensor/dev/gpu_check_memkern.py OUT_DIR
Correctness against float64 (the gpu_check_kernels checks plus odd sizes that hit every launch path: register-
resident and generic LayerNorm widths, persistent cross-entropy grids with more rows than blocks, unaligned and
tail GELU sizes, bf16 grad norms), bitwise determinism of the reductions, then benchmarks next to PyTorch.

Timing: "ms" is the blutensor op as called from Python (allocations, host launch cost included, as
gpu_check_kernels measures it); "kernel_ms" replays exactly the kernels that op launched (recorded once) inside a
CUDA graph, so host launch gaps do not count; torch is timed in a CUDA graph too where it can be captured
("torch_graph_ms"), else eagerly. Bandwidth: "bytes" counts what must cross HBM (inputs read once, outputs written
once, fp32 mean/rstd, targets; not the small per-block partials), divided by the graph-timed kernel time and
reported as a fraction of the device-copy bandwidth measured in the same run (2 GiB copy, "frac_copy_bw") and of
a copy moving the same number of bytes ("frac_same_size_copy": launch and tail costs of a pass that short).
Each kernel family runs in its own process (a faulting kernel cannot take the others down); OUT_DIR/memkern.json is
rewritten after every family. Runs in < 90 s.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

import numpy as np  # noqa: E402

T0 = time.time()
FAMILIES = ("cross_entropy", "grad_norm", "layer_norm", "gelu")
BUDGET_S = float(os.environ.get("BLU_BUDGET_S", "58"))


# ------------------------------------------------------------------ timing
def _cp():
    import cupy

    return cupy


def record_launches(mod, fn):
    """Run fn() with ``mod.launch`` wrapped: returns (fn's result, [(kernel, grid, block, args, smem)])."""
    from blutensor.cuda_ops._loader import function

    calls = []
    orig = mod.launch

    def rec(file, name, grid, block, args, shared_mem=0):
        orig(file, name, grid, block, args, shared_mem=shared_mem)
        g = grid if isinstance(grid, tuple) else (grid,)
        b = block if isinstance(block, tuple) else (block,)
        calls.append((function(file, name), g, b, args, shared_mem, name))

    mod.launch = rec
    try:
        out = fn()
    finally:
        mod.launch = orig
    return out, calls


def replay(calls) -> None:
    for f, g, b, a, sm, _ in calls:
        f(g, b, a, shared_mem=sm)


GRAPH_ERRORS: list[str] = []


def time_graph(run, reps: int = 10, trials: int = 5) -> float:
    """Median device ms of run() from a CUDA graph holding ``reps`` back-to-back calls (no host gaps); eager
    batches (noted in the JSON's graph_errors) if this CuPy cannot capture."""
    try:
        return _time_graph(run, reps, trials)
    except Exception as e:
        GRAPH_ERRORS.append(f"{type(e).__name__}: {e}"[:300])
        _cp().cuda.Device().synchronize()
        return time_eager(run)


def _time_graph(run, reps: int, trials: int) -> float:
    cp = _cp()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        run()  # warm-up (and lazy module loads) outside the capture
        s.synchronize()
        s.begin_capture()
        for _ in range(reps):
            run()
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


def time_eager(fn, iters: int = 20) -> float:
    """Median ms of fn() as called from Python (batches of back-to-back calls between events)."""
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


def time_torch(fn, reps: int = 10, graph: bool = True) -> tuple[float, bool]:
    """(median ms, graphed) of a torch callable: CUDA graph if it captures, else eager batches."""
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
    except Exception:
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
    """Device copy moving ``nbytes`` (nbytes/2 read + nbytes/2 written), timed eagerly: a memcpy captured in a
    CUDA graph runs on the copy engines (~2.7 TB/s on the H200), not the SMs (~4.2 TB/s)."""
    n = max(1, nbytes // 2 // 4)
    if n not in _SAME_COPY:
        cp = _cp()
        a = cp.ones(n, cp.float32)
        b = cp.empty_like(a)
        _SAME_COPY[n] = time_eager(lambda: cp.copyto(b, a))
        del a, b
    return _SAME_COPY[n]


def copy_bw() -> float:
    """GB/s of a 2 GiB device copy (bytes read + written), eager (see same_size_copy_ms)."""
    cp = _cp()
    a = cp.ones(2 * 1024**3 // 4, cp.float32)
    b = cp.empty_like(a)
    ms = time_eager(lambda: cp.copyto(b, a), iters=10)
    return 2 * a.nbytes / ms / 1e6


# ------------------------------------------------------------------ results
RES: dict = {"checks": [], "bench": [], "errors": []}
COPY_BW = float(os.environ.get("BLU_COPY_BW", "0")) or None


def record(kernel, variant, err, tol, info=""):
    ok = bool(err <= tol)
    RES["checks"].append(dict(kernel=kernel, variant=variant, err=float(err), tol=tol, passed=ok, info=info))
    print(f"{'PASS' if ok else 'FAIL'}  {kernel:24s} {variant:40s} err={err:.3e} tol={tol:.1e} {info}", flush=True)


def bench(name, shape, op_fn, mod, nbytes, torch_fn=None, torch_note="", torch_graph=True):
    """Benchmark one op: eager op time, graph-timed kernel time of its recorded launches, torch."""
    row = dict(name=name, shape=shape, bytes=nbytes)
    try:
        row["ms"] = time_eager(op_fn)
        _, calls = record_launches(mod, op_fn)
        row["kernels"] = [f"{c[5]} grid={c[1][0]} block={c[2][0]} smem={c[4]}" for c in calls]
        row["kernel_ms"] = time_graph(lambda: replay(calls))
        gbs = nbytes / row["kernel_ms"] / 1e6
        row["GBps"] = gbs
        if COPY_BW:
            row["frac_copy_bw"] = gbs / COPY_BW
        row["same_size_copy_ms"] = same_size_copy_ms(nbytes)
        row["frac_same_size_copy"] = row["same_size_copy_ms"] / row["kernel_ms"]
        if torch_fn is not None:
            tms, graphed = time_torch(torch_fn, graph=torch_graph)
            row["torch_graph_ms" if graphed else "torch_ms"] = tms
            row["speedup_vs_torch"] = tms / row["kernel_ms"]
            row["torch_note"] = torch_note
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:400]
        RES["errors"].append(dict(where=name, error=row["error"], tb=traceback.format_exc()[-2000:]))
    RES["bench"].append(row)
    txt = f"{name:36s} {shape:16s}"
    if "kernel_ms" in row:
        txt += f" op {row['ms']:7.3f} ms  kernels {row['kernel_ms']:7.3f} ms  {row['GBps']:6.0f} GB/s"
        if "frac_copy_bw" in row:
            txt += f" ({100 * row['frac_copy_bw']:3.0f}% copy)"
        if "frac_same_size_copy" in row:
            txt += f" ({100 * row['frac_same_size_copy']:3.0f}% same-size copy)"
        if "speedup_vs_torch" in row:
            tms = row.get("torch_graph_ms", row.get("torch_ms"))
            txt += f"  torch {tms:7.3f} ms x{row['speedup_vs_torch']:4.2f}"
    if "error" in row:
        txt += f"  ERROR {row['error']}"
    print(txt, flush=True)


def guarded(fn):
    def run(*a):
        try:
            fn(*a)
        except Exception as e:
            msg = f"{fn.__name__}{a}: {type(e).__name__}: {e}"[:500]
            RES["errors"].append(dict(where=fn.__name__, error=msg, tb=traceback.format_exc()[-3000:]))
            print(f"ERROR {msg}\n{traceback.format_exc()[-1500:]}", flush=True)

    run.__name__ = fn.__name__
    return run


RNG = np.random.default_rng(5150)


def ddev(shape, storage: str):
    """Standard-normal benchmark data made on the device (host RNG of GiB-sized arrays costs seconds)."""
    cp = _cp()
    from blutensor.backend import f32_to_bf16_bits

    a = cp.random.standard_normal(shape, dtype=cp.float32)
    return f32_to_bf16_bits(a, cp) if storage == "bf16" else a


# ------------------------------------------------------------------ layer_norm
@guarded
def check_layer_norm_paths():
    import kernel_reference as ref
    from blutensor.cuda_ops import layer_norm as ln
    from gpu_check_kernels import dev, host

    cp = _cp()
    cases = [(3, 8), (129, 36), (1000, 768), (33, 1000), (517, 768), (65, 1032), (40, 1600), (7, 771), (700, 96)]
    for storage in ("f32", "bf16"):
        for i, (N, C) in enumerate(cases):
            resid = i % 2 == 1
            affine = i % 3 != 2
            x, x64 = dev(RNG.standard_normal((N, C)) * 2 + 0.5, storage)
            w, w64 = dev(RNG.standard_normal(C), storage) if affine else (None, np.ones(C))
            b, b64 = dev(RNG.standard_normal(C), storage) if affine else (None, np.zeros(C))
            r, r64 = dev(RNG.standard_normal((N, C)), storage) if resid else (None, None)
            y, mean, rstd, s = ln.layer_norm_forward(x, w, b, 1e-5, residual=r)
            s64 = x64 + r64 if resid else x64
            if storage == "bf16" and resid:
                s64 = ref.bf16_round(s64)
            ey, emu, ers, _ = ref.layer_norm(s64, w64, b64, 1e-5)
            nv = ln.reg_nv(C, x.dtype.itemsize, ln._FWD_NV) if C % (16 // x.dtype.itemsize) == 0 else None
            tag = f"{storage} {N}x{C}{' +resid' if resid else ''}{'' if affine else ' no-affine'} r{nv}"
            record("layer_norm.fwd", tag, ref.rel_err(host(y), ey), ref.TOL["layer_norm.fwd"][storage])
            record("layer_norm.fwd.stats", tag, max(ref.rel_err(host(mean), emu), ref.rel_err(host(rstd), ers)), 2e-6)
            if resid:
                record("layer_norm.fwd.sum", tag, ref.rel_err(host(s), s64), ref.TOL["layer_norm.fwd"][storage])
            g, g64 = dev(RNG.standard_normal((N, C)), storage)
            gs, gs64 = dev(RNG.standard_normal((N, C)), storage) if resid else (None, None)
            xin = s if resid else x
            dx, dw, db = ln.layer_norm_backward(g, xin, w, mean, rstd, grad_sum=gs)
            edx, edw, edb = ref.layer_norm_backward(g64, s64, w64, 1e-5)
            if resid:
                edx = edx + gs64
            tol = ref.TOL["layer_norm.bwd"][storage]
            record("layer_norm.bwd.dx", tag, ref.rel_err(host(dx), edx), tol)
            if affine:
                record("layer_norm.bwd.dw", tag, ref.rel_err(host(dw), edw), tol)
            record("layer_norm.bwd.db", tag, ref.rel_err(host(db), edb), tol)
            dx2, dw2, db2 = ln.layer_norm_backward(g, xin, w, mean, rstd, grad_sum=gs)
            same = bool((dx2 == dx).all()) and bool((db2 == db).all()) and (dw is None or bool((dw2 == dw).all()))
            record("layer_norm.bwd.determinism", tag, 0.0 if same else 1.0, 0.0)
            acc0 = ln.BWD_SMEM_ACC  # the other dW/db variant: the same fp32 operations in the same order
            ln.BWD_SMEM_ACC = not acc0
            try:
                dx5, dw5, db5 = ln.layer_norm_backward(g, xin, w, mean, rstd, grad_sum=gs)
            finally:
                ln.BWD_SMEM_ACC = acc0
            same = bool((dx5 == dx).all()) and bool((db5 == db).all()) and (dw is None or bool((dw5 == dw).all()))
            record("layer_norm.bwd smem-acc == reg-acc", tag, 0.0 if same else 1.0, 0.0)
            if i % 4 == 0:  # parameter grads only (need_dx False) and dx only
                _, dw3, db3 = ln.layer_norm_backward(g, xin, w, mean, rstd, grad_sum=gs, need_dx=False)
                record("layer_norm.bwd.db(no dx)", tag, float(not bool((db3 == db).all())), 0.0)
                dx4, _, _ = ln.layer_norm_backward(g, xin, w, mean, rstd, grad_sum=gs, need_dw=False, need_db=False)
                record("layer_norm.bwd.dx(no dw)", tag, float(not bool((dx4 == dx).all())), 0.0)
    cp.cuda.Device().synchronize()


@guarded
def bench_layer_norm(storage):
    import torch
    from blutensor.cuda_ops import layer_norm as ln
    from gpu_check_kernels import dev

    cp = _cp()
    N, C = 16384, 768
    x, _ = dev(RNG.standard_normal((N, C)), storage)
    r, _ = dev(RNG.standard_normal((N, C)), storage)
    w, _ = dev(RNG.standard_normal(C), storage)
    b, _ = dev(RNG.standard_normal(C), storage)
    es = x.dtype.itemsize
    y, mean, rstd, s = ln.layer_norm_forward(x, w, b, residual=r)
    g = cp.asarray(x.copy())
    tdt = torch.float32 if storage == "f32" else torch.bfloat16
    tx = torch.randn(N, C, device="cuda", dtype=tdt, requires_grad=True)
    tr = torch.randn(N, C, device="cuda", dtype=tdt)
    tw = torch.randn(C, device="cuda", dtype=tdt, requires_grad=True)
    tb = torch.randn(C, device="cuda", dtype=tdt, requires_grad=True)
    F = torch.nn.functional
    txd, twd, tbd = tx.detach(), tw.detach(), tb.detach()
    ty, tmean, trstd = torch.ops.aten.native_layer_norm(txd, (C,), twd, tbd, 1e-5)
    tg = torch.randn_like(ty)
    nc = N * C * es
    sh = f"{N}x{C}"
    bench(
        f"layer_norm.fwd {storage}",
        sh,
        lambda: ln.layer_norm_forward(x, w, b),
        ln,
        2 * nc + 8 * N,
        lambda: F.layer_norm(tx, (C,), tw, tb),
    )
    bench(
        f"layer_norm.fwd +resid {storage}",
        sh,
        lambda: ln.layer_norm_forward(x, w, b, residual=r),
        ln,
        4 * nc + 8 * N,
        lambda: F.layer_norm(tx + tr, (C,), tw, tb),
        "torch: add then layer_norm",
    )
    bench(
        f"layer_norm.bwd {storage}",
        sh,
        lambda: ln.layer_norm_backward(g, x, w, mean, rstd),
        ln,
        3 * nc + 8 * N,
        lambda: torch.ops.aten.native_layer_norm_backward(tg, txd, (C,), tmean, trstd, twd, tbd, [True] * 3),
        "torch: aten.native_layer_norm_backward",
    )
    bench(
        f"layer_norm.bwd +grad_sum {storage}",
        sh,
        lambda: ln.layer_norm_backward(g, s, w, mean, rstd, grad_sum=g),
        ln,
        4 * nc + 8 * N,
    )
    acc0 = ln.BWD_SMEM_ACC
    ln.BWD_SMEM_ACC = not acc0
    other = "smem-acc" if not acc0 else "reg-acc"
    try:  # the other dW/db variant (default: sums in shared memory, fewer registers, more rows in flight)
        bench(
            f"layer_norm.bwd {storage} {other}",
            sh,
            lambda: ln.layer_norm_backward(g, x, w, mean, rstd),
            ln,
            3 * nc + 8 * N,
        )
        bench(
            f"layer_norm.bwd +grad_sum {storage} {other}",
            sh,
            lambda: ln.layer_norm_backward(g, s, w, mean, rstd, grad_sum=g),
            ln,
            4 * nc + 8 * N,
        )
    finally:
        ln.BWD_SMEM_ACC = acc0


# ------------------------------------------------------------------ gelu
@guarded
def check_gelu_paths():
    import kernel_reference as ref
    from blutensor.cuda_ops import gelu as ge
    from gpu_check_kernels import dev, host

    for storage in ("f32", "bf16"):
        for approx in ("tanh", "none"):
            for n in (7, 1_000_003):
                x, x64 = dev(RNG.standard_normal(n) * 3, storage)
                g, g64 = dev(RNG.standard_normal(n), storage)
                tag = f"{storage} {approx} n={n}"
                record(
                    "gelu.fwd",
                    tag,
                    ref.rel_err(host(ge.gelu_forward(x, approx)), ref.gelu(x64, approx)),
                    ref.TOL["gelu.fwd"][storage],
                )
                record(
                    "gelu.bwd",
                    tag,
                    ref.rel_err(host(ge.gelu_backward(g, x, approx)), ref.gelu_backward(g64, x64, approx)),
                    ref.TOL["gelu.bwd"][storage],
                )
                if n == 1_000_003:  # the launch variants compute the same values bit for bit
                    y0, d0 = ge.gelu_forward(x, approx), ge.gelu_backward(g, x, approx)
                    for knob, val in (("PLAIN", True), ("ONE_WAVE", False)):
                        old = getattr(ge, knob)
                        setattr(ge, knob, val)
                        try:
                            y1, d1 = ge.gelu_forward(x, approx), ge.gelu_backward(g, x, approx)
                        finally:
                            setattr(ge, knob, old)
                        same = bool((y1 == y0).all()) and bool((d1 == d0).all())
                        record("gelu variant == default", f"{tag} {knob}={val}", 0.0 if same else 1.0, 0.0)
        x, x64 = dev(RNG.standard_normal(100_003) * 4, storage)
        g, g64 = dev(RNG.standard_normal(100_003), storage)
        record(
            "gelu.bwd",
            f"{storage} unaligned views",
            ref.rel_err(host(ge.gelu_backward(g[1:], x[1:], "tanh")), ref.gelu_backward(g64[1:], x64[1:], "tanh")),
            ref.TOL["gelu.bwd"][storage],
        )
    # fp32 tanh-form accuracy on a dense sweep (the fast exp formulation): relative to max |value|
    x64 = np.linspace(-12, 12, 2_000_001)
    x, x64 = dev(x64, "f32")
    record(
        "gelu.fwd",
        "f32 tanh sweep [-12,12]",
        ref.rel_err(host(ge.gelu_forward(x, "tanh")), ref.gelu(x64, "tanh")),
        ref.TOL["gelu.fwd"]["f32"],
    )
    y = host(ge.gelu_forward(x, "tanh"))
    u64 = 0.7978845608028654 * (x64 + 0.044715 * x64**3)
    ey = x64 / (1.0 + np.exp(-2.0 * u64))
    ok = (x64 >= -2.0) & (ey != 0)
    record(
        "gelu.fwd pointwise rel", "f32 tanh x in [-2,12]", float(np.max(np.abs(y[ok] - ey[ok]) / np.abs(ey[ok]))), 1e-6
    )
    one, _ = dev(np.ones_like(x64), "f32")
    record(
        "gelu.bwd",
        "f32 tanh sweep [-12,12]",
        ref.rel_err(host(ge.gelu_backward(one, x, "tanh")), ref.gelu_backward(np.ones_like(x64), x64, "tanh")),
        ref.TOL["gelu.bwd"]["f32"],
    )


@guarded
def bench_gelu(storage):
    import torch
    from blutensor.cuda_ops import gelu as ge

    n = 16 * 1024 * 3072
    x = ddev(n, storage)
    g = x.copy()
    es = x.dtype.itemsize
    tdt = torch.float32 if storage == "f32" else torch.bfloat16
    tx = torch.randn(16, 1024, 3072, device="cuda", dtype=tdt)
    tg = torch.randn_like(tx)
    F = torch.nn.functional
    sh = "16x1024x3072"
    bench(
        f"gelu.fwd tanh {storage}",
        sh,
        lambda: ge.gelu_forward(x, "tanh"),
        ge,
        2 * n * es,
        lambda: F.gelu(tx, approximate="tanh"),
    )
    bench(
        f"gelu.bwd tanh {storage}",
        sh,
        lambda: ge.gelu_backward(g, x, "tanh"),
        ge,
        3 * n * es,
        lambda: torch.ops.aten.gelu_backward(tg, tx, approximate="tanh"),
    )
    bench(f"gelu.fwd erf {storage}", sh, lambda: ge.gelu_forward(x, "none"), ge, 2 * n * es, lambda: F.gelu(tx))
    bench(
        f"gelu.bwd erf {storage}",
        sh,
        lambda: ge.gelu_backward(g, x, "none"),
        ge,
        3 * n * es,
        lambda: torch.ops.aten.gelu_backward(tg, tx),
    )
    for plain, wave in ((True, True), (False, False), (True, False)):  # launch variants
        ge.PLAIN, ge.ONE_WAVE = plain, wave
        tag = f"{'plain' if plain else 'cs'} {'wave' if wave else 'many-waves'}"
        try:
            bench(f"gelu.fwd tanh {storage} {tag}", sh, lambda: ge.gelu_forward(x, "tanh"), ge, 2 * n * es)
            bench(f"gelu.bwd tanh {storage} {tag}", sh, lambda: ge.gelu_backward(g, x, "tanh"), ge, 3 * n * es)
        finally:
            ge.PLAIN, ge.ONE_WAVE = False, True


# ------------------------------------------------------------------ cross_entropy
@guarded
def check_cross_entropy_paths():
    import kernel_reference as ref
    from blutensor.cuda_ops import cross_entropy as ce
    from blutensor.cuda_ops.occupancy import full_grid
    from gpu_check_kernels import dev, host

    cp = _cp()
    for storage in ("f32", "bf16"):
        for N, C, ls, red in (
            (1, 8, 0.0, "mean"),
            (300, 50304, 0.0, "mean"),
            (300, 4096, 0.1, "sum"),
            (1200, 1000, 0.0, "none"),
            (77, 50264, 0.0, "mean"),
        ):
            z, z64 = dev(RNG.standard_normal((N, C)) * 3, storage)
            t_h = RNG.integers(0, C, N)
            t_h[::7] = -100
            t_h[-1] = C - 1
            t = cp.asarray(t_h.astype(np.int64))
            eloss, egrad, else_ = ref.cross_entropy(z64, t_h, -100, red, ls)
            name = f"blu_cross_entropy_forward_smem_{storage}"
            blk = 512 if storage == "bf16" else 1024
            grid = full_grid("cross_entropy.cu", name, blk, N, C * z.dtype.itemsize)
            tag = f"{storage} {N}x{C} ls={ls} {red} grid={grid}"
            for inplace in (False, True):
                zz = z.copy() if inplace else z
                loss, grad, lse = ce.cross_entropy_forward(zz, t, -100, red, ls, want_grad=True, inplace_grad=inplace)
                tg = tag + (" inplace" if inplace else "")
                record(
                    "cross_entropy.loss",
                    tg,
                    ref.rel_err(host(loss), np.asarray(eloss)),
                    ref.TOL["cross_entropy.loss"][storage],
                )
                record("cross_entropy.lse", tg, ref.rel_err(host(lse), else_), 1e-5)
                record("cross_entropy.grad", tg, ref.rel_err(host(grad), egrad), ref.TOL["cross_entropy.grad"][storage])
                if inplace:
                    record("cross_entropy.inplace", tg, float(grad.data.ptr != zz.data.ptr), 0.0)
                else:
                    _, grad2, _ = ce.cross_entropy_forward(z, t, -100, red, ls, want_grad=True)
                    record("cross_entropy.determinism", tg, float(not bool((grad2 == grad).all())), 0.0)


@guarded
def bench_cross_entropy(storage):
    import torch
    from blutensor.cuda_ops import cross_entropy as ce

    cp = _cp()
    N, C = 16384, 50304
    z = ddev((N, C), storage)
    t = cp.asarray(RNG.integers(0, 50257, N).astype(np.int64))
    es = z.dtype.itemsize
    tdt = torch.float32 if storage == "f32" else torch.bfloat16
    tz = torch.randn(N, C, device="cuda", dtype=tdt, requires_grad=True)
    tt = torch.from_dlpack(t)

    def tstep():
        loss = torch.nn.functional.cross_entropy(tz, tt)
        loss.backward()
        tz.grad = None

    nbytes = 2 * N * C * es + 16 * N
    bench(
        f"cross_entropy fwd+grad inplace {storage}",
        f"{N}x{C}",
        lambda: ce.cross_entropy_forward(z, t, want_grad=True, inplace_grad=True),
        ce,
        nbytes,
        tstep,
        "torch: loss + backward (eager)",
        torch_graph=False,
    )
    bench(
        f"cross_entropy loss only {storage}",
        f"{N}x{C}",
        lambda: ce.cross_entropy_forward(z, t, want_grad=False),
        ce,
        N * C * es + 16 * N,
    )


# ------------------------------------------------------------------ grad_norm
import kernel_reference  # noqa: E402 - dev/ is on sys.path (top of the file)

GPT2 = kernel_reference.gpt2_param_shapes()  # GPT-2 124M parameter shapes, model order


@guarded
def check_grad_norm_paths():
    import kernel_reference as ref
    from blutensor.cuda_ops.norm import clip_grads_, global_grad_norm
    from gpu_check_kernels import dev, host

    for storage in ("f32", "bf16"):
        for sizes in ([1], [7, 8, 16384, 16385, 16391], [3 * 16384 + 5, 1, 100_000, 2_359_296]):
            gs, g64 = zip(*(dev(RNG.standard_normal(n), storage) for n in sizes))
            n1 = global_grad_norm(list(gs))
            e = ref.grad_norm(g64)
            tag = f"{storage} {len(sizes)} tensors {sum(sizes)} el"
            record("grad_norm", tag, abs(float(n1) - e) / e, ref.TOL["grad_norm"][storage])
            n2 = global_grad_norm(list(gs))
            record("grad_norm.determinism", tag, float(float(n1) != float(n2)), 0.0)
            coef = 0.5 * e / (float(n1) + 1e-6)
            clip_grads_(list(gs), 0.5 * e, n1)
            err = max(ref.rel_err(host(a), a64 * coef) for a, a64 in zip(gs, g64))
            record("grad_norm.clip", tag + " x0.5", err, 1e-6 if storage == "f32" else 4e-3)
        # a view at an odd element offset (unaligned: scalar path)
        big, big64 = dev(RNG.standard_normal(40_001), storage)
        record(
            "grad_norm",
            f"{storage} unaligned view",
            abs(float(global_grad_norm([big[1:]])) - ref.grad_norm([big64[1:]])) / ref.grad_norm([big64[1:]]),
            ref.TOL["grad_norm"][storage],
        )


@guarded
def bench_grad_norm(storage):
    import torch
    from blutensor.cuda_ops import norm

    sizes = [math.prod(s) for s in GPT2]
    gs = [ddev(n, storage) for n in sizes]
    es = gs[0].dtype.itemsize
    tdt = torch.float32 if storage == "f32" else torch.bfloat16
    tg = [torch.randn(s, device="cuda", dtype=tdt) for s in GPT2]
    bench(
        f"grad_norm multi-tensor {storage}",
        "GPT-2 124M",
        lambda: norm.global_grad_norm(gs),
        norm,
        es * sum(sizes),
        lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tg))),
    )


# ------------------------------------------------------------------ driver
def run_family(name: str) -> None:
    cp = _cp()
    fam = {
        "layer_norm": (check_layer_norm_paths, bench_layer_norm),
        "gelu": (check_gelu_paths, bench_gelu),
        "cross_entropy": (check_cross_entropy_paths, bench_cross_entropy),
        "grad_norm": (check_grad_norm_paths, bench_grad_norm),
    }[name]
    t = time.time()
    fam[0]()
    if not os.environ.get("BLU_CHECK_ONLY"):
        for s in ("bf16", "f32"):
            fam[1](s)
    cp.cuda.Device().synchronize()
    print(f"  [{name}: {time.time() - t:.1f} s]", flush=True)


def main() -> int:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "memkern.json"
    if len(sys.argv) > 3 and sys.argv[2] == "--family":  # child process
        run_family(sys.argv[3])
        RES["graph_errors"] = GRAPH_ERRORS
        from blutensor.cuda_ops import occupancy

        RES["occupancy_errors"] = [f"{k}: {v}" for k, v in occupancy.errors.items()]
        (out_dir / f"part_{sys.argv[3]}.json").write_text(json.dumps(RES, default=str))
        return 0
    cp = _cp()
    props = cp.cuda.runtime.getDeviceProperties(0)
    RES["device"] = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    RES["cupy"] = cp.__version__
    try:
        import torch

        RES["torch"] = torch.__version__
    except Exception as e:
        RES["torch"] = f"unavailable: {e}"
    try:
        RES["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
        ).stdout.strip()
    except Exception:
        pass
    RES["copy_bw_GBps"] = copy_bw()
    RES["graph_errors"] = list(GRAPH_ERRORS)
    cp.get_default_memory_pool().free_all_blocks()
    print(
        f"device {RES['device']}, CuPy {cp.__version__}, torch {RES['torch']}; "
        f"copy bandwidth {RES['copy_bw_GBps']:.0f} GB/s (2 GiB, eager)",
        flush=True,
    )
    out.write_text(json.dumps(RES, indent=1, default=str))
    fams = [f for f in FAMILIES if not os.environ.get("BLU_ONLY") or f in os.environ["BLU_ONLY"].split(",")]
    for name in fams:
        left = T0 + BUDGET_S - time.time()
        if left < 5:
            RES["errors"].append(dict(where=name, error=f"{name}: skipped, time limit reached", tb=""))
            print(f"SKIP {name}: time limit reached", flush=True)
            continue
        env = dict(os.environ, BLU_COPY_BW=str(RES["copy_bw_GBps"]))
        cmd = [sys.executable, str(Path(__file__).resolve()), str(out_dir), "--family", name]
        try:
            rc = subprocess.run(cmd, env=env, timeout=max(10.0, left)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        part = out_dir / f"part_{name}.json"
        if part.exists():
            d = json.loads(part.read_text())
            for key in ("checks", "bench", "errors", "graph_errors", "occupancy_errors"):
                RES.setdefault(key, [])
                RES[key] += d.get(key, [])
            part.unlink()
        if rc != 0:
            RES["errors"].append(dict(where=name, error=f"{name}: child process ended with {rc}", tb=""))
            print(f"ERROR {name}: child process ended with {rc}", flush=True)
        RES["wall_s"] = time.time() - T0
        out.write_text(json.dumps(RES, indent=1, default=str))
    fails = [c for c in RES["checks"] if not c["passed"]]
    print(
        f"== summary: {len(RES['checks']) - len(fails)}/{len(RES['checks'])} checks passed, "
        f"{len(RES['errors'])} errors ({time.time() - T0:.0f} s)",
        flush=True,
    )
    for c in fails:
        print(f"  FAILED {c['kernel']} {c['variant']} err={c['err']:.3e} tol={c['tol']:.1e} {c['info']}")
    for e in RES["errors"]:
        print(f"  ERROR {e['error']}")
    for e in RES.get("occupancy_errors", []) + RES.get("graph_errors", []):
        print(f"  NOTE {e}")
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
