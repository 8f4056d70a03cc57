"""Where a GPT-2 124M fp32 training step spends its time on the GPU, kernel by kernel: BluTrain (whole step in a CUDA
graph, as e2e_gpt2.py's blutrain_fp32_*_graph runs) or PyTorch (eager / torch.compile), same batches, B=16, T=1024.

    python3 dev/kernel_profile.py OUT.json blutrain|torch_eager|torch_compile [steps]

torch.profiler (CUPTI) records every kernel of the profiled steps, CuPy's and graph-launched ones included; the
JSON has per-kernel counts and total microseconds per step, and the sums per category (gemm, attention, other).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from step_profile import CATS, category  # noqa: E402,F401  (one kernel classification for both profiles)
from step_profile import _profile as profile  # noqa: E402


def blutrain_step(steps: int):
    import blutensor as bt
    import cupy
    from blumodels.gpt2 import build_model
    from blumodels.graph_step import CapturedStep
    from blumodels.step import TrainStep
    from e2e_gpt2 import batches, config

    bt.set_matmul_precision("fp32")
    bt.set_gemm_provider("cublas")
    model = build_model(config(12), device="cuda", seed=0)
    opt = bt.optim.AdamW(model.param_groups(0.1), lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    data = [(bt.tensor(x, device="cuda"), bt.tensor(y, device="cuda")) for x, y in batches(16, 1024, steps + 4)]
    st = TrainStep(model, opt, list(model.parameters()), device="cuda", lr_schedule=[6e-4] * (steps + 4),
                   grad_clip=1.0, fused=True)  # the Trainer's step
    for s in range(2):  # eager warm-up, then the captured step
        st.run(lambda b=data[s]: b, 6e-4)
    cap = CapturedStep(st, tuple(data[0][0].shape))
    cap.capture()
    cap.run(lambda: data[2], 6e-4)
    cupy.cuda.Device().synchronize()
    it = iter(range(3, steps + 4))

    def step():
        b = data[next(it)]
        cap.run(lambda: b, 6e-4)

    return step


def torch_step(steps: int, compile: bool):
    import torch
    from blumodels.gpt2 import build_model
    from e2e_gpt2 import batches, config
    from torch_gpt2 import from_blutrain

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = from_blutrain(build_model(config(12), device="cpu", seed=0))
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    sm = torch.compile(model) if compile else model
    data = list(batches(16, 1024, steps + 4))
    it = iter(range(steps + 4))

    def step():
        x, y = data[next(it)]
        loss = sm(torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    return step


def main() -> int:
    out, which = Path(sys.argv[1]), sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    import torch

    torch.zeros(1, device="cuda")  # one CUDA context for torch and CuPy
    step = blutrain_step(n) if which == "blutrain" else torch_step(n, which == "torch_compile")
    t0 = time.perf_counter()
    rows = profile(step, n)
    cats: dict = {}
    for name, r in rows.items():
        c = category(name)
        cats[c] = cats.get(c, 0.0) + r["us"]
    top = sorted(rows.items(), key=lambda kv: -kv[1]["us"])
    doc = {"which": which, "steps": n, "wall_s": time.perf_counter() - t0,
           "total_ms_per_step": sum(r["us"] for r in rows.values()) / 1e3,
           "category_ms_per_step": {k: v / 1e3 for k, v in sorted(cats.items())},
           "kernels": [{"name": k[:160], "category": category(k), **v} for k, v in top]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    cat = {k: round(v, 2) for k, v in doc["category_ms_per_step"].items()}
    print(which, f"total {doc['total_ms_per_step']:.2f} ms/step", cat)
    for k, v in top[:25]:
        print(f"   {v['us'] / 1e3:8.3f} ms  x{v['count']:5.1f}  {category(k):9s} {k[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
