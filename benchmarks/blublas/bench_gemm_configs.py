"""Every BluBLAS tile config on GPT-2 124M's GEMMs (B*T=16384) beside cuBLASLt: which config wins each shape.

    python3 benchmarks/blublas/bench_gemm_configs.py [--precision fp32|tf32|bf16 ...] [--out OUT.json]

For each precision and shape: cuBLASLt (blublas' own cuBLASLt provider), the library's heuristic choice (no
autotuning) and every (config, split-K) candidate the autotuner would consider (``configs.candidates`` of every
variant serving the precision on this GPU: mma.sync / SIMT and, on sm_90, the TMA wgmma kernels), each timed with
CUDA events over back-to-back calls (``blublas.testing.time_ms``); the winner is also timed inside a CUDA graph
(``graph_ms``, host out of the loop) and checked against cuBLASLt's output. The summary gives, per precision,
the geometric mean and minimum of cuBLASLt time / BluBLAS time for the best candidate and for the heuristic, and
per config. The JSON (default ``benchmarks/results/blublas_gemm_configs_<gpu>.json``) is what
``packages/blublas/dev/make_tuned_table.py`` turns into the shipped sm_90 table. The library's switches
(``BLUBLAS_WGMMA_TMA_STORE=0``: the staged epilogue instead of TMA stores) apply as in any run; the JSON records
the values in force, as ``blublas.settings`` read them (``env.settings``), not what ``os.environ`` says later.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
import traceback
from dataclasses import fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _geomean(xs: list[float]) -> float | None:
    return round(math.exp(sum(math.log(x) for x in xs) / len(xs)), 3) if xs else None


def settings_in_force() -> dict:
    """Every blublas switch as ``blublas.settings.get()`` holds it (read once, at the first use; what the GEMMs of
    this run use), by field name; paths as strings."""
    from blublas import settings

    s = settings.get()
    return {f.name: str(v) if isinstance(v := getattr(s, f.name), Path) else v for f in fields(s)}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def _operands(cp, prec: str, lay: str, m: int, n: int, k: int):
    ta, tb = lay[0] == "t", lay[1] == "t"
    a = cp.random.standard_normal((k, m) if ta else (m, k), dtype=cp.float32) * 0.5
    b = cp.random.standard_normal((n, k) if tb else (k, n), dtype=cp.float32) * 0.5
    dt = cp.float32
    if prec == "bf16":  # the top 16 bits: bf16 values (truncated; fine for timing and the cross-provider check)
        a = (a.view(cp.uint32) >> 16).astype(cp.uint16)
        b = (b.view(cp.uint32) >> 16).astype(cp.uint16)
        dt = cp.uint16
    return a, b, cp.empty((m, n), dt), cp.empty((m, n), dt)


def bench_shape(cp, prec: str, name: str, lay: str, m: int, n: int, k: int) -> dict:
    from blublas import api, configs, cublas, loader
    from blublas.testing import graph_ms, time_ms

    cc = loader.compute_capability()
    a, b, out, ref = _operands(cp, prec, lay, m, n, k)
    kw = dict(trans_a=lay[0] == "t", trans_b=lay[1] == "t", precision=prec)
    flops = 2.0 * m * n * k
    row: dict = {"name": name, "layout": lay, "M": m, "N": n, "K": k, "candidates_ms": {}}
    n_log = len(cublas.TUNING_LOG)
    ms_cub = time_ms(cp, lambda: api.gemm(a, b, ref, provider="cublas", **kw))
    row.update(cublaslt_ms=round(ms_cub, 4), cublaslt_tflops=round(flops / ms_cub / 1e9, 1))
    if len(cublas.TUNING_LOG) > n_log:  # cuBLASLt's top heuristic algorithms, timed once for this problem
        tl = cublas.TUNING_LOG[n_log]
        row["cublaslt_tuning"] = {"algos": tl["algos"], "heuristic_first_ms": round(tl["first_ms"], 4),
                                  "best_ms": round(tl["best_ms"], 4), "best_index": tl["best_index"]}
    ms_h = time_ms(cp, lambda: api.gemm(a, b, out, autotune=False, **kw))
    row.update(heuristic_ms=round(ms_h, 4), heuristic_ratio=round(ms_cub / ms_h, 3))
    for cfg, s in configs.candidates_for_precision(prec, cc, m, n, k, 1, lay):
        key = f"{cfg.variant}:{cfg.name}/s{s}"
        try:
            ms = time_ms(cp, lambda c=cfg.name, s=s: api.gemm(a, b, out, config=c, splits=s, **kw), max_reps=100)
            row["candidates_ms"][key] = round(ms, 4)
        except Exception as exc:  # noqa: BLE001 - a config this shape cannot use is recorded, not fatal
            row["candidates_ms"][key] = f"{type(exc).__name__}: {exc}"[:300]
    ok = {key: v for key, v in row["candidates_ms"].items() if isinstance(v, float)}
    if ok:
        best = min(ok, key=ok.get)
        cname, s = best.split(":", 1)[1].rsplit("/s", 1)
        api.gemm(a, b, out, config=cname, splits=int(s), **kw)
        api.gemm(a, b, ref, provider="cublas", **kw)
        o, r = (out, ref) if prec != "bf16" else ((x.astype(cp.uint32) << 16).view(cp.float32) for x in (out, ref))
        g_ours = graph_ms(cp, lambda: api.gemm(a, b, out, config=cname, splits=int(s), **kw))
        g_cub = graph_ms(cp, lambda: api.gemm(a, b, ref, provider="cublas", **kw))
        row.update(
            best=best,
            best_ms=ok[best],
            best_tflops=round(flops / ok[best] / 1e9, 1),
            ratio=round(ms_cub / ok[best], 3),
            ratio_graph=round(g_cub / g_ours, 3),
            max_rel_diff_vs_cublaslt=float(cp.max(cp.abs(o - r)) / cp.max(cp.abs(r))),
        )
        per_cfg: dict = {}
        for key, v in ok.items():
            cn = key.split("/s")[0]
            per_cfg[cn] = min(per_cfg.get(cn, v), v)
        row["ratio_per_config"] = {cn: round(ms_cub / v, 3) for cn, v in per_cfg.items()}
    return row


def summarize(rows: list[dict]) -> dict:
    good = [r for r in rows if "ratio" in r]
    s: dict = {"shapes": len(good)}
    if not good:
        return s
    worst = min(good, key=lambda r: r["ratio"])
    s.update(
        best_geomean_ratio=_geomean([r["ratio"] for r in good]),
        best_min_ratio=worst["ratio"],
        best_min_shape=worst["name"],
        best_geomean_ratio_graph=_geomean([r["ratio_graph"] for r in good]),
        heuristic_geomean_ratio=_geomean([r["heuristic_ratio"] for r in good]),
        heuristic_min_ratio=min(r["heuristic_ratio"] for r in good),
    )
    per: dict = {}
    for r in good:
        for cn, v in r["ratio_per_config"].items():
            per.setdefault(cn, []).append(v)
    s["per_config"] = {cn: {"geomean": _geomean(v), "min": min(v), "shapes": len(v)} for cn, v in per.items()}
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", action="append", choices=("fp32", "tf32", "bf16"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import cupy as cp
    from blublas import __version__, cublas, loader
    from blublas.testing import gpt2_gemm_shapes

    cublas.load_library()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    out = args.out or ROOT / "benchmarks" / "results" / f"blublas_gemm_configs_{gpu.split()[-1].lower()}.json"
    precs = args.precision or ["fp32", "tf32", "bf16"]
    doc: dict = {
        "what": "every BluBLAS (config, split-K) candidate vs cuBLASLt on GPT-2 124M's GEMMs at B*T=16384; "
        "ratio = cuBLASLt ms / BluBLAS ms (eager, CUDA events), ratio_graph: both inside CUDA graphs",
        "command": "python3 benchmarks/blublas/bench_gemm_configs.py" + "".join(f" --precision {p}" for p in precs),
        "commit": _commit(),
        "env": {
            "gpu": gpu,
            "cc": loader.compute_capability(),
            "sms": loader.sm_count(),
            "cupy": cp.__version__,
            "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(),
            "blublas": __version__,
            "settings": settings_in_force(),
        },
        "precisions": {},
    }
    t0 = time.time()
    for prec in precs:
        rows = doc["precisions"].setdefault(prec, {"rows": []})["rows"]
        for name, lay, m, n, k in gpt2_gemm_shapes():
            try:
                row = bench_shape(cp, prec, name, lay, m, n, k)
            except Exception:  # noqa: BLE001 - one failing shape is recorded; the others still run
                row = {"name": name, "layout": lay, "M": m, "N": n, "K": k, "error": traceback.format_exc()[-2000:]}
            rows.append(row)
            cp.get_default_memory_pool().free_all_blocks()
            print(f"[{time.time() - t0:6.1f}s] {prec} {name} {lay}: best {row.get('best')} ratio {row.get('ratio')} "
                  f"(graph {row.get('ratio_graph')}), heuristic {row.get('heuristic_ratio')}", flush=True)
        doc["precisions"][prec]["summary"] = summarize(rows)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1, default=str) + "\n")  # after each precision
    for prec, p in doc["precisions"].items():
        print(f"{prec}: {json.dumps({k: v for k, v in p['summary'].items() if k != 'per_config'})}")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
