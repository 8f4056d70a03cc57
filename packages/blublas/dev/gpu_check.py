"""BluBLAS GPU check: correctness of every kernel variant/config/layout/epilogue against NumPy float64,
both providers inside CUDA graph capture, and the GPT-2 124M GEMM benchmark (B*T=16384) against cuBLASLt.

Run from the repo root on the GPU machine:
    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 packages/blublas/dev/gpu_check.py $OUT
Writes $OUT/blublas_gpu_check.json (and the autotune cache under $OUT/blublas_cache/) and prints a summary.
Budget: < 3 minutes on an H200 (kernels compile in parallel subprocesses first).
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
    from blublas import launch

    RESULT["wgmma_auto_self_test"] = {"|".join(map(str, k)): v for k, v in launch._probe_results.items()}
    log(f"wgmma auto self-test results: {RESULT['wgmma_auto_self_test']}")
    if cc == 90:
        wgmma_checks(cp, rng)


def wgmma_checks(cp, rng) -> None:
    """The sm_90a wgmma variants (BF16 all layouts, TF32 NT; opt-in via BLUBLAS_WGMMA=1): validated here,
    benchmarked only if every check passed."""
    from blublas import configs
    from blublas.testing import make_case

    os.environ["BLUBLAS_WGMMA"] = "1"
    t = time.time()
    before = len(RESULT["failures"])
    shapes = [(1, 1, 1), (7, 5, 3), (130, 67, 19), (257, 129, 200), (256, 256, 64), (300, 270, 129), (128, 512, 1024)]
    for cfg in configs.configs_for("wgmma", 90):
        for lay in configs.LAYOUTS:
            for shp in shapes:
                case = make_case(rng, *shp, layout=lay, precision="bf16", bias="f32")
                run_check("wgmma_config_sweep", case, cp, config=cfg.name)
            for obf in (True, False):
                case = make_case(
                    rng,
                    133,
                    200,
                    96,
                    layout=lay,
                    precision="bf16",
                    out_bf16=obf,
                    bias="f32",
                    epilogue="gelu",
                    save_preact=True,
                    alpha=0.5,
                    beta=0.5,
                )
                run_check("wgmma_epilogue", case, cp, config=cfg.name)
            case = make_case(
                rng, 96, 300, 1500, layout=lay, precision="bf16", bias="f32", epilogue="gelu", save_preact=True
            )
            run_check("wgmma_split_k", case, cp, config=cfg.name, splits=3)
            case = make_case(rng, 67, 130, 70, layout=lay, precision="bf16", batch=3)
            run_check("wgmma_batched", case, cp, config=cfg.name)
    for cfg in configs.configs_for("wgmma_tf32", 90):  # NT only
        for shp in shapes:
            case = make_case(rng, *shp, layout="nt", precision="tf32", bias="f32")
            run_check("wgmma_tf32_config_sweep", case, cp, config=cfg.name)
        case = make_case(
            rng,
            133,
            200,
            96,
            layout="nt",
            precision="tf32",
            bias="f32",
            epilogue="gelu",
            save_preact=True,
            alpha=0.5,
            beta=0.5,
        )
        run_check("wgmma_tf32_epilogue", case, cp, config=cfg.name)
        case = make_case(
            rng, 96, 300, 1500, layout="nt", precision="tf32", bias="f32", epilogue="gelu", save_preact=True
        )
        run_check("wgmma_tf32_split_k", case, cp, config=cfg.name, splits=3)
        case = make_case(rng, 67, 130, 70, layout="nt", precision="tf32", batch=3)
        run_check("wgmma_tf32_batched", case, cp, config=cfg.name)
    ok = len(RESULT["failures"]) == before and any(k.startswith("wgmma") for k in RESULT["checks"])
    RESULT["wgmma_validated"] = ok
    if not ok:
        os.environ["BLUBLAS_WGMMA"] = "0"
    RESULT["timings"]["wgmma_checks_s"] = round(time.time() - t, 1)
    log(f"wgmma checks done: validated={ok} ({time.time() - t:.1f}s); benchmark {'with' if ok else 'without'} wgmma")


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


GPT2_SHAPES = [  # (name, layout, M, N, K) with weights stored (out, in) like torch.nn.Linear
    ("fwd_qkv", "nt", 16384, 2304, 768),
    ("fwd_attn_proj", "nt", 16384, 768, 768),
    ("fwd_fc", "nt", 16384, 3072, 768),
    ("fwd_fc_proj", "nt", 16384, 768, 3072),
    ("fwd_lm_head", "nt", 16384, 50304, 768),
    ("dx_qkv", "nn", 16384, 768, 2304),
    ("dx_attn_proj", "nn", 16384, 768, 768),
    ("dx_fc", "nn", 16384, 768, 3072),
    ("dx_fc_proj", "nn", 16384, 3072, 768),
    ("dx_lm_head", "nn", 16384, 768, 50304),
    ("dw_qkv", "tn", 2304, 768, 16384),
    ("dw_attn_proj", "tn", 768, 768, 16384),
    ("dw_fc", "tn", 3072, 768, 16384),
    ("dw_fc_proj", "tn", 768, 3072, 16384),
    ("dw_lm_head", "tn", 50304, 768, 16384),
]


def _time_ms(cp, fn, warmup: int = 2, reps: int = 5) -> float:
    for _ in range(warmup):
        fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / reps


def bench_one(cp, prec: str, name: str, lay: str, m: int, n: int, k: int, row: dict) -> None:
    """Time our best candidate and cuBLASLt on one GPT-2 shape; fill ``row``."""
    from blublas import api, configs, loader

    cc, sms = loader.compute_capability(), loader.sm_count()
    variant = configs.VARIANT_OF_PRECISION[prec]
    dt = cp.uint16 if prec == "bf16" else cp.float32
    ta, tb = lay[0] == "t", lay[1] == "t"
    a = cp.random.standard_normal((k, m) if ta else (m, k), dtype=cp.float32) * 0.5
    b = cp.random.standard_normal((n, k) if tb else (k, n), dtype=cp.float32) * 0.5
    if prec == "bf16":  # truncate to bf16 bits (fine for timing and for the comparison)
        a = (a.view(cp.uint32) >> 16).astype(cp.uint16)
        b = (b.view(cp.uint32) >> 16).astype(cp.uint16)
    ours, ref = cp.empty((m, n), dt), cp.empty((m, n), dt)
    kw = dict(trans_a=ta, trans_b=tb, precision=prec)
    heur = configs.choose(
        variant, cc, m, n, k, 1, sms=sms, out_bytes=2 if prec == "bf16" else 4, precision=prec, layout=lay
    )
    cands = {(heur[0].name, heur[1])}
    for v in configs.variants_for(prec, cc):
        for cfg in configs.configs_for(v, cc):
            if lay not in cfg.layouts:
                continue
            cands.add((cfg.name, 1))
            if heur[1] > 1:
                cands.add((cfg.name, heur[1]))
    timings = {}
    for cname, s in sorted(cands):
        timings[f"{cname}/s{s}"] = _time_ms(
            cp, lambda c=cname, s=s: api.gemm(a, b, ours, config=c, splits=s, **kw), 1, 3
        )
    best = min(timings, key=timings.get)
    bcfg, bs = best.split("/s")
    ms_ours = _time_ms(cp, lambda: api.gemm(a, b, ours, config=bcfg, splits=int(bs), **kw))
    baseline = "cublasLt (blublas ctypes provider)"
    try:
        ms_cublas = _time_ms(cp, lambda: api.gemm(a, b, ref, provider="cublas", **kw))
    except Exception as exc:  # noqa: BLE001 - keep a baseline for fp32: CuPy's own cuBLAS call
        if prec != "fp32":
            raise
        row["cublas_provider_error"] = f"{type(exc).__name__}: {exc}"[:500]
        baseline = "cupy.matmul"

        def cupy_mm():
            ref[...] = cp.matmul(a.T if ta else a, b.T if tb else b)

        ms_cublas = _time_ms(cp, cupy_mm)
    row["baseline"] = baseline
    flops = 2.0 * m * n * k
    if prec == "bf16":
        o = (ours.astype(cp.uint32) << 16).view(cp.float32)
        r = (ref.astype(cp.uint32) << 16).view(cp.float32)
    else:
        o, r = ours, ref
    rel = float(cp.max(cp.abs(o - r)) / cp.max(cp.abs(r)))
    hkey = f"{heur[0].name}/s{heur[1]}"
    row.update(
        ours_ms=round(ms_ours, 4),
        cublas_ms=round(ms_cublas, 4),
        ours_tflops=round(flops / ms_ours / 1e9, 1),
        cublas_tflops=round(flops / ms_cublas / 1e9, 1),
        ratio=round(ms_cublas / ms_ours, 3),
        config=bcfg,
        splits=int(bs),
        heuristic=hkey,
        heuristic_ms=round(timings[hkey], 4),
        candidates_ms={k2: round(v, 4) for k2, v in timings.items()},
        max_rel_diff_vs_cublas=rel,
    )
    if prec == "fp32":
        row["cupy_matmul_ms"] = round(_time_ms(cp, lambda: cp.matmul(a.T if ta else a, b.T if tb else b)), 4)
    log(
        f"{prec:4s} {name:14s} {lay} {m}x{n}x{k}: ours {row['ours_tflops']:6.1f} TF ({bcfg}/s{bs}) "
        f"cublas {row['cublas_tflops']:6.1f} TF ratio {row['ratio']:.3f} diff {rel:.1e}"
    )


def bench(cp) -> None:
    t_all = time.time()
    precs = ("bf16", "tf32", "fp32")
    for prec in precs:
        for name, lay, m, n, k in GPT2_SHAPES:
            if time.time() - T0 > 165:
                log("time budget reached: skipping the remaining benchmark shapes")
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
    summary = {}
    for prec in precs:
        rs = [r["ratio"] for r in RESULT["bench"] if r["precision"] == prec and "ratio" in r]
        if rs:
            summary[prec] = {
                "geomean_ratio": round(math.exp(sum(math.log(x) for x in rs) / len(rs)), 3),
                "min_ratio": min(rs),
                "shapes": len(rs),
                "target": {"fp32": 0.90, "tf32": 0.90, "bf16": 0.85}[prec],
            }
    RESULT["bench_summary"] = summary
    RESULT["timings"]["bench_s"] = round(time.time() - t_all, 1)


def main() -> None:
    import cupy as cp
    from blublas import __version__, loader

    dev = cp.cuda.Device()
    RESULT["env"] = {
        "gpu": cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode(),
        "cc": loader.compute_capability(),
        "sms": loader.sm_count(),
        "cupy": cp.__version__,
        "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
        "blublas": __version__,
    }
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
    for step in (correctness, capture, bench):
        try:
            step(cp)
        except Exception:  # noqa: BLE001
            RESULT["failures"].append({"check": step.__name__, "error": traceback.format_exc()[-3000:]})
            log(f"{step.__name__} crashed:\n{traceback.format_exc()}")
        RESULT["timings"]["total_s"] = round(time.time() - T0, 1)
        (OUT / "blublas_gpu_check.json").write_text(json.dumps(RESULT, indent=1, default=str))  # after each step
    print("\n==== blublas gpu_check summary ====")
    for k, v in RESULT["checks"].items():
        print(f"{k:28s} pass {v['pass']:4d} fail {v['fail']:3d} worst err/tol {v['worst_err_over_tol']:.3f}")
    print(f"wgmma (sm_90a) validated: {RESULT.get('wgmma_validated')}")
    for prec, s in RESULT.get("bench_summary", {}).items():
        print(
            f"bench {prec}: geomean {s['geomean_ratio']:.3f}x cuBLAS (target {s['target']}), min {s['min_ratio']:.3f}"
        )
    print(
        f"failures: {len(RESULT['failures'])}; total {RESULT['timings']['total_s']}s; "
        f"json: {OUT / 'blublas_gpu_check.json'}"
    )


if __name__ == "__main__":
    main()
