"""Turn a benchmarks/blublas/bench_gemm_configs.py result (run on an sm_90 GPU) into the shipped table of measured
best (config, splits) per GPT-2 shape (src/blublas/tuned_sm90.json), which launch.select consults after the user's
autotune cache and before the cost model. Usage:
    python3 benchmarks/blublas/bench_gemm_configs.py --precision bf16 --precision tf32 --out CONFIGS.json
    python3 packages/blublas/dev/make_tuned_table.py CONFIGS.json"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE / "src"))


def main(path: str) -> None:
    from blublas.autotune import problem_key

    doc = json.loads(Path(path).read_text())
    if doc.get("env", {}).get("cc") != 90:
        sys.exit(f"{path}: measured on compute capability {doc.get('env', {}).get('cc')}, the table is for sm_90")
    table = {}
    for prec in ("bf16", "tf32"):
        for r in doc["precisions"].get(prec, {}).get("rows", []):
            ok = {k: v for k, v in r.get("candidates_ms", {}).items() if isinstance(v, float)}
            if not ok:
                continue
            best = min(ok, key=ok.get)
            variant, cname_s = best.split(":", 1)
            cname, s = cname_s.rsplit("/s", 1)
            key = problem_key(90, prec, r["layout"], r["M"], r["N"], r["K"], 1, "bf16" if prec == "bf16" else "f32")
            flops = 2.0 * r["M"] * r["N"] * r["K"]
            table[key] = {"config": cname, "splits": int(s), "tflops": round(flops / ok[best] / 1e9, 1)}
    out = HERE / "src" / "blublas" / "tuned_sm90.json"
    out.write_text(
        json.dumps({"source": doc.get("env", {}).get("gpu", "?"), "entries": table}, indent=1, sort_keys=True) + "\n"
    )
    print(f"{len(table)} entries -> {out}")


if __name__ == "__main__":
    main(sys.argv[1])
