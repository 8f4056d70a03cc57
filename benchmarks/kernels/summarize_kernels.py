"""Summarize a bench_kernels.py pytest-benchmark JSON: per (kernel, shape, dtype, pass, causal) BluTrain's and
PyTorch's kernel time, the speedup, and for memory-bound kernels the fraction of the device-copy bandwidth
(the aim: >= 0.8 of the copy bandwidth).

    python3 benchmarks/kernels/summarize_kernels.py BENCH.json OUT.json [commit]
"""

from __future__ import annotations

import json
import sys

AIM = 0.8
COMMAND = ("pytest benchmarks/kernels/bench_kernels.py --benchmark-json=BENCH.json && "
           "python3 benchmarks/kernels/summarize_kernels.py BENCH.json OUT.json")


def summarize(bench: dict, commit: str = "") -> dict:
    """The results document of one pytest-benchmark run of bench_kernels.py."""
    rows: dict = {}
    for b in bench.get("benchmarks", []):
        e = b.get("extra_info", {})
        if "impl" not in e or "device_ms" not in e:
            continue
        key = (e["kernel"], e["shape"], e["dtype"], e.get("pass_"), e.get("causal"))
        r = rows.setdefault(key, {"kernel": key[0], "shape": key[1], "dtype": key[2], "pass": key[3], "causal": key[4]})
        r[f"{e['impl']}_ms"] = round(e["device_ms"], 5)
        if e["impl"] == "blutrain":
            for k in ("frac_copy_bw", "GBps", "TFLOPs"):
                if e.get(k) is not None:
                    r[k] = round(e[k], 3)
    out = []
    for r in rows.values():
        if "blutrain_ms" in r and "torch_ms" in r:
            r["speedup_vs_torch"] = round(r["torch_ms"] / r["blutrain_ms"], 3)
        if "frac_copy_bw" in r:
            r["meets_bw_aim"] = r["frac_copy_bw"] >= AIM
        out.append(r)
    bw = [r for r in out if "frac_copy_bw" in r]
    return {
        "what": "blutensor CUDA kernels beside PyTorch on GPT-2 124M's training shapes (median device ms of "
        "back-to-back calls between CUDA events); memory-bound kernels as a fraction of the measured device-copy "
        f"bandwidth (aim >= {AIM})",
        "command": COMMAND,
        "commit": commit,
        "memory_bound_meeting_aim": f"{sum(r['meets_bw_aim'] for r in bw)} of {len(bw)}",
        "rows": out,
    }


def main() -> None:
    res = summarize(json.load(open(sys.argv[1])), sys.argv[3] if len(sys.argv) > 3 else "")
    with open(sys.argv[2], "w") as f:
        json.dump(res, f, indent=1)
    for r in res["rows"]:
        if r["kernel"] != "attention" or r["shape"].startswith("T=1024 16x"):
            print(f"{r['kernel']:28s} {r['shape']:22s} {r['dtype']:5s} {r['pass'] or '':4s} causal={r['causal']} "
                  f"blutrain {r.get('blutrain_ms')} torch {r.get('torch_ms')} x{r.get('speedup_vs_torch')} "
                  f"bw {r.get('frac_copy_bw')}")
    print("memory-bound kernels meeting the bandwidth aim:", res["memory_bound_meeting_aim"])


if __name__ == "__main__":
    main()
