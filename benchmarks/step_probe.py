"""Where a GPT-2 124M step's time goes on the GPU: host enqueue time vs GPU step time, and a bluprofiler table.

    python3 benchmarks/step_probe.py OUT_DIR [fp32|tf32] [batch]

Host enqueue = wall time until the Python step returns (no sync); if it is close to the synced step time the
step is launch-bound (a CUDA graph would help); if it is much smaller the GPU is the bottleneck.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

out = Path(sys.argv[1])
prec = sys.argv[2] if len(sys.argv) > 2 else "fp32"
B = int(sys.argv[3]) if len(sys.argv) > 3 else 16
out.mkdir(parents=True, exist_ok=True)

import bluprofiler as bp  # noqa: E402
import blutensor as bt  # noqa: E402
import cupy  # noqa: E402
from blumodels.gpt2 import build_model  # noqa: E402
from e2e_gpt2 import batches, config  # noqa: E402

bt.set_matmul_precision(prec)
bt.set_gemm_provider(os.environ.get("PROBE_GEMM", "cublas"))
model = build_model(config(12), device="cuda", seed=0)
opt = bt.optim.AdamW(model.param_groups(0.1), lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
data = list(batches(B, 1024, 8))


def step(i):
    x, y = data[i % len(data)]
    xi, yi = bt.tensor(x, device="cuda"), bt.tensor(y, device="cuda")
    _, loss = model(xi, yi)
    loss.backward()
    bt.optim.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss


rows = []
for i in range(6):
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    loss = step(i)
    t1 = time.perf_counter()
    cupy.cuda.Device().synchronize()
    t2 = time.perf_counter()
    rows.append({"enqueue_ms": (t1 - t0) * 1e3, "step_ms": (t2 - t0) * 1e3, "loss": float(loss.item())})
print(prec, B, json.dumps(rows[2:]))
bp.profile_steps(lambda: step(0), n_steps=1, out_dir=str(out / f"prof_{prec}"), memory=False, plot=False,
                 sinks=("table",))
(out / f"probe_{prec}.json").write_text(json.dumps({"prec": prec, "batch": B, "steps": rows}, indent=1))
txt = (out / f"prof_{prec}" / "summary.txt")
print(txt.read_text()[:6000] if txt.exists() else "no summary")
