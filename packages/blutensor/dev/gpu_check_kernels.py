"""GPU correctness checks and GPT-2 training-shape benchmarks of blutensor's CUDA kernels.

Run from the repo root on the GPU machine:  python3 packages/blutensor/dev/gpu_check_kernels.py OUT_DIR
Prints one PASS/FAIL line per kernel/variant (max error relative to the largest reference value, against
the tolerance in kernel_reference.TOL), then the benchmark table (ms vs PyTorch, GB/s as a fraction of
the measured device-copy bandwidth) and writes OUT_DIR/kernels_check.json. Each check and each benchmark
runs under try/except: one failing kernel does not stop the others. Runs in well under 4 minutes.
Options (env): BLU_CHECK_ONLY=1 skips benchmarks; BLU_BENCH_ONLY=1 skips checks.
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

import kernel_reference as ref  # noqa: E402
import numpy as np  # noqa: E402

RESULTS: dict = {"checks": [], "bench": [], "errors": []}
T0 = time.time()


def cp_mod():
    import cupy

    return cupy


# ------------------------------------------------------------------ helpers
def dev(a64, storage: str):
    """(device array, float64 values it holds) for storage 'f32' or 'bf16'."""
    cp = cp_mod()
    if storage == "bf16":
        bits = ref.f32_to_bf16_bits(np.asarray(a64, np.float32))
        return cp.asarray(bits), ref.bf16_bits_to_f64(bits)
    h = np.asarray(a64, np.float32)
    return cp.asarray(h), h.astype(np.float64)


def host(a):
    cp = cp_mod()
    h = cp.asnumpy(a)
    if h.dtype == np.uint16:
        return ref.bf16_bits_to_f64(h)
    return h.astype(np.float64)


def record(kernel: str, variant: str, err: float, tol: float, extra: str = "") -> None:
    ok = err <= tol
    RESULTS["checks"].append(dict(kernel=kernel, variant=variant, err=err, tol=tol, passed=ok, info=extra))
    print(f"{'PASS' if ok else 'FAIL'}  {kernel:22s} {variant:34s} err={err:.3e} tol={tol:.1e} {extra}", flush=True)


def check(kernel: str, variant: str, out, expect, tol_key: str, storage: str, extra: str = "") -> None:
    record(
        kernel,
        variant,
        ref.rel_err(host(out) if not isinstance(out, np.ndarray) else out, expect),
        ref.TOL[tol_key][storage],
        extra,
    )


def guarded(fn):
    def run():
        try:
            fn()
        except Exception as e:
            msg = f"{fn.__name__}: {type(e).__name__}: {e}"
            RESULTS["errors"].append(dict(where=fn.__name__, error=msg, tb=traceback.format_exc()[-3000:]))
            print(f"ERROR {msg}\n{traceback.format_exc()[-1500:]}", flush=True)

    run.__name__ = fn.__name__
    return run


RNG = np.random.default_rng(20261129)


# ------------------------------------------------------------------ checks
@guarded
def check_layer_norm():
    from blutensor.cuda_ops.layer_norm import layer_norm_backward, layer_norm_forward

    for storage in ("f32", "bf16"):
        for N, C, resid in ((7, 771, False), (33, 768, True), (130, 1600, False), (5, 37, True)):
            x, x64 = dev(RNG.standard_normal((N, C)) * 2 + 0.5, storage)
            w, w64 = dev(RNG.standard_normal(C), storage)
            b, b64 = dev(RNG.standard_normal(C), storage)
            r, r64 = dev(RNG.standard_normal((N, C)), storage) if resid else (None, None)
            y, mean, rstd, s = layer_norm_forward(x, w, b, 1e-5, residual=r)
            s64 = x64 + r64 if resid else x64
            if storage == "bf16" and resid:
                s64 = ref.bf16_round(s64)  # the kernel normalises the bf16-rounded residual sum
            ey, emu, ers, _ = ref.layer_norm(s64, w64, b64, 1e-5)
            tag = f"{storage} {N}x{C}{' +resid' if resid else ''}"
            check("layer_norm.fwd", tag, y, ey, "layer_norm.fwd", storage)
            record("layer_norm.fwd.stats", tag, max(ref.rel_err(host(mean), emu), ref.rel_err(host(rstd), ers)), 2e-6)
            if resid:
                check("layer_norm.fwd.sum", tag, s, s64, "layer_norm.fwd", storage)
            g, g64 = dev(RNG.standard_normal((N, C)), storage)
            gs, gs64 = dev(RNG.standard_normal((N, C)), storage) if resid else (None, None)
            xin = s if resid else x
            dx, dw, db = layer_norm_backward(g, xin, w, mean, rstd, grad_sum=gs)
            edx, edw, edb = ref.layer_norm_backward(g64, s64, w64, 1e-5)
            if resid:
                edx = edx + gs64
            check("layer_norm.bwd.dx", tag, dx, edx, "layer_norm.bwd", storage)
            check("layer_norm.bwd.dw", tag, dw, edw, "layer_norm.bwd", storage)
            check("layer_norm.bwd.db", tag, db, edb, "layer_norm.bwd", storage)
            if storage == "f32" and N == 130:
                _, dw2, db2 = layer_norm_backward(g, xin, w, mean, rstd)
                same = bool((dw2 == dw).all()) and bool((db2 == db).all())
                record("layer_norm.bwd.determinism", tag, 0.0 if same else 1.0, 0.0)


@guarded
def check_gelu():
    from blutensor.cuda_ops.gelu import gelu_backward, gelu_forward

    for storage in ("f32", "bf16"):
        for approx in ("tanh", "none"):
            for n in (300_007, 4096):
                x, x64 = dev(RNG.standard_normal(n) * 3, storage)
                g, g64 = dev(RNG.standard_normal(n), storage)
                tag = f"{storage} {approx} n={n}"
                check("gelu.fwd", tag, gelu_forward(x, approx), ref.gelu(x64, approx), "gelu.fwd", storage)
                check(
                    "gelu.bwd",
                    tag,
                    gelu_backward(g, x, approx),
                    ref.gelu_backward(g64, x64, approx),
                    "gelu.bwd",
                    storage,
                )
        # unaligned view (scalar path)
        x, x64 = dev(RNG.standard_normal(1001), storage)
        xs = x[1:]  # 4- or 2-byte offset: scalar path
        check(
            "gelu.fwd",
            f"{storage} unaligned view",
            gelu_forward(xs, "tanh"),
            ref.gelu(x64[1:], "tanh"),
            "gelu.fwd",
            storage,
        )


@guarded
def check_cross_entropy():
    from blutensor.cuda_ops.cross_entropy import cross_entropy_forward, scale_grad_

    cp = cp_mod()
    for storage in ("f32", "bf16"):
        for N, C, ls, red in (
            (37, 50257, 0.0, "mean"),
            (64, 50304, 0.0, "mean"),
            (19, 1003, 0.1, "sum"),
            (23, 512, 0.0, "none"),
        ):
            z, z64 = dev(RNG.standard_normal((N, C)) * 3, storage)
            t_h = RNG.integers(0, C, N)
            t_h[::5] = -100
            t = cp.asarray(t_h.astype(np.int64))
            eloss, egrad, else_ = ref.cross_entropy(z64, t_h, -100, red, ls)
            tag = f"{storage} {N}x{C} ls={ls} {red}"
            loss, grad, lse = cross_entropy_forward(z, t, -100, red, ls, want_grad=True, inplace_grad=False)
            check("cross_entropy.loss", tag, loss, np.asarray(eloss), "cross_entropy.loss", storage)
            record("cross_entropy.lse", tag, ref.rel_err(host(lse), else_), 1e-5)
            check("cross_entropy.grad", tag, grad, egrad, "cross_entropy.grad", storage)
            if red == "mean":
                gval = 0.25
                g, _ = dev(np.array([gval]), storage)
                scale_grad_(grad, g)
                check("cross_entropy.grad", tag + " x0.25", grad, egrad * gval, "cross_entropy.grad", storage)
                z2, _ = dev(z64, storage)
                _, grad2, _ = cross_entropy_forward(z2, t, -100, red, ls, want_grad=True, inplace_grad=True)
                same = grad2.data.ptr == z2.data.ptr
                check(
                    "cross_entropy.grad",
                    tag + " inplace",
                    grad2,
                    egrad,
                    "cross_entropy.grad",
                    storage,
                    "" if same else "NOT IN PLACE",
                )
            if C % 8 == 0:  # also the two-pass kernel (rows re-read from L2) on a vectorisable width
                import blutensor.cuda_ops.cross_entropy as ce_mod

                ce_mod.USE_SMEM_ROW = False
                try:
                    _, grad2, _ = cross_entropy_forward(z, t, -100, red, ls, want_grad=True, inplace_grad=False)
                finally:
                    ce_mod.USE_SMEM_ROW = True
                check("cross_entropy.grad", tag + " two-pass", grad2, egrad, "cross_entropy.grad", storage)
            if red == "none":
                gr, gr64 = dev(RNG.standard_normal(N), storage)
                scale_grad_(grad, gr)
                check(
                    "cross_entropy.grad", tag + " per-row g", grad, egrad * gr64[:, None], "cross_entropy.grad", storage
                )


@guarded
def check_embedding():
    from blutensor.cuda_ops.embedding import embedding_backward, embedding_forward

    cp = cp_mod()
    for storage in ("f32", "bf16"):
        for V, C, N in ((1001, 771, 4097), (8192, 768, 2048), (17, 64, 300)):
            w, w64 = dev(RNG.standard_normal((V, C)), storage)
            idx_h = RNG.integers(0, V, N)
            idx_h[: N // 4] = idx_h[0]  # a long run of one token
            idx = cp.asarray(idx_h.astype(np.int64))
            tag = f"{storage} V={V} C={C} N={N}"
            check("embedding.fwd", tag, embedding_forward(idx, w), w64[idx_h], "embedding.fwd", storage)
            g, g64 = dev(RNG.standard_normal((N, C)), storage)
            dw = embedding_backward(idx, g, V)
            check("embedding.bwd", tag, dw, ref.embedding_backward(idx_h, g64, V), "embedding.bwd", storage)
            dw2 = embedding_backward(idx, g, V)
            record("embedding.bwd.determinism", tag, 0.0 if bool((dw2 == dw).all()) else 1.0, 0.0)


@guarded
def check_adamw():
    from blutensor.cuda_ops.adamw import multi_tensor_adamw

    cp = cp_mod()
    sizes = [768, 1, 300_001, 2304 * 768, 65536, 65537, 3]
    for storage in ("f32", "bf16"):
        for dev_hyper in (False, True):
            ps, p64 = zip(*(dev(RNG.standard_normal(n), storage) for n in sizes))
            ps, p64 = list(ps), list(p64)
            p_init = [a.copy() for a in p64]
            ms = [cp.zeros(n, cp.float32) for n in sizes]
            vs = [cp.zeros(n, cp.float32) for n in sizes]
            m64 = [np.zeros(n) for n in sizes]
            v64 = [np.zeros(n) for n in sizes]
            lr, b1, b2, eps, wd = (1e-2 if storage == "f32" else 1e-1), 0.9, 0.95, 1e-8, 0.1
            for step in (1, 2, 3):
                gs, g64 = zip(*(dev(RNG.standard_normal(n) * 0.1, storage) for n in sizes))
                if dev_hyper:
                    multi_tensor_adamw(
                        ps,
                        list(gs),
                        ms,
                        vs,
                        cp.asarray([step], cp.float32),
                        cp.asarray([lr], cp.float32),
                        b1,
                        b2,
                        eps,
                        wd,
                    )
                else:
                    multi_tensor_adamw(ps, list(gs), ms, vs, step, lr, b1, b2, eps, wd)
                for i in range(len(sizes)):
                    p64[i], m64[i], v64[i] = ref.adamw(p64[i], g64[i], m64[i], v64[i], step, lr, b1, b2, eps, wd)
                    if storage == "bf16":
                        p64[i] = ref.bf16_round(p64[i])  # the parameter is stored in bf16 after each step
            tag = f"{storage} {len(sizes)} tensors, 3 steps, {'device' if dev_hyper else 'host'} lr/step"
            if storage == "f32":  # compare the updates (params move by ~lr per step)
                err_p = max(ref.rel_err(host(ps[i]) - p_init[i], p64[i] - p_init[i]) for i in range(len(sizes)))
            else:  # bf16 params: error in bf16 ulps of the largest magnitude the element had (start, end,
                # or the 3 steps' movement), so a 1-ulp rounding flip early on stays 1 ulp if the value later
                # crosses zero
                err_p = max(
                    float(
                        np.max(
                            np.abs(host(ps[i]) - p64[i])
                            / (np.maximum(np.maximum(np.abs(p64[i]), np.abs(p_init[i])), 3 * lr) * 2**-7)
                        )
                    )
                    for i in range(len(sizes))
                )
            err_m = max(ref.rel_err(host(ms[i]), m64[i]) for i in range(len(sizes)))
            err_v = max(ref.rel_err(host(vs[i]), v64[i]) for i in range(len(sizes)))
            record("adamw.param", tag, err_p, ref.TOL["adamw"][storage], "" if storage == "f32" else "(ulps)")
            record("adamw.exp_avg", tag, err_m, 1e-5)
            record("adamw.exp_avg_sq", tag, err_v, 1e-5)


@guarded
def check_grad_norm():
    from blutensor.cuda_ops.norm import clip_grads_, global_grad_norm

    sizes = [768, 1, 300_001, 2304 * 768, 65537]
    for storage in ("f32", "bf16"):
        gs, g64 = zip(*(dev(RNG.standard_normal(n), storage) for n in sizes))
        n = global_grad_norm(list(gs))
        e = ref.grad_norm(g64)
        record("grad_norm", f"{storage} {len(sizes)} tensors", abs(float(n) - e) / e, ref.TOL["grad_norm"][storage])
        clip_grads_(list(gs), 1.0, n)
        n2 = float(global_grad_norm(list(gs)))
        record("grad_norm.clip", f"{storage} to 1.0", abs(n2 - 1.0), 1e-4 if storage == "f32" else 1e-2)


def _sdpa_case(variant, B, H, L, S, hd, causal, with_bwd=True):
    from blutensor.cuda_ops.sdpa import flash_attention_backward, flash_attention_forward

    storage = "bf16" if variant == "bf16" else "f32"
    q, q64 = dev(RNG.standard_normal((B * H, L, hd)), storage)
    k, k64 = dev(RNG.standard_normal((B * H, S, hd)), storage)
    v, v64 = dev(RNG.standard_normal((B * H, S, hd)), storage)
    o, lse = flash_attention_forward(q, k, v, causal, None, variant)
    eo, else_ = ref.sdpa(q64, k64, v64, causal)
    tag = f"{variant} {B}x{H} L={L} S={S} hd={hd} causal={int(causal)}"
    check("sdpa.fwd.o", tag, o, eo, "sdpa.fwd", variant)
    record("sdpa.fwd.lse", tag, ref.rel_err(host(lse), else_), ref.TOL["sdpa.fwd"][variant])
    if not with_bwd:
        return
    do, do64 = dev(RNG.standard_normal((B * H, L, hd)), storage)
    dq, dk, dv = flash_attention_backward(q, k, v, o, lse, do, causal, None, variant)
    edq, edk, edv = ref.sdpa_backward(q64, k64, v64, do64, causal)
    for name, a, e in (("dq", dq, edq), ("dk", dk, edk), ("dv", dv, edv)):
        check(f"sdpa.bwd.{name}", tag, a, e, "sdpa.bwd", variant)


def _sdpa_checks(variant):
    hds = (32, 64, 128) if variant == "f32" else (64, 128)
    for hd in hds:
        for causal in (False, True):
            _sdpa_case(variant, 2, 3, 77, 77, hd, causal)
    _sdpa_case(variant, 1, 2, 256, 256, 64, True)
    _sdpa_case(variant, 1, 2, 100, 130, 64, False)
    _sdpa_case(variant, 1, 1, 130, 100, 64, True)


@guarded
def check_sdpa_f32():
    _sdpa_checks("f32")


def _sdpa_mma_checks(variant):
    """Checks of one mma variant; when one fails, re-run two cases on fallback builds of sdpa_mma.cu
    (-DBLU_NO_LDMATRIX: plain shared loads; -DBLU_SYNC_TILES: no cp.async pipeline) to localise the fault."""
    n0 = len(RESULTS["checks"])
    _sdpa_checks(variant)
    if all(c["passed"] for c in RESULTS["checks"][n0:]):
        return
    from blutensor.cuda_ops import _loader

    cp = cp_mod()
    d = cp.cuda.runtime.getDevice()
    src = (_loader.KERNEL_DIR / "sdpa_mma.cu").read_text()
    cc = cp.cuda.Device(d).compute_capability
    saved = _loader._modules.get(("sdpa_mma.cu", d))
    try:
        for defines in (("-DBLU_NO_LDMATRIX",), ("-DBLU_SYNC_TILES",), ("-DBLU_NO_LDMATRIX", "-DBLU_SYNC_TILES")):
            print(f"  {variant} attention failed: re-running with {' '.join(defines)}", flush=True)
            _loader._modules[("sdpa_mma.cu", d)] = cp.RawModule(code=src, options=_loader.compile_options(cc) + defines)
            _loader._functions.clear()
            _loader._smem_set.clear()
            n1 = len(RESULTS["checks"])
            _sdpa_case(variant, 2, 3, 77, 77, 64, False)
            _sdpa_case(variant, 2, 3, 77, 77, 64, True)
            for c in RESULTS["checks"][n1:]:
                c["variant"] += " [" + " ".join(defines) + "]"
    finally:
        _loader._modules[("sdpa_mma.cu", d)] = saved
        _loader._functions.clear()
        _loader._smem_set.clear()


@guarded
def check_sdpa_bf16():
    _sdpa_mma_checks("bf16")


@guarded
def check_sdpa_tf32():
    _sdpa_mma_checks("tf32")


@guarded
def check_plugins():
    """The op kernel classes through blutensor's dispatch vs the generic CPU ops (fp32)."""
    import blutensor as bt
    import blutensor.nn.functional as F
    from blutensor.ops.dispatch import resolve

    for op in ("layer_norm", "gelu", "cross_entropy", "embedding", "sdpa"):
        for dt in ("float32", "bfloat16"):
            k = resolve(op, "cuda", dt)
            record("plugin.resolve", f"{op} {dt} -> {k.PLUGIN_NAME}", 0.0 if ".cuda." in k.PLUGIN_NAME else 1.0, 0.0)

    def run(device, fn, *arrays, dtype=None):
        ts = [
            bt.tensor(a, device=device, requires_grad=True, dtype=dtype)
            if a.dtype.kind == "f"
            else bt.tensor(a, device=device)
            for a in arrays
        ]
        out = fn(*ts)
        out.backward(bt.ones_like(out)) if out.ndim else out.backward()
        return out.numpy().astype(np.float64), [t.grad.numpy().astype(np.float64) for t in ts if t.requires_grad]

    x = RNG.standard_normal((6, 9, 96)).astype(np.float32)
    w = RNG.standard_normal(96).astype(np.float32)
    b = RNG.standard_normal(96).astype(np.float32)
    cases = {
        "layer_norm": (lambda x, w, b: F.layer_norm(x, (96,), w, b), x, w, b),
        "gelu": (lambda x: F.gelu(x, approximate="tanh"), x),
        "sdpa": (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            *(RNG.standard_normal((2, 3, 33, 64)).astype(np.float32) for _ in range(3)),
        ),
        "cross_entropy": (
            lambda z, t: F.cross_entropy(z, t),
            RNG.standard_normal((45, 301)).astype(np.float32),
            RNG.integers(0, 301, 45).astype(np.int64),
        ),
        "embedding": (
            lambda i, w: F.embedding(i, w),
            RNG.integers(0, 50, (4, 7)).astype(np.int64),
            RNG.standard_normal((50, 40)).astype(np.float32),
        ),
    }
    # bad indices give a clear ShapeError naming the op: lazily (default: recorded on device, raised by
    # index_check.raise_pending(), which the Trainer calls after every loss read and after evaluation) and
    # at the call with BLUTRAIN_VALIDATE_INDICES=sync, like the generic ops
    import os

    from blutensor.cuda_ops import index_check
    from blutensor.errors import ShapeError

    w = bt.tensor(RNG.standard_normal((50, 8)).astype(np.float32), device="cuda")
    index_check.flag_array().fill(0)  # start from a clear flag
    prev = os.environ.get("BLUTRAIN_VALIDATE_INDICES")
    for mode in ("lazy", "sync"):
        os.environ["BLUTRAIN_VALIDATE_INDICES"] = mode
        for name, op, call in (
            ("embedding index 50 of 50", "embedding",
             lambda: F.embedding(bt.tensor(np.array([3, 50]), device="cuda"), w)),
            ("cross_entropy target 8 of 8", "cross_entropy",
             lambda: F.cross_entropy(w[:2], bt.tensor(np.array([1, 8]), device="cuda"))),
        ):
            try:
                call()
                if mode == "lazy":
                    index_check.raise_pending()
                record("plugin.bad_index", f"{name} ({mode})", 1.0, 0.0, "no error raised")
            except ShapeError as e:
                ok = op in str(e) and index_check.pending() is None  # names the op; the flag is cleared
                record("plugin.bad_index", f"{name} ({mode})", 0.0 if ok else 1.0, 0.0, str(e)[:120])
            except Exception as e:
                record("plugin.bad_index", f"{name} ({mode})", 1.0, 0.0, f"{type(e).__name__}: {e}"[:200])
    if prev is None:
        os.environ.pop("BLUTRAIN_VALIDATE_INDICES", None)
    else:
        os.environ["BLUTRAIN_VALIDATE_INDICES"] = prev
    for dtname, dtype, tol in (("f32", None, 1e-4), ("bf16", bt.bfloat16, 4e-2)):
        for name, (fn, *arrays) in cases.items():
            try:
                oc, gc = run("cpu", fn, *arrays, dtype=dtype)
                og, gg = run("cuda", fn, *arrays, dtype=dtype)
                err = max([ref.rel_err(og, oc)] + [ref.rel_err(a, e) for a, e in zip(gg, gc)])
                record("plugin.dispatch", f"{name} {dtname} cuda vs cpu (fwd+bwd)", err, tol)
            except Exception as e:  # one op must not hide the others
                record(
                    "plugin.dispatch",
                    f"{name} {dtname} cuda vs cpu (fwd+bwd)",
                    math.inf,
                    tol,
                    f"{type(e).__name__}: {e}"[:300],
                )


