"""BluBLAS SIMT (strict fp32) GPU check: correctness of every sm_90 SIMT config against float64 (odd sizes,
every layout, epilogues, split-K, batched, misaligned views), then the GPT-2 124M fp32 GEMM table
(B*T=16384): every candidate (config, split-K) timed per shape next to cuBLASLt (blublas' ctypes provider),
ratio per shape, geomean and min per config and for the best candidate, so one run tells which configs win.

Run from the repo root on the GPU machine (< 2.5 minutes on an H200; ~80 s of it is the NVRTC compile):
    python3 packages/blublas/dev/gpu_check_simt.py OUTDIR
BLUBLAS_CHECK_QUICK=1: fewer correctness shapes; BLUBLAS_SIMT_BENCH=default: the benchmark times only the
library's default (heuristic) choice per shape, not every candidate.
Writes OUTDIR/blublas_simt_check.json after every step and every benchmark shape.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve()
SRC = HERE.parents[1] / "src"
sys.path.insert(0, str(SRC))

OUT = Path(sys.argv[1] if len(sys.argv) > 1 else "blublas_simt_out")
OUT.mkdir(parents=True, exist_ok=True)
os.environ.setdefault("BLUBLAS_CACHE_DIR", str(OUT / "blublas_cache"))
os.environ["BLUBLAS_WGMMA"] = "0"  # fp32 has no wgmma variant; keep the other variants' self-tests out
T0 = time.time()
BUDGET_S = float(os.environ.get("BLUBLAS_SIMT_BUDGET_S", "140"))  # benchmark stops adding candidates after
QUICK = os.environ.get("BLUBLAS_CHECK_QUICK", "0") == "1"
BENCH_ALL = os.environ.get("BLUBLAS_SIMT_BENCH", "all") != "default"
RESULT: dict = {"env": {}, "checks": {}, "failures": [], "bench": [], "summary": {}, "timings": {}}
COMMAND = "python3 packages/blublas/dev/gpu_check_simt.py OUTDIR"
BASELINES = ("128x128x8_s4", "128x128x16_s3")  # the previous winners (cp.async pipeline)

from blublas.testing import gpt2_gemm_shapes  # noqa: E402 - after the sys.path insert

GPT2_SHAPES = gpt2_gemm_shapes()  # GPT-2 124M at B*T = 16384 (blublas.testing): fwd nt, dX nn, dW tn
SPLITS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14, 16)  # configs.SPLIT_CHOICES lacks 5, 7, 9-11, 14


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def save() -> None:
    RESULT["timings"]["total_s"] = round(time.time() - T0, 1)
    (OUT / "blublas_simt_check.json").write_text(json.dumps(RESULT, indent=1, default=str))


def record(check: str, ok: bool, err: float | None, desc: str, exc: str | None = None) -> None:
    c = RESULT["checks"].setdefault(check, {"pass": 0, "fail": 0, "worst_err_over_tol": 0.0})
    c["pass" if ok else "fail"] += 1
    if not ok:
        RESULT["failures"].append({"check": check, "case": desc, "err": err, "exception": exc})
        if len(RESULT["failures"]) <= 25:
            log(f"FAIL {check}: {desc} err={err} {exc or ''}")


def run_check(check: str, case, cp, **kw) -> None:
    from blublas.testing import check_case

    desc = case.describe() + f" {kw}"
    try:
        err = check_case(case, cp, "blublas", **kw)
        c = RESULT["checks"].setdefault(check, {"pass": 0, "fail": 0, "worst_err_over_tol": 0.0})
        c["worst_err_over_tol"] = max(c["worst_err_over_tol"], err / case.tol if math.isfinite(err) else 1e9)
        record(check, err <= case.tol, err, desc)
    except Exception:  # noqa: BLE001
        record(check, False, None, desc, traceback.format_exc(limit=3)[-1500:])


def simt_configs() -> list:
    """This device's SIMT configs, plus the previous (cp.async) winners as baselines."""
    from blublas import configs, loader

    out = configs.configs_for("simt", loader.compute_capability())
    return out + [configs.ALL_CONFIGS["simt"][n] for n in BASELINES if all(c.name != n for c in out)]


