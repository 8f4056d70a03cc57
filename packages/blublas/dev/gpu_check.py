"""BluBLAS GPU check: correctness of every kernel variant/config/layout/epilogue against NumPy float64,
the GPT-2 124M GEMM benchmark (B*T=16384) against cuBLASLt (our ctypes provider) and torch.matmul, both
providers inside CUDA graph capture, and the sm_90a wgmma kernels.

Run from the repo root on the GPU machine:
    python3 packages/blublas/dev/gpu_check.py OUTDIR
Order: compile (parallel) -> mma.sync/SIMT correctness -> benchmark -> capture -> wgmma. Every wgmma check
group (variant x layout) runs in its own child process (a faulting kernel poisons only that process's CUDA
context); validated groups are then benchmarked in a child too and merged into the benchmark rows.
Writes OUTDIR/blublas_gpu_check.json (everything), OUTDIR/blublas_gemm_h200.json (the benchmark in the format of
benchmarks/results/) and the autotune cache under OUTDIR/blublas_cache/. Runs in < 4 minutes on an H200.
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

HERE = Path(__file__).resolve()
SRC = HERE.parents[1] / "src"
sys.path.insert(0, str(SRC))

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "blublas_gpu_out")
OUT.mkdir(parents=True, exist_ok=True)
os.environ.setdefault("BLUBLAS_CACHE_DIR", str(OUT / "blublas_cache"))
QUICK = os.environ.get("BLUBLAS_CHECK_QUICK", "0") == "1"
T0 = time.time()
RESULT: dict = {"checks": {}, "failures": [], "bench": [], "timings": {}}
CHILD = sys.argv[2] if len(sys.argv) > 2 else ""  # "--wgmma-group" / "--wgmma-bench" in a child process
INPROC = os.environ.get("BLUBLAS_CHECK_INPROC", "0") == "1"  # run the wgmma groups in this process (tests)
TORCH = os.environ.get("BLUBLAS_CHECK_TORCH", "1") != "0"  # torch.matmul baseline column (tests turn it off)
COMMAND = "python3 packages/blublas/dev/gpu_check.py OUTDIR"


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def precompile() -> None:
    """Compile the four kernel files in parallel subprocesses (fills CuPy's disk cache)."""
    from blublas import configs

    files = list(configs.FILE_OF_VARIANT.values()) + ["gemm_epilogue.cu"]
    code = "import sys; sys.path.insert(0, sys.argv[2]); from blublas import loader; loader.get_module(sys.argv[1])"  # noqa: E501
    t = time.time()
    procs = [
        (f, subprocess.Popen([sys.executable, "-c", code, f, str(SRC)], stderr=subprocess.PIPE, text=True))
        for f in files
    ]
    for f, p in procs:
        _, err = p.communicate()
        if p.returncode != 0:
            RESULT["failures"].append({"check": "compile", "file": f, "error": err[-3000:]})
            log(f"COMPILE FAILED {f}:\n{err[-3000:]}")
    RESULT["timings"]["compile_s"] = round(time.time() - t, 1)
    log(f"compiled {files} in {time.time() - t:.1f}s")


def record(check: str, ok: bool, err: float | None, desc: str, exc: str | None = None) -> None:
    c = RESULT["checks"].setdefault(check, {"pass": 0, "fail": 0, "worst_err_over_tol": 0.0})
    c["pass" if ok else "fail"] += 1
    if not ok:
        RESULT["failures"].append({"check": check, "case": desc, "err": err, "exception": exc})
        if sum(v["fail"] for v in RESULT["checks"].values()) <= 25:
            log(f"FAIL {check}: {desc} err={err} {exc or ''}")


def run_check(check: str, case, xp, provider: str = "blublas", **kw) -> None:
    from blublas.testing import check_case

    try:
        err = check_case(case, xp, provider, **kw)
        ok = err <= case.tol
        c = RESULT["checks"].setdefault(check, {"pass": 0, "fail": 0, "worst_err_over_tol": 0.0})
        c["worst_err_over_tol"] = max(c["worst_err_over_tol"], err / case.tol if math.isfinite(err) else 1e9)
        record(check, ok, err, case.describe() + (f" {kw}" if kw else ""))
    except Exception as exc:  # noqa: BLE001
        record(check, False, None, case.describe() + f" {kw}", traceback.format_exc(limit=3)[-1500:])
        del exc


def correctness(cp) -> None:
    import numpy as np
    from blublas import configs, loader
    from blublas.testing import make_case

    cc = loader.compute_capability()
    rng = np.random.default_rng(0)
    layouts = configs.LAYOUTS
    precs = ("fp32", "tf32", "bf16")
    shapes = [(1, 1, 1), (7, 5, 3), (130, 67, 19), (257, 129, 200), (256, 128, 64), (300, 270, 129)]
    t = time.time()
    # A. every config x layout x odd/aligned shapes (forced config, plain GEMM + bias)
    for prec in precs:
        for cfg in configs.configs_for(configs.VARIANT_OF_PRECISION[prec], cc):
            for lay in layouts:
                for shp in shapes if not QUICK else shapes[2:4]:
                    case = make_case(rng, *shp, layout=lay, precision=prec, bias="f32")
                    run_check(f"config_sweep_{prec}", case, cp, config=cfg.name)
    log(f"config sweep done ({time.time() - t:.1f}s)")
    # B. epilogues x output dtype x layout x provider
    epis = [
        dict(bias="f32"),
        dict(bias="bf16"),
        dict(epilogue="gelu"),
        dict(epilogue="gelu", bias="f32", save_preact=True),
        dict(alpha=0.5, beta=1.0),
        dict(alpha=-1.5, beta=0.25, bias="f32", epilogue="gelu", save_preact=True),
    ]
    for provider in ("blublas", "cublas"):
        for prec, obf in (("fp32", False), ("tf32", False), ("bf16", True), ("bf16", False)):
            for lay in layouts:
                for epi in epis:
                    case = make_case(rng, 133, 72, 96, layout=lay, precision=prec, out_bf16=obf, **epi)
                    run_check(f"epilogue_{provider}", case, cp, provider)
                # C. batched
                case = make_case(
                    rng,
                    67,
                    40,
                    33,
                    layout=lay,
                    precision=prec,
                    out_bf16=obf,
                    batch=3,
                    bias="f32",
                    epilogue="gelu",
                    save_preact=True,
                )
                run_check(f"batched_{provider}", case, cp, provider)
                case = make_case(rng, 64, 128, 64, layout=lay, precision=prec, out_bf16=obf, batch=2)
                run_check(f"batched_{provider}", case, cp, provider)
    log(f"epilogue/batched done ({time.time() - t:.1f}s)")
    # D. split-K with full epilogue, both forced and heuristic
    for prec in precs:
        cfg = configs.configs_for(configs.VARIANT_OF_PRECISION[prec], cc)[0].name
        for lay in layouts:
            for s in (2, 5):
                case = make_case(
                    rng,
                    96,
                    80,
                    1500,
                    layout=lay,
                    precision=prec,
                    bias="f32",
                    epilogue="gelu",
                    save_preact=True,
                    alpha=0.5,
                    beta=0.5,
                )
                run_check("split_k", case, cp, config=cfg, splits=s)
        case = make_case(rng, 128, 128, 8192, layout="tn", precision=prec)
        run_check("split_k_heuristic", case, cp)
    # E. unaligned views (scalar load path) and big-ish aligned (vector path) through the heuristic
    for prec in precs:
        for lay in layouts:
            case = make_case(rng, 515, 387, 261, layout=lay, precision=prec, bias="f32", epilogue="gelu")
            run_check("heuristic_odd", case, cp)
            case = make_case(rng, 1024, 768, 512, layout=lay, precision=prec)
            run_check("heuristic_aligned", case, cp)
    RESULT["timings"]["correctness_s"] = round(time.time() - t, 1)
    log(f"correctness done ({time.time() - t:.1f}s)")


def capture(cp) -> None:
    import numpy as np
    from blublas import gemm
    from blublas.reference import f32_to_bf16_bits, gelu_tanh
    from blublas.testing import to_f64

    rng = np.random.default_rng(1)
    for provider in ("blublas", "cublas"):
        for prec in ("fp32", "tf32", "bf16"):
            desc = f"{provider} {prec} nt 512x384x256 bias+gelu+preact in cupy.cuda.graph capture"
            try:
                bf = prec == "bf16"
                a_h = rng.standard_normal((512, 256)).astype(np.float32)
                w_h = rng.standard_normal((384, 256)).astype(np.float32)
                if bf:
                    a_h, w_h = f32_to_bf16_bits(a_h), f32_to_bf16_bits(w_h)
                a, w = cp.asarray(a_h), cp.asarray(w_h)
                bias = cp.asarray(rng.standard_normal(384).astype(np.float32))
                dt = cp.uint16 if bf else cp.float32
                out, pre = cp.zeros((512, 384), dt), cp.zeros((512, 384), dt)
                stream = cp.cuda.Stream(non_blocking=True)
                kw = dict(
                    trans_b=True,
                    bias=bias,
                    epilogue="gelu",
                    save_preact=pre,
                    precision=prec,
                    stream=stream,
                    provider=provider,
                )
                with stream:
                    gemm(a, w, out, **kw)  # warm-up outside capture
                    stream.begin_capture()
                    gemm(a, w, out, **kw)
                    graph = stream.end_capture()
                    out.fill(0)
                    pre.fill(0)
                    # new input values after capture: the replay must read them (power-of-2 scale: exact)
                    a2_h = f32_to_bf16_bits(to_f64(a_h, True).astype(np.float32) * 0.5) if bf else a_h * 0.5
                    a[...] = cp.asarray(a2_h)
                    graph.launch(stream)
                    graph.launch(stream)
                stream.synchronize()
                pre_ref = to_f64(a2_h, bf) @ to_f64(w_h, bf).T + bias.get()
                ref = gelu_tanh(pre_ref)
                scale = float(np.max(np.abs(to_f64(a2_h, bf)) @ np.abs(to_f64(w_h, bf)).T)) + 3.0
                err = (
                    max(
                        float(np.max(np.abs(to_f64(out.get(), bf) - ref))),
                        float(np.max(np.abs(to_f64(pre.get(), bf) - pre_ref))),
                    )
                    / scale
                )
                tol = 5e-3 if bf else (2e-3 if prec == "tf32" else 1e-5)
                record("capture", err <= tol, err, desc)
            except Exception:  # noqa: BLE001
                record("capture", False, None, desc, traceback.format_exc(limit=4)[-2000:])
    log("capture done")


from blublas.testing import gpt2_gemm_shapes  # noqa: E402 - after the sys.path insert

GPT2_SHAPES = gpt2_gemm_shapes()  # GPT-2 124M at B*T = 16384 (blublas.testing): fwd nt, dX nn, dW tn


WGMMA_SHAPES = [(1, 1, 1), (7, 5, 3), (130, 67, 19), (257, 129, 200), (256, 256, 64), (300, 270, 129), (128, 512, 1024)]
WGMMA_GROUPS = [
    ("wgmma", "nn", "bf16"),
    ("wgmma", "nt", "bf16"),
    ("wgmma", "tn", "bf16"),
    ("wgmma_tf32", "nt", "tf32"),
    ("wgmma_tf32", "nn", "tf32"),  # NN/TN: the NT kernel on K-major copies
    ("wgmma_tf32", "tn", "tf32"),
]


def wgmma_group(cp, variant: str, layout: str, precision: str) -> None:
    """Every config of one (variant, layout): odd/aligned sweep, full epilogue (bf16 and f32 out),
    split-K and batched, forced configs. Stops at the first exception (the context may be poisoned)."""
    import numpy as np
    from blublas import configs
    from blublas.selftest import tma_shape
    from blublas.testing import make_case as _make_case

    def make_case(rng, m, n, k, **kw):  # TMA needs 16-byte leading dimensions: round the stored extents
        return _make_case(rng, *tma_shape(m, n, k, layout, precision), **kw)

    os.environ["BLUBLAS_WGMMA"] = "1"
    rng = np.random.default_rng(5)
    tag = f"{variant}_{layout}"
    n_exc = len([f for f in RESULT["failures"] if f.get("exception")])

    def crashed() -> bool:
        return len([f for f in RESULT["failures"] if f.get("exception")]) > n_exc

    outs = (True, False) if precision == "bf16" else (False,)
    for cfg in configs.configs_for(variant, 90):
        if layout not in cfg.layouts:
            continue
        cases = [
            (f"{tag}_sweep", make_case(rng, *shp, layout=layout, precision=precision, bias="f32"), {})
            for shp in WGMMA_SHAPES
        ]
        cases += [
            (
                f"{tag}_epilogue",
                make_case(
                    rng,
                    133,
                    200,
                    96,
                    layout=layout,
                    precision=precision,
                    out_bf16=obf,
                    bias="f32",
                    epilogue="gelu",
                    save_preact=True,
                    alpha=0.5,
                    beta=0.5,
                ),
                {},
            )
            for obf in outs
        ]
        cases.append(
            (
                f"{tag}_split_k",
                make_case(
                    rng,
                    96,
                    300,
                    1500,
                    layout=layout,
                    precision=precision,
                    bias="f32",
                    epilogue="gelu",
                    save_preact=True,
                ),
                {"splits": 3},
            )
        )
        cases.append((f"{tag}_batched", make_case(rng, 67, 130, 70, layout=layout, precision=precision, batch=3), {}))
        for check, case, kw in cases:
            run_check(check, case, cp, config=cfg.name, **kw)
            if crashed():
                log(f"{tag}: {cfg.name} raised; stopping this group (its CUDA context may be poisoned)")
                return


def wgmma_bench(cp, variant: str, layout: str, precision: str) -> None:
    """Time every config of a validated (variant, layout) on the GPT-2 shapes of that layout (child)."""
    from blublas import api, configs

    os.environ["BLUBLAS_WGMMA"] = "1"
    for name, lay, m, n, k in GPT2_SHAPES:
        if lay != layout:
            continue
        a, b, out = _operands(cp, precision, lay, m, n, k)
        kw = dict(trans_a=lay[0] == "t", trans_b=lay[1] == "t", precision=precision)
        times = {}
        for cfg in configs.configs_for(variant, 90):
            if lay not in cfg.layouts:
                continue
            for s in sorted({1, _heuristic_split(cfg, precision, m, n, k)}):
                try:
                    times[f"{cfg.name}/s{s}"] = _time_ms(
                        cp,
                        lambda c=cfg.name, s=s, a=a, b=b, out=out, kw=kw: api.gemm(a, b, out, config=c, splits=s, **kw),
                    )
                except Exception as exc:  # noqa: BLE001
                    times[f"{cfg.name}/s{s}"] = f"{type(exc).__name__}: {exc}"[:300]
        ok = {key: v for key, v in times.items() if isinstance(v, float)}
        row = {"precision": precision, "name": name, "layout": lay, "variant": variant, "candidates_ms": times}
        if ok:
            best = min(ok, key=ok.get)
            row.update(best=best, ms=ok[best])
        RESULT["bench"].append(row)
        a = b = out = None
        cp.get_default_memory_pool().free_all_blocks()


def _heuristic_split(cfg, precision: str, m: int, n: int, k: int) -> int:
    from blublas import configs, loader

    cands = [s for c, s in configs.candidates(cfg.variant, loader.compute_capability(), m, n, k, 1, None) if c == cfg]
    if len(cands) <= 1:
        return 1
    best = min(
        cands,
        key=lambda s: configs.estimate_seconds(
            cfg, s, m, n, k, 1, 90, loader.sm_count(), 2 if precision == "bf16" else 4
        ),
    )
    return best


def run_children(mode: str, groups: list[tuple[str, str, str]]) -> dict[tuple[str, str], dict]:
    """Run each group in a child process (this script with ``mode``); returns its JSON part."""
    parts = {}
    for variant, layout, prec in groups:
        part = OUT / "parts" / f"{mode.strip('-')}_{variant}_{layout}.json"
        part.parent.mkdir(parents=True, exist_ok=True)
        t = time.time()
        if INPROC:
            saved = {k: RESULT[k] for k in ("checks", "failures", "bench")}
            RESULT.update(checks={}, failures=[], bench=[])
            import cupy as cp

            try:
                (wgmma_group if mode == "--wgmma-group" else wgmma_bench)(cp, variant, layout, prec)
                part.write_text(json.dumps({k: RESULT[k] for k in ("checks", "failures", "bench")}, default=str))
            finally:
                RESULT.update(saved)
                os.environ["BLUBLAS_WGMMA"] = "0"
            rc = 0
        else:
            try:  # a hung kernel must not eat the whole time limit
                proc = subprocess.run(
                    [sys.executable, str(HERE), str(OUT), mode, variant, layout, prec],
                    capture_output=True,
                    text=True,
                    timeout=90,
                )
                rc = proc.returncode
                for line in proc.stdout.splitlines()[-12:]:
                    print(f"    [{variant} {layout}] {line}", flush=True)
            except subprocess.TimeoutExpired:
                rc = "timeout (90 s)"
        try:
            parts[(variant, layout)] = json.loads(part.read_text())
        except (OSError, ValueError):
            parts[(variant, layout)] = {
                "checks": {},
                "failures": [{"check": f"{variant}_{layout}", "error": f"child exited {rc} without a result"}],
                "bench": [],
            }
        log(f"{mode} {variant} {layout}: rc {rc} ({time.time() - t:.1f}s)")
    return parts


def wgmma_all() -> None:
    """Validate each wgmma group in its own process, record the library's own self-test verdicts, then
    benchmark the validated groups (each in a child) and merge them into the benchmark rows."""
    t = time.time()
    parts = run_children("--wgmma-group", WGMMA_GROUPS)
    validated = {}
    for (variant, layout), part in parts.items():
        for k, v in part["checks"].items():
            RESULT["checks"][k] = v
        RESULT["failures"] += part["failures"]
        ok = not part["failures"] and any(v["pass"] for v in part["checks"].values())
        validated[f"{variant}|{layout}"] = ok
    RESULT["wgmma_validated"] = validated
    log(f"wgmma validated per group: {validated}")
    # the library's own strict self-test (selftest.py, child process, verdict cached on disk)
    try:
        import cupy as cp
        from blublas import selftest

        os.environ["BLUBLAS_WGMMA"] = "auto"
        RESULT["wgmma_auto_self_test"] = {
            f"{v}|{lay}": selftest.probe(v, lay, prec, 90, int(cp.cuda.Device().id)) for v, lay, prec in WGMMA_GROUPS
        }
    except Exception as exc:  # noqa: BLE001
        RESULT["wgmma_auto_self_test"] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        os.environ["BLUBLAS_WGMMA"] = "0"
    log(f"wgmma library self-test: {RESULT['wgmma_auto_self_test']}")
    good = [g for g in WGMMA_GROUPS if validated.get(f"{g[0]}|{g[1]}")]
    if good and time.time() - T0 < 210:
        for part in run_children("--wgmma-bench", good).values():
            merge_wgmma_bench(part.get("bench", []))
        summarize()
    RESULT["timings"]["wgmma_s"] = round(time.time() - t, 1)


def merge_wgmma_bench(rows: list[dict]) -> None:
    """Where a validated wgmma config beats the autotuned mma.sync choice, it becomes 'ours'."""
    for w in rows:
        for r in RESULT["bench"]:
            if r["precision"] == w["precision"] and r["name"] == w["name"] and "ours_ms" in r:
                r["wgmma_candidates_ms"] = w.get("candidates_ms")
                if "ms" in w and w["ms"] < r["ours_ms"]:
                    r["mma_sync_ms"] = r["ours_ms"]
                    _set_ours(r, w["ms"], f"{w['variant']}:{w['best']}")


def _operands(cp, prec: str, lay: str, m: int, n: int, k: int):
    ta, tb = lay[0] == "t", lay[1] == "t"
    dt = cp.uint16 if prec == "bf16" else cp.float32
    a = cp.random.standard_normal((k, m) if ta else (m, k), dtype=cp.float32) * 0.5
    b = cp.random.standard_normal((n, k) if tb else (k, n), dtype=cp.float32) * 0.5
    if prec == "bf16":  # truncate to bf16 bits (fine for timing and for the comparison)
        a = (a.view(cp.uint32) >> 16).astype(cp.uint16)
        b = (b.view(cp.uint32) >> 16).astype(cp.uint16)
    return a, b, cp.empty((m, n), dt)


def _time_ms(cp, fn):
    """Mean ms per call (5 to 200 back-to-back calls filling ~25 ms): blublas.testing.time_ms."""
    from blublas.testing import time_ms

    return time_ms(cp, fn, target_ms=25.0, min_reps=5)


def _torch_ms(prec: str, lay: str, m: int, n: int, k: int) -> float | None:
    """torch.matmul on the same shape/layout (allow_tf32 only for tf32; bf16 in and out)."""
    if not TORCH:
        return None
    try:
        import torch
    except Exception:  # noqa: BLE001 - torch missing or broken: no torch column
        return None
    if not torch.cuda.is_available():
        return None
    ta, tb = lay[0] == "t", lay[1] == "t"
    dt = torch.bfloat16 if prec == "bf16" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = prec == "tf32"
    a = torch.randn((k, m) if ta else (m, k), device="cuda", dtype=dt)
    b = torch.randn((n, k) if tb else (k, n), device="cuda", dtype=dt)
    out = torch.empty((m, n), device="cuda", dtype=dt)
    aa, bb = (a.t() if ta else a), (b.t() if tb else b)

    def fn():
        torch.matmul(aa, bb, out=out)

    for _ in range(2):
        fn()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    fn()
    e1.record()
    e1.synchronize()
    reps = int(min(200, max(5, 25.0 / max(e0.elapsed_time(e1), 1e-3))))
    e0.record()
    for _ in range(reps):
        fn()
    e1.record()
    e1.synchronize()
    ms = e0.elapsed_time(e1) / reps
    fn = None  # drop the references before emptying torch's cache
    a = b = out = aa = bb = None
    torch.cuda.empty_cache()
    return ms


def _set_ours(row: dict, ms: float, kernel: str) -> None:
    flops = 2.0 * row["M"] * row["N"] * row["K"]
    row.update(ours_ms=round(ms, 4), ours_tflops=round(flops / ms / 1e9, 1), ours_kernel=kernel)
    row["ratio"] = round(row["cublaslt_ms"] / ms, 3)
    if row.get("torch_ms"):
        row["ratio_vs_torch"] = round(row["torch_ms"] / ms, 3)


def bench_one(cp, prec: str, name: str, lay: str, m: int, n: int, k: int, row: dict) -> None:
    """Ours (the autotuner's choice among timed candidates), cuBLASLt (our ctypes provider, its top
    algorithms timed once) and torch.matmul on one GPT-2 shape; fills ``row``."""
    from blublas import api, cublas, launch

    a, b, ours = _operands(cp, prec, lay, m, n, k)
    ref = cp.empty_like(ours)
    kw = dict(trans_a=lay[0] == "t", trans_b=lay[1] == "t", precision=prec)
    t = time.time()
    p = api.plan(a, b, ours, alpha=1.0, beta=0.0, bias=None, epilogue="none", save_preact=None, batched=False, **kw)
    with cp.cuda.Device(p.device_id):
        cfg, s = launch.select(p, cp.cuda.get_current_stream(), None, None, True)
    row["autotune_s"] = round(time.time() - t, 2)
    ms_ours = _time_ms(cp, lambda: api.gemm(a, b, ours, config=cfg.name, splits=s, **kw))
    n_log = len(cublas.TUNING_LOG)
    ms_cublas = _time_ms(cp, lambda: api.gemm(a, b, ref, provider="cublas", **kw))
    if len(cublas.TUNING_LOG) > n_log:
        tl = cublas.TUNING_LOG[n_log]
        row["cublaslt_tuning"] = {
            "algos": tl["algos"],
            "heuristic_first_ms": round(tl["first_ms"], 4),
            "best_ms": round(tl["best_ms"], 4),
            "best_index": tl["best_index"],
        }
    flops = 2.0 * m * n * k
    row.update(cublaslt_ms=round(ms_cublas, 4), cublaslt_tflops=round(flops / ms_cublas / 1e9, 1))
    try:
        tms = _torch_ms(prec, lay, m, n, k)
    except Exception as exc:  # noqa: BLE001 - the torch column is optional
        tms, row["torch_error"] = None, f"{type(exc).__name__}: {exc}"[:300]
    if tms:
        row.update(
            torch_ms=round(tms, 4),
            torch_tflops=round(flops / tms / 1e9, 1),
            cublaslt_vs_torch=round(tms / ms_cublas, 3),
        )
    _set_ours(row, ms_ours, f"{cfg.variant}:{cfg.name}/s{s}")
    if prec == "bf16":
        o = (ours.astype(cp.uint32) << 16).view(cp.float32)
        r = (ref.astype(cp.uint32) << 16).view(cp.float32)
    else:
        o, r = ours, ref
    row["max_rel_diff_vs_cublaslt"] = float(cp.max(cp.abs(o - r)) / cp.max(cp.abs(r)))
    log(
        f"{prec:4s} {name:14s} {lay} {m}x{n}x{k}: ours {row['ours_tflops']:6.1f} TF ({row['ours_kernel']}) "
        f"cuBLASLt {row['cublaslt_tflops']:6.1f} TF torch {row.get('torch_tflops', '-')} TF "
        f"ratio {row['ratio']:.3f} diff {row['max_rel_diff_vs_cublaslt']:.1e}"
    )


PRECS = ("bf16", "tf32", "fp32")
TARGETS = {"fp32": 0.90, "tf32": 0.90, "bf16": 0.85}


def _prune_failed_configs() -> None:
    """Configs that failed the correctness sweep are removed from this process's candidate lists, so the
    autotuner behind the benchmark can never pick a wrong kernel."""
    import re

    from blublas import configs, loader

    bad = set()
    for f in RESULT["failures"]:
        m = re.search(r"'config': '([^']+)'", str(f.get("case", "")))
        if m and str(f.get("check", "")).startswith(("config_sweep", "split_k")):
            bad.add(m.group(1))
    if bad:
        order = configs.arch_info(loader.compute_capability()).order
        for v in list(order):
            order[v] = tuple(n for n in order[v] if n not in bad)
        RESULT["excluded_from_bench"] = sorted(bad)
        log(f"configs excluded from the benchmark (failed correctness): {sorted(bad)}")


def bench(cp) -> None:
    t_all = time.time()
    _prune_failed_configs()
    for prec in PRECS:
        for name, lay, m, n, k in GPT2_SHAPES:
            if time.time() - T0 > 190:
                log("time limit reached: skipping the remaining benchmark shapes")
                RESULT["bench_truncated"] = True
                break
            row = {"precision": prec, "name": name, "layout": lay, "M": m, "N": n, "K": k}
            try:
                bench_one(cp, prec, name, lay, m, n, k, row)
            except Exception:  # noqa: BLE001
                row["error"] = traceback.format_exc(limit=4)[-2000:]
                log(f"BENCH ERROR {prec} {name}: {row['error']}")
            RESULT["bench"].append(row)
            cp.get_default_memory_pool().free_all_blocks()
    summarize()
    RESULT["timings"]["bench_s"] = round(time.time() - t_all, 1)


def _geomean(xs: list[float]) -> float:
    return round(math.exp(sum(math.log(x) for x in xs) / len(xs)), 3)


def summarize() -> None:
    summary = {}
    for prec in PRECS:
        rows = [r for r in RESULT["bench"] if r["precision"] == prec and "ratio" in r]
        if not rows:
            continue
        rs = [r["ratio"] for r in rows]
        s = {
            "geomean_ratio": _geomean(rs),
            "min_ratio": min(rs),
            "min_ratio_shape": min(rows, key=lambda r: r["ratio"])["name"],
            "shapes": len(rs),
            "target_geomean": TARGETS[prec],
            "target_min": 0.6,
        }
        s["meets_target"] = (
            s["geomean_ratio"] >= TARGETS[prec] and s["min_ratio"] >= 0.6 and len(rs) == len(GPT2_SHAPES)
        )
        tv = [r["ratio_vs_torch"] for r in rows if "ratio_vs_torch" in r]
        if tv:
            s["geomean_ratio_vs_torch"] = _geomean(tv)
            s["geomean_cublaslt_vs_torch"] = _geomean(
                [r["cublaslt_vs_torch"] for r in rows if "cublaslt_vs_torch" in r]
            )
        summary[prec] = s
    RESULT["bench_summary"] = summary
    write_bench_json()


def write_bench_json() -> None:
    """benchmarks/results/blublas_gemm_h200.json format: per shape ours / cuBLASLt / torch, per precision
    geomean and min ratio, the command."""
    doc = {
        "what": "GPT-2 124M GEMMs at B*T=16384 (forward, dX, dW): BluBLAS kernels vs cuBLASLt vs torch.matmul",
        "command": COMMAND,
        "env": RESULT.get("env", {}),
        "method": (
            "ours: the autotuner's choice (every (config, split-K) candidate timed, median of 5) among the "
            "mma.sync/SIMT kernels, replaced by a wgmma config where that variant/layout passed validation and "
            "was faster; cuBLASLt: blublas' ctypes provider (own handle, 32 MiB workspace, top-8 heuristic "
            "algorithms timed once per shape); torch: torch.matmul (allow_tf32 only for tf32, bf16 in/out for "
            "bf16). Times: CUDA events over back-to-back calls (~25 ms per measurement). ratio = cuBLASLt ms / "
            "ours ms (>1: ours faster)."
        ),
        "shapes": [
            {
                k: r.get(k)
                for k in (
                    "precision",
                    "name",
                    "layout",
                    "M",
                    "N",
                    "K",
                    "ours_ms",
                    "ours_tflops",
                    "ours_kernel",
                    "cublaslt_ms",
                    "cublaslt_tflops",
                    "torch_ms",
                    "torch_tflops",
                    "ratio",
                    "ratio_vs_torch",
                    "cublaslt_vs_torch",
                    "mma_sync_ms",
                    "max_rel_diff_vs_cublaslt",
                    "error",
                )
                if r.get(k) is not None
            }
            for r in RESULT["bench"]
        ],
        "summary": RESULT.get("bench_summary", {}),
    }
    (OUT / "blublas_gemm_h200.json").write_text(json.dumps(doc, indent=1, default=str))


def child_main() -> None:
    """``gpu_check.py OUT --wgmma-group|--wgmma-bench VARIANT LAYOUT PRECISION``: one group, JSON part out."""
    import cupy as cp

    variant, layout, prec = sys.argv[3], sys.argv[4], sys.argv[5]
    part = OUT / "parts" / f"{CHILD.strip('-')}_{variant}_{layout}.json"
    part.parent.mkdir(parents=True, exist_ok=True)
    try:
        (wgmma_group if CHILD == "--wgmma-group" else wgmma_bench)(cp, variant, layout, prec)
    except Exception:  # noqa: BLE001
        RESULT["failures"].append({"check": f"{variant}_{layout}", "error": traceback.format_exc()[-2000:]})
    part.write_text(json.dumps({k: RESULT[k] for k in ("checks", "failures", "bench")}, default=str))
    for k, v in RESULT["checks"].items():
        print(f"{k:28s} pass {v['pass']:4d} fail {v['fail']:3d} worst err/tol {v['worst_err_over_tol']:.3f}")
    for f in RESULT["failures"][:5]:
        print(f"FAIL {f.get('case', '')} err={f.get('err')} {str(f.get('exception') or f.get('error') or '')[-200:]}")


def main() -> None:
    os.environ.setdefault("BLUBLAS_SELFTEST_TIMEOUT", "60")
    import cupy as cp
    from blublas import __version__, loader

    os.environ["BLUBLAS_WGMMA"] = "0"  # wgmma only in its own child processes (validated first)
    dev = cp.cuda.Device()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"]
    RESULT["env"] = {
        "gpu": name.decode() if isinstance(name, bytes) else str(name),
        "cc": loader.compute_capability(),
        "sms": loader.sm_count(),
        "cupy": cp.__version__,
        "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
        "blublas": __version__,
    }
    try:
        if TORCH:
            import torch

            RESULT["env"]["torch"] = torch.__version__
    except Exception:  # noqa: BLE001
        pass
    log(f"env {RESULT['env']}")
    precompile()
    try:
        from blublas import cublas

        cublas.load_library()
        RESULT["env"]["cublaslt"] = getattr(cublas._lib, "_name", "?")
        log(f"cuBLASLt: {RESULT['env']['cublaslt']}")
    except Exception as exc:  # noqa: BLE001
        RESULT["failures"].append({"check": "cublas_load", "error": str(exc)})
        log(f"cuBLASLt load failed: {exc}")
    steps = [correctness, bench, capture]
    if RESULT["env"]["cc"] == 90:
        steps.append(lambda _cp: wgmma_all())
    for step in steps:
        try:
            step(cp)
        except Exception:  # noqa: BLE001
            RESULT["failures"].append(
                {"check": getattr(step, "__name__", "step"), "error": traceback.format_exc()[-3000:]}
            )
            log(f"step crashed:\n{traceback.format_exc()}")
        RESULT["timings"]["total_s"] = round(time.time() - T0, 1)
        (OUT / "blublas_gpu_check.json").write_text(json.dumps(RESULT, indent=1, default=str))  # after each step
    print("\n==== blublas gpu_check summary ====")
    for k, v in RESULT["checks"].items():
        print(f"{k:28s} pass {v['pass']:4d} fail {v['fail']:3d} worst err/tol {v['worst_err_over_tol']:.3f}")
    print(
        f"wgmma (sm_90a) validated: {RESULT.get('wgmma_validated')}; library self-test: "
        f"{RESULT.get('wgmma_auto_self_test')}"
    )
    for prec, s in RESULT.get("bench_summary", {}).items():
        print(
            f"bench {prec}: geomean {s['geomean_ratio']:.3f}x cuBLASLt (target {s['target_geomean']}), min "
            f"{s['min_ratio']:.3f} ({s['min_ratio_shape']}); vs torch {s.get('geomean_ratio_vs_torch')}; "
            f"cuBLASLt/torch {s.get('geomean_cublaslt_vs_torch')}"
        )
    print(
        f"failures: {len(RESULT['failures'])}; total {RESULT['timings']['total_s']}s; "
        f"json: {OUT / 'blublas_gpu_check.json'}, {OUT / 'blublas_gemm_h200.json'}"
    )


if __name__ == "__main__":
    if CHILD:
        child_main()
    else:
        main()
