"""GPU smoke test: blutensor core on CUDA vs CPU, a GPT-2 step on CUDA, capture basics.

    python3 dev/gpu_smoke.py OUTDIR
"""

import json
import sys
import time
import traceback

import numpy as np

out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
R = {}


def check(name):
    def deco(fn):
        t0 = time.time()
        try:
            R[name] = {"ok": True, "result": fn(), "s": round(time.time() - t0, 2)}
        except Exception as e:  # noqa: BLE001
            R[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-2500:]}
        print(name, json.dumps(R[name])[:600], flush=True)
        return fn
    return deco


import blutensor as bt  # noqa: E402


@check("cuda_available")
def _():
    import cupy
    return {"avail": bt.cuda.is_available(), "cupy": cupy.__version__, "name": bt.cuda.get_device_name(0)}


@check("ops_vs_cpu")
def _():
    rng = np.random.default_rng(0)
    errs = {}
    x = rng.standard_normal((4, 8, 16)).astype(np.float32)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    for name, f in {
        "matmul": lambda a, b: a @ b, "softmax": lambda a, b: bt.softmax(a, -1),
        "ln": lambda a, b: bt.nn.functional.layer_norm(a, (16,)), "gelu": lambda a, b: bt.nn.functional.gelu(a, "tanh"),
        "gelu_exact": lambda a, b: bt.nn.functional.gelu(a), "sum": lambda a, b: a.sum(1),
        "sdpa": lambda a, b: bt.nn.functional.scaled_dot_product_attention(a, a, a, is_causal=True),
    }.items():
        outs, grads = [], []
        for dev in ("cpu", "cuda"):
            a = bt.tensor(x, device=dev, requires_grad=True)
            b = bt.tensor(w, device=dev, requires_grad=True)
            y = f(a, b)
            y.sum().backward()
            outs.append(y.numpy())
            grads.append(a.grad.numpy())
        errs[name] = [float(np.abs(outs[0] - outs[1]).max()), float(np.abs(grads[0] - grads[1]).max())]
    # dropout identical stream
    bt.manual_seed(3)
    m1 = bt.nn.functional.dropout(bt.ones(1000), 0.5).numpy()
    bt.manual_seed(3)
    m2 = bt.nn.functional.dropout(bt.ones(1000, device="cuda"), 0.5).numpy()
    errs["dropout_same_mask"] = bool((m1 == m2).all())
    bt.manual_seed(3)
    r1 = bt.randn(1000).numpy()
    bt.manual_seed(3)
    r2 = bt.randn(1000, device="cuda").numpy()
    errs["randn_maxdiff"] = float(np.abs(r1 - r2).max())
    xb = bt.randn(64, 64, dtype=bt.bfloat16, device="cuda", requires_grad=True)
    (xb * xb).sum().backward()
    g32, x32 = xb.grad.numpy().astype(np.float32), xb.numpy().astype(np.float32)
    errs["bf16_grad_ok"] = bool(np.allclose(g32, 2 * x32, rtol=1e-2))
    return errs


@check("gpt2_step_cuda")
def _():
    from blumodels.config import ModelConfig
    from blumodels.gpt2 import build_model
    cfg = ModelConfig(n_layer=12, n_head=12, d_model=768, block_size=1024, vocab_size=50257)
    m = build_model(cfg, device="cuda", seed=0)
    opt = bt.optim.AdamW(m.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(0)
    B, T = 4, 1024
    losses, times = [], []
    import cupy
    for _ in range(6):
        x = rng.integers(0, 50257, (B, T + 1))
        xi, yi = bt.tensor(x[:, :-1], device="cuda"), bt.tensor(x[:, 1:], device="cuda")
        cupy.cuda.Device().synchronize()
        t0 = time.time()
        _, loss = m(xi, yi)
        loss.backward()
        bt.optim.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        cupy.cuda.Device().synchronize()
        times.append(time.time() - t0)
    return {"losses": losses, "step_s": times, "tok_s": B * T / min(times[1:]),
            "mem_gib": cupy.get_default_memory_pool().total_bytes() / 2**30}


json.dump(R, open(f"{out_dir}/gpu_smoke.json", "w"), indent=1)