# ------------------------------------------------------------------ benchmarks
def _timed(fn, event, elapsed, iters, warmup) -> float:
    """Median ms per call: events around batches of back-to-back calls (batch sized to ~2 ms of work), so
    the host's launch gaps between calls do not count as kernel time for short kernels."""
    for _ in range(warmup):
        fn()
    a, b = event(), event()
    a.record()
    fn()
    b.record()
    b.synchronize()
    one = max(elapsed(a, b), 1e-3)
    batch = int(min(20, max(1, 2.0 / one)))
    reps = max(3, iters // batch) if batch > 1 else iters
    ts = []
    for _ in range(reps):
        a, b = event(), event()
        a.record()
        for _ in range(batch):
            fn()
        b.record()
        b.synchronize()
        ts.append(elapsed(a, b) / batch)
    return float(np.median(ts))


def timeit(fn, iters=20, warmup=3) -> float:
    """Median device ms of fn() (CuPy events on the current stream)."""
    cp = cp_mod()
    return _timed(fn, cp.cuda.Event, cp.cuda.get_elapsed_time, iters, warmup)


def timeit_torch(fn, iters=20, warmup=3) -> float:
    """Median device ms of fn() (torch events)."""
    import torch

    return _timed(fn, lambda: torch.cuda.Event(enable_timing=True), lambda a, b: a.elapsed_time(b), iters, warmup)


COPY_BW = None


def bench_row(name, shape, ms, torch_ms=None, nbytes=None, flops=None):
    row = dict(name=name, shape=shape, ms=ms, torch_ms=torch_ms)
    txt = f"{name:34s} {shape:28s} {ms:8.3f} ms"
    if torch_ms:
        row["speedup_vs_torch"] = torch_ms / ms
        txt += f"  torch {torch_ms:8.3f} ms  x{torch_ms / ms:5.2f}"
    if nbytes:
        gbs = nbytes / ms / 1e6
        row["GBps"] = gbs
        txt += f"  {gbs:7.0f} GB/s"
        if COPY_BW:
            row["frac_copy_bw"] = gbs / COPY_BW
            txt += f" ({100 * gbs / COPY_BW:4.0f}% of copy)"
    if flops:
        row["TFLOPs"] = flops / ms / 1e9
        txt += f"  {flops / ms / 1e9:6.1f} TFLOP/s"
    RESULTS["bench"].append(row)
    print(txt, flush=True)


def bench_guard(fn):
    def run(*a, **k):
        try:
            fn(*a, **k)
        except Exception as e:
            msg = f"{fn.__name__}{a}: {type(e).__name__}: {e}"
            RESULTS["errors"].append(dict(where=fn.__name__, error=msg, tb=traceback.format_exc()[-2000:]))
            print(f"ERROR {msg}", flush=True)

    return run


@bench_guard
def bench_copy():
    global COPY_BW
    cp = cp_mod()
    a = cp.empty(2 * 1024**3 // 4, cp.float32)
    b = cp.empty_like(a)
    ms = timeit(lambda: cp.copyto(b, a), iters=10)
    COPY_BW = 2 * a.nbytes / ms / 1e6
    RESULTS["copy_bw_GBps"] = COPY_BW
    print(f"device copy bandwidth: {COPY_BW:.0f} GB/s (read+write, 2 GiB)", flush=True)


@bench_guard
def bench_layer_norm(storage):
    import torch
    from blutensor.cuda_ops.layer_norm import layer_norm_backward, layer_norm_forward

    cp = cp_mod()
    N, C = 16384, 768
    x, _ = dev(RNG.standard_normal((N, C)), storage)
    w, _ = dev(RNG.standard_normal(C), storage)
    b, _ = dev(RNG.standard_normal(C), storage)
    es = x.dtype.itemsize
    y, mean, rstd, _ = layer_norm_forward(x, w, b)
    g = cp.ones_like(x)
    tdt = torch.float32 if storage == "f32" else torch.bfloat16
    tx = torch.randn(N, C, device="cuda", dtype=tdt, requires_grad=True)
    tw = torch.randn(C, device="cuda", dtype=tdt, requires_grad=True)
    tb = torch.randn(C, device="cuda", dtype=tdt, requires_grad=True)
    ty = torch.nn.functional.layer_norm(tx, (C,), tw, tb)
    tg = torch.ones_like(ty)
    ms = timeit(lambda: layer_norm_forward(x, w, b))
    tms = timeit_torch(lambda: torch.nn.functional.layer_norm(tx, (C,), tw, tb))
    bench_row(f"layer_norm.fwd {storage}", f"{N}x{C}", ms, tms, 2 * N * C * es)
    ms = timeit(lambda: layer_norm_backward(g, x, w, mean, rstd))
    tms = timeit_torch(lambda: torch.autograd.grad(ty, (tx, tw, tb), tg, retain_graph=True))
    bench_row(f"layer_norm.bwd {storage}", f"{N}x{C}", ms, tms, 3 * N * C * es)


@bench_guard
def bench_gelu(storage):
    import torch
    from blutensor.cuda_ops.gelu import gelu_backward, gelu_forward

    n = 16 * 1024 * 3072
    x, _ = dev(RNG.standard_normal(n).astype(np.float32), storage)
    g = x.copy()
    es = x.dtype.itemsize
    tdt = torch.float32 if storage == "f32" else torch.bfloat16
    tx = torch.randn(16, 1024, 3072, device="cuda", dtype=tdt)
    tg = torch.randn_like(tx)
    ms = timeit(lambda: gelu_forward(x, "tanh"))
    tms = timeit_torch(lambda: torch.nn.functional.gelu(tx, approximate="tanh"))
    bench_row(f"gelu.fwd tanh {storage}", "16x1024x3072", ms, tms, 2 * n * es)
    ms = timeit(lambda: gelu_backward(g, x, "tanh"))
    tms = timeit_torch(lambda: torch.ops.aten.gelu_backward(tg, tx, approximate="tanh"))
    bench_row(f"gelu.bwd tanh {storage}", "16x1024x3072", ms, tms, 3 * n * es)


@bench_guard
def bench_cross_entropy(storage):
    import torch
    from blutensor.cuda_ops.cross_entropy import cross_entropy_forward

    cp = cp_mod()
    N, C = 16384, 50304
    z, _ = dev(RNG.standard_normal((N, C), dtype=np.float32), storage)
    t = cp.asarray(RNG.integers(0, 50257, N).astype(np.int64))
    es = z.dtype.itemsize
    ms = timeit(lambda: cross_entropy_forward(z, t, want_grad=True, inplace_grad=True), iters=10)
    tdt = torch.float32 if storage == "f32" else torch.bfloat16
    tz = torch.randn(N, C, device="cuda", dtype=tdt, requires_grad=True)
    tt = torch.from_dlpack(t)

    def tstep():
        loss = torch.nn.functional.cross_entropy(tz, tt)
        loss.backward()
        tz.grad = None

    tms = timeit_torch(tstep, iters=10)
    bench_row(f"cross_entropy fused fwd+grad {storage}", f"{N}x{C}", ms, tms, 2 * N * C * es)
    import blutensor.cuda_ops.cross_entropy as ce_mod

    ce_mod.USE_SMEM_ROW = False
    try:  # the alternative: two passes, the second re-reading the row from L2
        ms2 = timeit(lambda: cross_entropy_forward(z, t, want_grad=True, inplace_grad=True), iters=10)
    finally:
        ce_mod.USE_SMEM_ROW = True
    bench_row(f"cross_entropy two-pass fwd+grad {storage}", f"{N}x{C}", ms2, tms, 2 * N * C * es)
    ms = timeit(lambda: cross_entropy_forward(z, t, want_grad=False), iters=10)
    bench_row(f"cross_entropy loss only {storage}", f"{N}x{C}", ms, None, N * C * es)


GPT2_SHAPES = ref.gpt2_param_shapes()  # GPT-2 124M, model order


@bench_guard
def bench_adamw():
    import torch
    from blutensor.cuda_ops.adamw import multi_tensor_adamw

    cp = cp_mod()
    sizes = [math.prod(s) for s in GPT2_SHAPES]
    ps = [cp.asarray(RNG.standard_normal(n, dtype=np.float32)) for n in sizes]
    gs = [cp.asarray(RNG.standard_normal(n, dtype=np.float32)) for n in sizes]
    ms_ = [cp.zeros(n, cp.float32) for n in sizes]
    vs = [cp.zeros(n, cp.float32) for n in sizes]
    total = sum(sizes)
    ms = timeit(lambda: multi_tensor_adamw(ps, gs, ms_, vs, 10, 6e-4, 0.9, 0.95, 1e-8, 0.1))
    tp = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in GPT2_SHAPES]
    for p in tp:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(tp, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    tms = timeit_torch(opt.step)
    bench_row("adamw multi-tensor f32", f"GPT-2 124M ({total / 1e6:.1f}M)", ms, tms, 28 * total)


@bench_guard
def bench_grad_norm():
    import torch
    from blutensor.cuda_ops.norm import global_grad_norm

    cp = cp_mod()
    sizes = [math.prod(s) for s in GPT2_SHAPES]
    gs = [cp.asarray(RNG.standard_normal(n, dtype=np.float32)) for n in sizes]
    ms = timeit(lambda: global_grad_norm(gs))
    tg = [torch.randn(s, device="cuda") for s in GPT2_SHAPES]
    tms = timeit_torch(lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tg))))
    bench_row("grad_norm multi-tensor f32", "GPT-2 124M", ms, tms, 4 * sum(sizes))


