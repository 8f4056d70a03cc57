"""GPU check of the '3xtf32' precision (fp32-accurate split-TF32 GEMMs): accuracy and speed on GPT-2's
GEMMs, epilogues/odd shapes/capture, and GPT-2 124M training strict vs 3xtf32 (B=16, T=1024, 10 steps).

    python3 packages/blublas/dev/gpu_check_3xtf32.py OUTDIR

Writes OUTDIR/blublas_3xtf32_h200.json and prints a compact summary. Errors: componentwise relative error
|C - C64| / (|op(a)| @ |op(b)|) against a float64 product computed with CuPy on a subset of output rows.
Env: GPU3X_TRAIN=0 skips training, GPU3X_TORCH_TRAIN=0 the torch fp32 eager loss reference; the cases on our
mma.sync TF32 kernels (provider blublas) run when under 60 s have passed, or with GPU3X_BLUBLAS=1.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[3]
for p in [ROOT / "benchmarks", *sorted((ROOT / "packages").glob("*/src"))]:
    sys.path.insert(0, str(p))
os.environ.setdefault("BLUBLAS_WGMMA", "0")  # no wgmma self-test child here: this checks the split path

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu3x_out")
OUT.mkdir(parents=True, exist_ok=True)
T0 = time.time()
RES: dict = {"gemm": [], "checks": [], "failures": [], "train": {}, "timings": {}}
COMMAND = "python3 packages/blublas/dev/gpu_check_3xtf32.py OUTDIR"
SUB_ROWS = 128  # output rows compared against float64
METHODS = (  # name, blublas precision, BLUBLAS_3XTF32 mode
    ("strict", "fp32", None),
    ("3xtf32", "3xtf32", "concat"),
    ("3xtf32_two", "3xtf32", "two"),
    ("tf32", "tf32", None),
)

from blublas.testing import gpt2_gemm_shapes  # noqa: E402 - after the sys.path insert

GPT2_SHAPES = gpt2_gemm_shapes()  # GPT-2 124M at B*T = 16384 (blublas.testing): fwd nt, dX nn, dW tn


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def fail(what: str, exc: str) -> None:
    RES["failures"].append({"check": what, "error": exc[-2500:]})
    log(f"FAILED {what}: {exc[-600:]}")


def time_ms(cp, fn, target_ms: float = 20.0) -> float:
    """Mean ms per call over back-to-back calls filling ~target_ms (3 to 100 calls), after 2 warm-ups."""
    fn()
    fn()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record()
    fn()
    e1.record()
    e1.synchronize()
    reps = int(min(100, max(3, target_ms / max(cp.cuda.get_elapsed_time(e0, e1), 1e-3))))
    e0.record()
    for _ in range(reps):
        fn()
    e1.record()
    e1.synchronize()
    return cp.cuda.get_elapsed_time(e0, e1) / reps


def bench_shape(cp, torch, name: str, lay: str, m: int, n: int, k: int) -> dict:
    """Errors and ms of every method on one GPT-2 GEMM (operands like activations and 0.02-scaled weights)."""
    import numpy as np
    from blublas import gemm

    ta, tb = lay[0] == "t", lay[1] == "t"
    row: dict = {"name": name, "layout": lay, "M": m, "N": n, "K": k}
    a = cp.random.standard_normal((k, m) if ta else (m, k), dtype=cp.float32)
    b = cp.random.standard_normal((n, k) if tb else (k, n), dtype=cp.float32) * 0.02
    out = cp.empty((m, n), cp.float32)
    rows = cp.asarray(np.linspace(0, m - 1, min(SUB_ROWS, m)).astype(np.int64))
    opa_sub = (a[:, rows].T if ta else a[rows]).astype(cp.float64)
    opb = (b.T if tb else b).astype(cp.float64)
    ref = opa_sub @ opb
    scale = cp.maximum(cp.abs(opa_sub) @ cp.abs(opb), 1e-300)
    del opb

    def err(c):
        e = cp.abs(c[rows].astype(cp.float64) - ref) / scale
        return float(e.max()), float(e.mean())

    for meth, prec, mode in METHODS:
        if mode:
            os.environ["BLUBLAS_3XTF32"] = mode

        def call(prec=prec):
            return gemm(a, b, out, trans_a=ta, trans_b=tb, precision=prec, provider="cublas")

        call()  # first eager call: cuBLASLt algorithm tuning
        cp.cuda.Device().synchronize()
        row[f"{meth}_err_max"], row[f"{meth}_err_mean"] = err(out)
        row[f"{meth}_ms"] = time_ms(cp, call)
    os.environ.pop("BLUBLAS_3XTF32", None)
    if torch is not None and torch.cuda.is_available():
        at, bt_ = torch.from_dlpack(a), torch.from_dlpack(b)
        opa_t, opb_t = (at.T if ta else at), (bt_.T if tb else bt_)
        res = {}

        def tcall():
            res["c"] = torch.matmul(opa_t, opb_t)

        tcall()
        torch.cuda.synchronize()
        row["torch_fp32_err_max"], row["torch_fp32_err_mean"] = err(cp.from_dlpack(res["c"]))
        row["torch_fp32_ms"] = time_ms(cp, tcall)
    flops = 2.0 * m * n * k
    for meth in ALL:
        if f"{meth}_ms" in row:
            row[f"{meth}_tflops"] = flops / row[f"{meth}_ms"] / 1e9
    return row


ALL = ("strict", "3xtf32", "3xtf32_two", "tf32", "torch_fp32")


def gemm_bench(cp) -> None:
    try:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    except Exception:  # noqa: BLE001
        torch = None
    for name, lay, m, n, k in GPT2_SHAPES:
        try:
            row = bench_shape(cp, torch, name, lay, m, n, k)
            log(f"{name:13s} {lay} " + " ".join(
                f"{meth} {row.get(meth + '_ms', float('nan')):.2f}ms/{row.get(meth + '_err_max', float('nan')):.0e}"
                for meth in ALL))
        except Exception:  # noqa: BLE001
            fail(f"gemm {name}", traceback.format_exc())
            row = {"name": name, "layout": lay, "M": m, "N": n, "K": k}
        RES["gemm"].append(row)
        cp.get_default_memory_pool().free_all_blocks()
        if torch is not None:
            torch.cuda.empty_cache()


def correctness(cp, providers: tuple[str, ...] = ("cublas",), capture: bool = True) -> None:
    """Epilogues (bias, GELU + pre-activation, beta), odd sizes, batched, both modes, capture (cuBLASLt)."""
    import numpy as np
    from blublas import gemm
    from blublas.testing import ODD_SHAPES, check_case, make_case

    for how in ("concat", "two"):
        os.environ["BLUBLAS_3XTF32"] = how
        for provider in providers:
            worst, n = 0.0, 0
            for lay in ("nn", "nt", "tn"):
                for shape in (*ODD_SHAPES, (300, 520, 1000)):
                    for batch in (0, 3):
                        rng = np.random.default_rng(n)
                        case = make_case(rng, *shape, layout=lay, precision="3xtf32", bias="f32", epilogue="gelu",
                                         save_preact=True, beta=0.5, batch=batch)
                        try:
                            e = check_case(case, cp, provider=provider)
                        except Exception:  # noqa: BLE001
                            fail(f"case {provider} {how} {case.describe()}", traceback.format_exc())
                            e = float("inf")
                        worst, n = max(worst, e), n + 1
            ok = worst <= 1e-5
            RES["checks"].append({"check": f"cases {provider} {how}", "n": n, "worst_norm_err": worst, "ok": ok})
            log(f"cases {provider:7s} {how:6s}: {n} cases worst normalised err {worst:.2e} {'ok' if ok else 'FAIL'}")
    os.environ.pop("BLUBLAS_3XTF32", None)
    if not capture:
        return
    # capture: split + GEMM recorded in a CUDA graph; replay reads new inputs
    try:
        rng = np.random.default_rng(7)
        a_h = rng.standard_normal((512, 256)).astype(np.float32)
        w_h = rng.standard_normal((384, 256)).astype(np.float32)
        b_h = rng.standard_normal(384).astype(np.float32)
        a, w, bias = cp.asarray(a_h), cp.asarray(w_h), cp.asarray(b_h)
        out = cp.zeros((512, 384), cp.float32)
        s = cp.cuda.Stream(non_blocking=True)
        kw = dict(trans_b=True, bias=bias, precision="3xtf32", provider="cublas", stream=s)
        with s:
            gemm(a, w, out, **kw)
            s.begin_capture()
            gemm(a, w, out, **kw)
            g = s.end_capture()
            out.fill(0)
            a[...] = cp.asarray(a_h * 0.5)
            g.launch(s)
        s.synchronize()
        ref = (a_h.astype(np.float64) * 0.5) @ w_h.astype(np.float64).T + b_h
        e = float(np.max(np.abs(out.get() - ref)) / (np.max(np.abs(a_h * 0.5) @ np.abs(w_h).T) + 3.0))
        RES["checks"].append({"check": "capture cublas 3xtf32", "worst_norm_err": e, "ok": e <= 1e-5})
        log(f"capture: normalised err {e:.2e} {'ok' if e <= 1e-5 else 'FAIL'}")
    except Exception:  # noqa: BLE001
        fail("capture", traceback.format_exc())


def train(cp, mode: str) -> dict:
    import blutensor as bt
    from blumodels.gpt2 import build_model
    from blutensor import set_fp32_gemm
    from e2e_gpt2 import batches, config

    bt.set_matmul_precision("fp32")
    set_fp32_gemm(mode)
    bt.set_gemm_provider("cublas")
    model = build_model(config(12), device="cuda", seed=0)
    opt = bt.optim.AdamW(model.param_groups(0.1), lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    losses, ms = [], []
    for x, y in batches(16, 1024, 10):
        xi, yi = bt.tensor(x, device="cuda"), bt.tensor(y, device="cuda")
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        _, loss = model(xi, yi)
        loss.backward()
        bt.optim.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        cp.cuda.Device().synchronize()
        ms.append((time.perf_counter() - t) * 1e3)
        losses.append(float(loss.item()))
    del model, opt
    set_fp32_gemm(None)
    cp.get_default_memory_pool().free_all_blocks()
    med = sorted(ms[3:])[len(ms[3:]) // 2]
    log(f"train {mode:7s}: median step {med:.1f} ms, losses {' '.join(f'{v:.5f}' for v in losses)}")
    return {"losses": losses, "step_ms": ms, "median_step_ms": med}


def train_torch() -> dict:
    import torch
    from blumodels.gpt2 import build_model
    from e2e_gpt2 import batches, config
    from torch_gpt2 import from_blutrain
    from torch_gpt2 import train_torch as tt

    model = from_blutrain(build_model(config(12), device="cpu", seed=0))
    r = tt(model, batches(16, 1024, 10), 6e-4, False, "fp32")
    del model
    torch.cuda.empty_cache()
    ms = [s * 1e3 for s in r["step_s"]]
    log(f"train torch eager fp32: median step {sorted(ms[3:])[len(ms[3:]) // 2]:.1f} ms")
    return {"losses": r["losses"], "step_ms": ms, "median_step_ms": sorted(ms[3:])[len(ms[3:]) // 2]}


def summary() -> None:
    rows = [r for r in RES["gemm"] if "strict_ms" in r and "3xtf32_ms" in r]
    if rows:
        w = [1 if "lm_head" in r["name"] else 12 for r in rows]  # GEMM count per GPT-2 step
        for meth in ("strict", "3xtf32", "3xtf32_two", "tf32", "torch_fp32"):
            if all(f"{meth}_ms" in r for r in rows):
                RES["timings"][f"gemm_step_ms_{meth}"] = sum(wi * r[f"{meth}_ms"] for wi, r in zip(w, rows))
                RES["timings"][f"gemm_err_max_{meth}"] = max(r.get(f"{meth}_err_max", 0.0) for r in rows)
        log("per-step GEMM ms (12 layers + lm head): " + " ".join(
            f"{k[len('gemm_step_ms_'):]} {v:.1f}" for k, v in RES["timings"].items() if k.startswith("gemm_step_ms")))
        log("worst max rel err: " + " ".join(
            f"{k[len('gemm_err_max_'):]} {v:.1e}" for k, v in RES["timings"].items() if k.startswith("gemm_err_max")))
    tr = RES["train"]
    if "strict" in tr and "3xtf32" in tr:
        d = max(abs(x - y) for x, y in zip(tr["strict"]["losses"], tr["3xtf32"]["losses"]))
        tr["max_abs_loss_diff_3xtf32_vs_strict"] = d
        msg = f"train: 3xtf32 vs strict max |dloss| {d:.2e}, step {tr['3xtf32']['median_step_ms']:.1f} vs " \
              f"{tr['strict']['median_step_ms']:.1f} ms"
        if "torch_eager_fp32" in tr:
            lt = tr["torch_eager_fp32"]["losses"]
            tr["max_abs_loss_diff_3xtf32_vs_torch"] = max(abs(x - y) for x, y in zip(tr["3xtf32"]["losses"], lt))
            tr["max_abs_loss_diff_strict_vs_torch"] = max(abs(x - y) for x, y in zip(tr["strict"]["losses"], lt))
            msg += (f"; vs torch fp32: 3xtf32 {tr['max_abs_loss_diff_3xtf32_vs_torch']:.2e}, strict "
                    f"{tr['max_abs_loss_diff_strict_vs_torch']:.2e}")
        log(msg)
    log(f"failures: {len(RES['failures'])}; checks ok: {sum(c['ok'] for c in RES['checks'])}/{len(RES['checks'])}")


def main() -> None:
    import cupy as cp

    RES["gpu"] = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    RES["command"] = COMMAND
    for name, fn in (("correctness", correctness), ("gemm", gemm_bench)):  # cuBLASLt
        t = time.time()
        try:
            fn(cp)
        except Exception:  # noqa: BLE001
            fail(name, traceback.format_exc())
        RES["timings"][f"{name}_s"] = round(time.time() - t, 1)
    if os.environ.get("GPU3X_TRAIN", "1") != "0":
        t = time.time()
        for mode in ("strict", "3xtf32"):
            try:
                RES["train"][mode] = train(cp, mode)
            except Exception:  # noqa: BLE001
                fail(f"train {mode}", traceback.format_exc())
        if os.environ.get("GPU3X_TORCH_TRAIN", "1") != "0":
            try:
                RES["train"]["torch_eager_fp32"] = train_torch()
            except Exception:  # noqa: BLE001
                fail("train torch", traceback.format_exc())
        RES["timings"]["train_s"] = round(time.time() - t, 1)
    # our mma.sync TF32 kernels as the TF32 engine (compiles gemm_mma_tf32.cu when not cached): if time is left
    if time.time() - T0 < 60 or os.environ.get("GPU3X_BLUBLAS") == "1":
        t = time.time()
        try:
            correctness(cp, ("blublas",), capture=False)
        except Exception:  # noqa: BLE001
            fail("correctness blublas", traceback.format_exc())
        RES["timings"]["correctness_blublas_s"] = round(time.time() - t, 1)
    else:
        log("skipped the blublas-provider cases (time; GPU3X_BLUBLAS=1 forces them)")
    summary()
    RES["timings"]["total_s"] = round(time.time() - T0, 1)
    (OUT / "blublas_3xtf32_h200.json").write_text(json.dumps(RES, indent=1))
    log(f"wrote {OUT / 'blublas_3xtf32_h200.json'}")


if __name__ == "__main__":
    main()