def correctness(cp) -> None:
    import numpy as np
    from blublas.testing import make_case

    rng = np.random.default_rng(0)
    t = time.time()
    shapes = [(1, 1, 1), (7, 5, 3), (130, 67, 19), (257, 129, 200), (256, 128, 64), (300, 270, 129)]
    shapes += [(257, 132, 200), (300, 260, 132), (129, 388, 516)]  # 16-byte path with ragged M/N, k tail
    for cfg in simt_configs():
        new = cfg.stages == 2
        for lay in ("nn", "nt", "tn"):
            for shp in shapes if new and not QUICK else shapes[2:4]:
                run_check("sweep", make_case(rng, *shp, layout=lay, bias="f32"), cp, config=cfg.name)
            if not new:
                continue
            for epi in (
                dict(bias="bf16"),
                dict(epilogue="gelu", bias="f32", save_preact=True),
                dict(alpha=0.5, beta=1.0),
                dict(alpha=-1.5, beta=0.25, bias="f32", epilogue="gelu", save_preact=True),
            ):
                run_check("epilogue", make_case(rng, 133, 200, 96, layout=lay, **epi), cp, config=cfg.name)
            for s in (3, 7):
                case = make_case(
                    rng, 96, 136, 1500, layout=lay, bias="f32", epilogue="gelu", save_preact=True, alpha=0.5, beta=0.5
                )
                run_check("split_k", case, cp, config=cfg.name, splits=s)
            run_check("split_k", make_case(rng, 200, 264, 4100, layout=lay), cp, config=cfg.name, splits=4)
            case = make_case(rng, 67, 140, 36, layout=lay, batch=3, bias="f32", epilogue="gelu", save_preact=True)
            run_check("batched", case, cp, config=cfg.name)
            misaligned(cp, rng, cfg.name, lay)
    RESULT["timings"]["correctness_s"] = round(time.time() - t, 1)
    log(f"correctness done ({time.time() - t:.1f}s): {RESULT['checks']}")


def misaligned(cp, rng, config: str, lay: str) -> None:
    """Operands that are views 4 bytes past a 16-byte boundary (ld a multiple of 4): the element-wise path."""
    import numpy as np
    from blublas import gemm

    m, n, k = 200, 136, 72
    ta, tb = lay[0] == "t", lay[1] == "t"
    ash, bsh = ((k, m) if ta else (m, k)), ((n, k) if tb else (k, n))
    a_h = rng.standard_normal((ash[0], ash[1] + 4)).astype(np.float32)
    b_h = rng.standard_normal((bsh[0], bsh[1] + 4)).astype(np.float32)
    desc = f"misaligned views {lay} {m}x{n}x{k} config={config}"
    try:
        a, b = cp.asarray(a_h)[:, 1 : 1 + ash[1]], cp.asarray(b_h)[:, 1 : 1 + bsh[1]]
        out = gemm(a, b, trans_a=ta, trans_b=tb, config=config).get().astype(np.float64)
        a64, b64 = a_h[:, 1 : 1 + ash[1]].astype(np.float64), b_h[:, 1 : 1 + bsh[1]].astype(np.float64)
        ref = (a64.T if ta else a64) @ (b64.T if tb else b64)
        scale = float(np.max(np.abs(a64.T if ta else a64) @ np.abs(b64.T if tb else b64)))
        err = float(np.max(np.abs(out - ref))) / scale
        record("misaligned", err <= 1e-5, err, desc)
    except Exception:  # noqa: BLE001
        record("misaligned", False, None, desc, traceback.format_exc(limit=3)[-1500:])


def _time_ms(cp, fn):
    """Mean ms per call (3 to 200 back-to-back calls filling ~20 ms): blublas.testing.time_ms."""
    from blublas.testing import time_ms

    return time_ms(cp, fn)