ATTN_CONFIGS = [
    (T, B, H, D) for T in (512, 1024) for (B, H, D) in ((1, 12, 64), (4, 12, 64), (8, 16, 64), (16, 12, 64))
] + [(2048, B, H, D) for (B, H, D) in ((1, 16, 64), (1, 32, 128), (4, 32, 128))]


@bench_guard
def bench_attention(variant, T, B, H, D, causal):
    import torch
    from blutensor.cuda_ops.sdpa import flash_attention_backward, flash_attention_forward

    storage = "bf16" if variant == "bf16" else "f32"
    q, _ = dev(RNG.standard_normal((B * H, T, D), dtype=np.float32), storage)
    k, _ = dev(RNG.standard_normal((B * H, T, D), dtype=np.float32), storage)
    v, _ = dev(RNG.standard_normal((B * H, T, D), dtype=np.float32), storage)
    flops = 4 * B * H * T * T * D * (0.5 if causal else 1.0)
    o, lse = flash_attention_forward(q, k, v, causal, None, variant)
    do = o.copy()
    it = 10
    ms = timeit(lambda: flash_attention_forward(q, k, v, causal, None, variant), iters=it)
    tdt = torch.bfloat16 if variant == "bf16" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = variant == "tf32"
    torch.backends.cudnn.allow_tf32 = variant == "tf32"
    tq, tk, tv = (torch.randn(B, H, T, D, device="cuda", dtype=tdt, requires_grad=True) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    tms = timeit_torch(lambda: sdpa(tq, tk, tv, is_causal=causal), iters=it)
    shape = f"T={T} {B}x{H}x{D} c={int(causal)}"
    bench_row(f"attention.fwd {variant}", shape, ms, tms, flops=flops)
    ms = timeit(lambda: flash_attention_backward(q, k, v, o, lse, do, causal, None, variant), iters=it)
    to = sdpa(tq, tk, tv, is_causal=causal)
    tg = torch.randn_like(to)
    tms = timeit_torch(lambda: torch.autograd.grad(to, (tq, tk, tv), tg, retain_graph=True), iters=it)
    bench_row(f"attention.bwd {variant}", shape, ms, tms, flops=2.5 * flops)


CHECKS = (
    check_layer_norm,
    check_gelu,
    check_cross_entropy,
    check_embedding,
    check_adamw,
    check_grad_norm,
    check_sdpa_f32,
    check_sdpa_bf16,
    check_sdpa_tf32,
    check_plugins,
)
BUDGET_S = float(os.environ.get("BLU_BUDGET_S", "220"))  # whole run, all subprocesses


def run_memory_benchmarks():
    bench_copy()
    for s in ("f32", "bf16"):
        bench_layer_norm(s)
        bench_gelu(s)
        bench_cross_entropy(s)
    bench_adamw()
    bench_grad_norm()


def run_attention_benchmarks(variant, deadline):
    """Attention benchmarks of one variant (reported in TFLOP/s) until ``deadline``."""
    for T, B, H, D in ATTN_CONFIGS:
        for causal in (False, True):
            if time.time() > deadline:
                print(f"time limit reached: skipping the remaining {variant} attention benchmarks", flush=True)
                return
            bench_attention(variant, T, B, H, D, causal)


GROUPS = {fn.__name__: fn for fn in CHECKS}


def run_group(name: str, out_dir: Path, deadline: float) -> None:
    """Run one group in this process and write its partial results (child side)."""
    if name == "bench_memory":
        run_memory_benchmarks()
    elif name.startswith("bench_attention_"):
        run_attention_benchmarks(name.rsplit("_", 1)[1], deadline)
    else:
        t = time.time()
        GROUPS[name]()
        print(f"  [{name}: {time.time() - t:.1f} s]", flush=True)
    (out_dir / f"part_{name}.json").write_text(json.dumps(RESULTS, default=str))


def main() -> int:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
    out_dir.mkdir(parents=True, exist_ok=True)
    if len(sys.argv) > 3 and sys.argv[2] == "--group":  # child process
        run_group(sys.argv[3], out_dir, float(os.environ.get("BLU_DEADLINE", time.time() + 60)))
        return 0
    cp = cp_mod()
    props = cp.cuda.runtime.getDeviceProperties(0)
    RESULTS["device"] = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    RESULTS["cupy"] = cp.__version__
    try:
        import torch

        RESULTS["torch"] = torch.__version__
    except Exception as e:
        RESULTS["torch"] = f"unavailable: {e}"
    print(f"device {RESULTS['device']}, CuPy {cp.__version__}, torch {RESULTS['torch']}", flush=True)
    # each group runs in its own process: a kernel that faults (sticky CUDA error) cannot take the others down
    groups = [] if os.environ.get("BLU_BENCH_ONLY") else list(GROUPS)
    if not os.environ.get("BLU_CHECK_ONLY"):
        groups += ["bench_memory", "bench_attention_bf16", "bench_attention_tf32", "bench_attention_f32"]
    deadline = T0 + BUDGET_S
    for name in groups:
        left = deadline - time.time()
        if left < 5:
            RESULTS["errors"].append(dict(where=name, error=f"{name}: skipped, time limit reached", tb=""))
            print(f"SKIP {name}: time limit reached", flush=True)
            continue
        env = dict(os.environ, BLU_DEADLINE=str(deadline - 3))
        cmd = [sys.executable, str(Path(__file__).resolve()), str(out_dir), "--group", name]
        try:
            rc = subprocess.run(cmd, env=env, timeout=max(10.0, left)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        part = out_dir / f"part_{name}.json"
        if part.exists():
            d = json.loads(part.read_text())
            for key in ("checks", "bench", "errors"):
                RESULTS[key] += d.get(key, [])
            if "copy_bw_GBps" in d:
                RESULTS["copy_bw_GBps"] = d["copy_bw_GBps"]
            part.unlink()
        if rc != 0:
            msg = f"{name}: child process ended with {rc} (a kernel fault or crash; see the log above)"
            RESULTS["errors"].append(dict(where=name, error=msg, tb=""))
            print(f"ERROR {msg}", flush=True)
    fails = [c for c in RESULTS["checks"] if not c["passed"]]
    print(
        f"== summary: {len(RESULTS['checks']) - len(fails)}/{len(RESULTS['checks'])} checks passed, "
        f"{len(RESULTS['errors'])} errors ({time.time() - T0:.0f} s)",
        flush=True,
    )
    for c in fails:
        print(f"  FAILED {c['kernel']} {c['variant']} err={c['err']:.3e} tol={c['tol']:.1e} {c['info']}")
    for e in RESULTS["errors"]:
        print(f"  ERROR {e['error']}")
    RESULTS["wall_s"] = time.time() - T0
    (out_dir / "kernels_check.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    print(f"wrote {out_dir / 'kernels_check.json'} ({RESULTS['wall_s']:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
