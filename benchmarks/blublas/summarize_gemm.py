"""Summarize a bench_gemm.py pytest-benchmark JSON into the BluBLAS results file: per precision, BluBLAS over
cuBLASLt per shape (kernel time inside CUDA graphs, and eager per-call time), geometric means and minima
against the targets (fp32 and tf32 >= 0.90, bf16 >= 0.85, no shape below 0.6).

    python3 benchmarks/blublas/summarize_gemm.py BENCH.json OUT.json [commit]
"""

from __future__ import annotations

import json
import math
import sys

TARGETS = {"fp32": 0.90, "tf32": 0.90, "bf16": 0.85}
MIN_RATIO = 0.6
COMMAND = (
    "pytest benchmarks/blublas/bench_gemm.py --benchmark-json=BENCH.json && "
    "python3 benchmarks/blublas/summarize_gemm.py BENCH.json OUT.json"
)


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summarize(bench: dict, commit: str = "") -> dict:
    """The results document of one pytest-benchmark run of bench_gemm.py."""
    rows: dict = {}
    gpu = ""
    for b in bench.get("benchmarks", []):
        e = b.get("extra_info", {})
        if "provider" not in e:
            continue
        gpu = e.get("gpu", gpu)
        r = rows.setdefault((e["precision"], e["name"]), {"name": e["name"], "layout": e["layout"],
                                                          "M": e["M"], "N": e["N"], "K": e["K"]})
        pre = "ours" if e["provider"] == "blublas" else "cublaslt"
        r[f"{pre}_kernel_ms"], r[f"{pre}_tflops"] = e["kernel_ms"], e["tflops"]
        r[f"{pre}_eager_ms"] = e["eager_ms"]
        if pre == "ours":
            r["config"], r["splits"] = e.get("config"), e.get("splits")
    out: dict = {"what": "BluBLAS vs cuBLASLt (same process, same GPU) on GPT-2 124M's GEMMs at B*T=16384; "
                 "ratio = cuBLASLt time / BluBLAS time, from kernel time inside CUDA graphs (ratio) and from "
                 "eager per-call time including each provider's Python planning (ratio_eager)",
                 "command": COMMAND, "commit": commit, "gpu": gpu, "precisions": {}}
    for prec in TARGETS:
        rs = [r for (p, _), r in sorted(rows.items())
              if p == prec and "ours_kernel_ms" in r and "cublaslt_kernel_ms" in r]
        for r in rs:
            r["ratio"] = round(r["cublaslt_kernel_ms"] / r["ours_kernel_ms"], 3)
            r["ratio_eager"] = round(r["cublaslt_eager_ms"] / r["ours_eager_ms"], 3)
        if not rs:
            continue
        worst = min(rs, key=lambda r: r["ratio"])
        gm = round(geomean([r["ratio"] for r in rs]), 3)
        out["precisions"][prec] = {
            "geomean_ratio": gm,
            "min_ratio": worst["ratio"],
            "min_shape": worst["name"],
            "geomean_ratio_eager": round(geomean([r["ratio_eager"] for r in rs]), 3),
            "min_ratio_eager": min(r["ratio_eager"] for r in rs),
            "target_geomean": TARGETS[prec],
            "shapes": len(rs),
            "meets_target": gm >= TARGETS[prec] and worst["ratio"] >= MIN_RATIO and len(rs) == 15,
            "rows": rs,
        }
    return out


def main() -> None:
    bench = json.load(open(sys.argv[1]))
    res = summarize(bench, sys.argv[3] if len(sys.argv) > 3 else "")
    with open(sys.argv[2], "w") as f:
        json.dump(res, f, indent=1)
    for prec, s in res["precisions"].items():
        print(f"{prec}: graph geomean {s['geomean_ratio']}x cuBLASLt (target {s['target_geomean']}), min "
              f"{s['min_ratio']} ({s['min_shape']}); eager geomean {s['geomean_ratio_eager']}, min "
              f"{s['min_ratio_eager']}; meets target: {s['meets_target']}")


if __name__ == "__main__":
    main()