def splits_for(cfg, m: int, n: int, k: int) -> list[int]:
    """Split counts worth timing: 1, plus (K >= 4096) those that keep <= ~8 waves and a whole k-tile each."""
    from blublas import configs

    if k < 4096:
        return [1]
    tiles = -(-m // cfg.bm) * -(-n // cfg.bn)
    out = [1]
    for s in SPLITS[1:]:
        if tiles * s <= 2200 and configs.k_chunk_for(cfg, k, s)[1] == s and 4 * m * n * s <= (256 << 20):
            out.append(s)
    return out


def bench(cp) -> None:
    from blublas import configs

    t_all = time.time()
    bad = {  # configs that failed a correctness check are not benchmarked
        cn
        for f in RESULT["failures"]
        for cn in configs.ALL_CONFIGS["simt"]
        if re.search(rf"(?<!\w){re.escape(cn)}(?!\w)", str(f.get("case", "")))
    }
    cfgs = [c for c in simt_configs() if (c.stages == 2 or c.name in BASELINES) and c.name not in bad]
    RESULT["bench_configs"] = [c.name for c in cfgs]
    RESULT["excluded_failed"] = sorted(bad)
    for name, lay, m, n, k in GPT2_SHAPES:
        row = _bench_shape(cp, cfgs, name, lay, m, n, k)
        RESULT["bench"].append(row)
        cp.get_default_memory_pool().free_all_blocks()
        summarize()
        save()
    RESULT["timings"]["bench_s"] = round(time.time() - t_all, 1)


def _bench_shape(cp, cfgs: list, name: str, lay: str, m: int, n: int, k: int) -> dict:
    """cuBLASLt, the library's default choice and every (config, split) candidate
    on one GPT-2 shape (BLUBLAS_SIMT_BENCH=default: the default only); the best one checked against cuBLASLt."""
    from blublas import api, launch

    row = {"name": name, "layout": lay, "M": m, "N": n, "K": k, "candidates_ms": {}}
    flops = 2.0 * m * n * k
    try:
        ta, tb = lay[0] == "t", lay[1] == "t"
        a = cp.random.standard_normal((k, m) if ta else (m, k), dtype=cp.float32) * 0.5
        b = cp.random.standard_normal((n, k) if tb else (k, n), dtype=cp.float32) * 0.5
        out, ref = cp.empty((m, n), cp.float32), cp.empty((m, n), cp.float32)
        kw = dict(trans_a=ta, trans_b=tb, precision="fp32")
        ms_cublas = _time_ms(cp, lambda: api.gemm(a, b, ref, provider="cublas", **kw))
        row.update(cublaslt_ms=round(ms_cublas, 4), cublaslt_tflops=round(flops / ms_cublas / 1e9, 1))
        # the library's own choice when not autotuning (heuristic), timed through the plain call
        p = api.plan(a, b, out, alpha=1.0, beta=0.0, bias=None, epilogue="none", save_preact=None, batched=False, **kw)
        with cp.cuda.Device(p.device_id):
            dcfg, dsplit = launch.select(p, cp.cuda.get_current_stream(), None, None, False)
        ms_default = _time_ms(cp, lambda: api.gemm(a, b, out, autotune=False, **kw))
        row.update(
            default=f"{dcfg.name}/s{dsplit}",
            default_ms=round(ms_default, 4),
            default_ratio=round(ms_cublas / ms_default, 3),
        )
        for cfg in cfgs if BENCH_ALL else []:
            for s in splits_for(cfg, m, n, k):
                if time.time() - T0 > BUDGET_S and s > 1:
                    row["truncated"] = True
                    continue
                key = f"{cfg.name}/s{s}"
                try:
                    ms = _time_ms(cp, lambda c=cfg.name, s=s: api.gemm(a, b, out, config=c, splits=s, **kw))
                    row["candidates_ms"][key] = round(ms, 4)
                except Exception as exc:  # noqa: BLE001
                    row["candidates_ms"][key] = f"{type(exc).__name__}: {exc}"[:300]
        row["candidates_ms"].setdefault(row["default"], row["default_ms"])
        ok = {key: v for key, v in row["candidates_ms"].items() if isinstance(v, float)}
        if ok:
            best = min(ok, key=ok.get)
            c, s = best.split("/s")
            api.gemm(a, b, out, config=c, splits=int(s), **kw)
            row.update(
                best=best,
                best_ms=ok[best],
                best_tflops=round(flops / ok[best] / 1e9, 1),
                ratio=round(ms_cublas / ok[best], 3),
                max_rel_diff_vs_cublaslt=float(cp.max(cp.abs(out - ref)) / cp.max(cp.abs(ref))),
            )
            per_cfg = {}
            for key, v in ok.items():
                cn = key.split("/s")[0]
                per_cfg[cn] = min(per_cfg.get(cn, v), v)
            row["ratio_per_config"] = {cn: round(ms_cublas / v, 3) for cn, v in per_cfg.items()}
            log(
                f"{name:14s} {lay} {m}x{n}x{k}: default {row['default']} {row['default_ratio']:.3f}, "
                f"best {row['best_tflops']:5.1f} TF ({best}) cuBLASLt "
                f"{row['cublaslt_tflops']:5.1f} TF ratio {row['ratio']:.3f} "
                f"diff {row['max_rel_diff_vs_cublaslt']:.1e} | "
                + " ".join(f"{cn}:{r:.2f}" for cn, r in row["ratio_per_config"].items())
            )
        a = b = out = ref = None
    except Exception:  # noqa: BLE001
        row["error"] = traceback.format_exc(limit=4)[-2000:]
        log(f"BENCH ERROR {name}: {row['error']}")
    return row


def _geomean(xs: list[float]) -> float:
    return round(math.exp(sum(math.log(x) for x in xs) / len(xs)), 3) if xs else float("nan")


def summarize() -> None:
    from blublas import configs

    rows = [r for r in RESULT["bench"] if "ratio" in r]
    if not rows:
        return
    rs = [r["ratio"] for r in rows]
    s = {
        "best_geomean_ratio": _geomean(rs),
        "best_min_ratio": min(rs),
        "best_min_shape": min(rows, key=lambda r: r["ratio"])["name"],
        "shapes": len(rows),
        "meets_target": _geomean(rs) >= 0.9 and min(rs) >= 0.6 and len(rows) == len(GPT2_SHAPES),
    }
    ds = [r["default_ratio"] for r in rows if "default_ratio" in r]
    if ds:
        s["default_geomean_ratio"] = _geomean(ds)
        s["default_min_ratio"] = min(ds)
        s["default_meets_target"] = _geomean(ds) >= 0.9 and min(ds) >= 0.6 and len(ds) == len(GPT2_SHAPES)
    names = sorted({cn for r in rows for cn in r.get("ratio_per_config", {})})
    s["per_config"] = {}
    for cn in names:
        xs = [r["ratio_per_config"][cn] for r in rows if cn in r.get("ratio_per_config", {})]
        s["per_config"][cn] = {"geomean": _geomean(xs), "min": min(xs), "shapes": len(xs)}

    # the best choice when only the autotuner's split list (configs.SPLIT_CHOICES) is allowed
    def best_within(pred) -> list[float]:
        out = []
        for r in rows:
            ok = [v for key, v in r["candidates_ms"].items() if isinstance(v, float) and pred(key)]
            if ok:
                out.append(r["cublaslt_ms"] / min(ok))
        return out

    allowed = set(configs.SPLIT_CHOICES)
    xs = best_within(lambda key: int(key.split("/s")[1]) in allowed)
    s["best_with_autotuner_splits"] = {"geomean": _geomean(xs), "min": round(min(xs), 3) if xs else None}
    xs = best_within(lambda key: key.split("/s")[0] not in BASELINES)
    s["best_new_configs_only"] = {"geomean": _geomean(xs), "min": round(min(xs), 3) if xs else None}
    xs = best_within(lambda key: key.split("/s")[0] in BASELINES)
    s["best_baselines_only"] = {"geomean": _geomean(xs), "min": round(min(xs), 3) if xs else None}
    RESULT["summary"] = s


def main() -> None:
    import cupy as cp
    from blublas import __version__, loader

    dev = cp.cuda.Device()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"]
    RESULT["env"] = {
        "gpu": name.decode() if isinstance(name, bytes) else str(name),
        "cc": loader.compute_capability(),
        "sms": loader.sm_count(),
        "cupy": cp.__version__,
        "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
        "blublas": __version__,
        "command": COMMAND,
    }
    log(f"env {RESULT['env']}")
    t = time.time()
    try:
        loader.get_module("gemm_simt_f32.cu")
        loader.get_module("gemm_epilogue.cu")
    except Exception:  # noqa: BLE001
        RESULT["failures"].append({"check": "compile", "case": "", "exception": traceback.format_exc()[-3000:]})
        log(f"COMPILE FAILED:\n{traceback.format_exc()[-3000:]}")
        save()
        return
    RESULT["timings"]["compile_s"] = round(time.time() - t, 1)
    log(f"compiled gemm_simt_f32.cu in {time.time() - t:.1f}s")
    try:
        from blublas import cublas

        cublas.load_library()
    except Exception as exc:  # noqa: BLE001
        RESULT["failures"].append({"check": "cublas_load", "case": "", "exception": str(exc)})
    for step in (correctness, bench):
        try:
            step(cp)
        except Exception:  # noqa: BLE001
            RESULT["failures"].append({"check": step.__name__, "case": "", "exception": traceback.format_exc()[-3000:]})
            log(f"step {step.__name__} crashed:\n{traceback.format_exc()}")
        save()
    print("\n==== blublas SIMT gpu check ====")
    for k, v in RESULT["checks"].items():
        print(f"{k:12s} pass {v['pass']:4d} fail {v['fail']:3d} worst err/tol {v['worst_err_over_tol']:.3f}")
    s = RESULT.get("summary", {})
    if s:
        print(
            f"best: geomean {s['best_geomean_ratio']} x cuBLASLt, min {s['best_min_ratio']} ({s['best_min_shape']}), "
            f"meets target: {s['meets_target']}; autotuner splits only {s['best_with_autotuner_splits']}; "
            f"new configs only {s['best_new_configs_only']}; baselines only {s['best_baselines_only']}"
        )
        print(
            f"library default (heuristic, no autotune): geomean {s.get('default_geomean_ratio')} min "
            f"{s.get('default_min_ratio')} meets target: {s.get('default_meets_target')}"
        )
        for cn, v in s["per_config"].items():
            print(f"  {cn:16s} geomean {v['geomean']:.3f} min {v['min']:.3f} over {v['shapes']} shapes")
    print(f"failures: {len(RESULT['failures'])}; {time.time() - T0:.1f}s; json: {OUT / 'blublas_simt_check.json'}")


if __name__ == "__main__":
    main()
