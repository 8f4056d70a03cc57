"""GPU checks of dtms orchestration (run on the GPU machine from the repo root):

    python3 packages/dtms/dev/gpu_check_orchestrator.py OUT_DIR

1. NVML/CuPy telemetry returns readings for every visible GPU (temperature, utilisation, ECC counts,
   throttle reasons with pynvml; memory with CuPy only), and how long one reading takes.
2. A 1-rank orchestrated toy job on the GPU (direct launcher, local backend) with the metrics endpoint:
   the scraped metrics carry the GPU gauges, the run succeeds; then the same job with the rank killed at
   step 8 restarts once and ends with the same final weights.
Writes OUT_DIR/gpu_check_orchestrator.json. Needs only python3, numpy and CuPy (pynvml optional).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
WORKER = ROOT / "packages" / "dtms" / "tests" / "workers" / "fault_toy.py"


def run_job(run: Path, fault: list, scrape: bool) -> dict:
    env = dict(os.environ, FAULT_SPEC=json.dumps(fault), BLUTRAIN_DIST_BACKEND="local", BLUTRAIN_DETERMINISTIC="1",
               PYTHONPATH=os.pathsep.join(sys.path[:7] + [os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "dtms.orchestrate", "--run-dir", str(run), "--nproc-per-node", "1",
           "--heartbeat-interval", "0.1", "--heartbeat-timeout", "5", "--metrics-port", "0", "--quiet",
           str(WORKER), "--out", str(run / "job"), "--steps", "40", "--ckpt-every", "5", "--step-sleep", "0.05"]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    gpu_lines: list[str] = []
    while p.poll() is None and scrape:
        try:
            url = json.loads((run / "metrics.json").read_text())["url"]
            text = urllib.request.urlopen(url, timeout=2).read().decode()
            gpu_lines = [ln for ln in text.splitlines() if ln.startswith("blutrain_gpu_")] or gpu_lines
        except Exception:
            pass
        time.sleep(0.2)
    out, _ = p.communicate(timeout=300)
    state = json.loads((run / "orchestrator_state.json").read_text())
    return {"rc": p.returncode, "seconds": time.perf_counter() - t0, "restarts": state["restarts"],
            "incidents": [i["fault"] for i in state["incidents"]], "gpu_metric_lines": gpu_lines[:12],
            "tail": out[-1500:] if p.returncode else ""}


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu_check_out")
    out.mkdir(parents=True, exist_ok=True)
    from dtms.orchestrator import gpu_telemetry

    res: dict = {}
    t0 = time.perf_counter()
    tel = gpu_telemetry()
    res["telemetry_ms"] = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    gpu_telemetry(0)
    res["telemetry_again_ms"] = (time.perf_counter() - t0) * 1e3
    res["telemetry"] = tel
    res["telemetry_ok"] = bool(tel) and all("memory_used_bytes" in g for g in tel)
    import tempfile

    import numpy as np

    with tempfile.TemporaryDirectory() as d:
        clean = run_job(Path(d) / "clean", [], scrape=True)
        killed = run_job(Path(d) / "killed", [{"kind": "kill", "rank": 0, "step": 8}], scrape=False)
        same = bool(np.array_equal(np.load(Path(d) / "clean" / "job" / "final.rank0.npy"),
                                   np.load(Path(d) / "killed" / "job" / "final.rank0.npy"))) \
            if clean["rc"] == 0 and killed["rc"] == 0 else False
    res.update(clean=clean, killed=killed, killed_bit_exact=same)
    res["metrics_have_gpu"] = any(ln.startswith("blutrain_gpu_") for ln in clean["gpu_metric_lines"])
    res["ok"] = res["telemetry_ok"] and clean["rc"] == 0 and killed["rc"] == 0 and same \
        and killed["restarts"] == 1 and res["metrics_have_gpu"]
    (out / "gpu_check_orchestrator.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(f"telemetry: {len(tel)} GPU(s), source {tel[0]['source'] if tel else '-'}, "
          f"{res['telemetry_ms']:.1f} ms first / {res['telemetry_again_ms']:.2f} ms next; fields "
          f"{sorted(tel[0]) if tel else []}")
    print(f"clean run rc {clean['rc']} in {clean['seconds']:.1f}s, gpu metric lines {len(clean['gpu_metric_lines'])}")
    print(f"killed run rc {killed['rc']} in {killed['seconds']:.1f}s, restarts {killed['restarts']}, "
          f"incidents {killed['incidents']}, bit-exact {same}")
    print("OK" if res["ok"] else "FAILED")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
