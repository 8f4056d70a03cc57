"""GPU check of the bf16 training step (bt.autocast) on one GPU, < 2 minutes:

1. kernels of the bf16 path: fp32<->bf16 cast (bitwise vs the reference rounding), bf16 linear fwd/bwd vs a
   float64 reference from the bf16-rounded operands, fused cross_entropy with float_loss vs the fp32 kernel;
2. GPT-2 124M (B=16, T=1024): BluTrain bf16 autocast vs torch.autocast(bfloat16) eager on the same weights
   (benchmarks/torch_gpt2.py from_blutrain) and batches (benchmarks/e2e_gpt2.py): per-step losses, median
   step ms of both, ratio (target: torch_ms / ours_ms >= 1.05), |dloss| (target < 2e-2);
3. a bluprofiler per-op table of one BluTrain bf16 step; GPU ms of the added pieces (casts, bias-grad GEMV vs
   widen+sum, one bf16 GEMM).

    python3 packages/blutensor/dev/gpu_check_bf16.py OUT
JSON: OUT/bf16_check.json; profile: OUT/profile_bf16/.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

B, T, STEPS, WARM, LR = 16, 1024, 20, 3, 6e-4
CHECK_STEPS = 10


def unit_checks() -> dict:
    import blutensor as bt
    import blutensor.nn.functional as F
    import cupy
    from blutensor.backend import f32_to_bf16_bits
    from blutensor.cuda_ops.cast import to_bf16, to_f32
    from blutensor.cuda_ops.linalg import bf16_provider

    r = np.random.default_rng(0)
    out = {"bf16_gemm_provider": getattr(bf16_provider(), "PLUGIN_NAME", None)}
    v = (r.standard_normal(3 * 2**20 + 5) * 50).astype(np.float32)
    v[:4] = [np.inf, -np.inf, 0.0, -0.0]
    x = cupy.asarray(v)
    ref = f32_to_bf16_bits(x, cupy)
    out["cast_f32_to_bf16_bitwise"] = bool((to_bf16(x) == ref).all()) and bool((to_bf16(x[1:]) == ref[1:]).all())
    out["cast_bf16_to_f32_exact"] = bool((to_f32(ref) == (ref.astype(cupy.uint32) << 16).view(cupy.float32)).all())

    def host(t):
        return t.detach().to(bt.float32).to("cpu").numpy().astype(np.float64)

    w = bt.nn.Parameter(bt.tensor(r.standard_normal((3072, 768)).astype(np.float32) * 0.02, device="cuda"))
    b = bt.nn.Parameter(bt.tensor(r.standard_normal(3072).astype(np.float32) * 0.02, device="cuda"))
    xx = bt.tensor(r.standard_normal((4, 256, 768)).astype(np.float32), device="cuda")
    g = bt.tensor(r.standard_normal((4, 256, 3072)).astype(np.float32), device="cuda")
    with bt.autocast("cuda"):
        y = F.linear(xx, w, b)
    (y.float() * g).sum().backward()
    xb, wb, bb, gb = (host(t.to(bt.bfloat16)) for t in (xx, w, b, g))
    yr = xb @ wb.T + bb
    gb2, xb2 = gb.reshape(-1, 3072), xb.reshape(-1, 768)

    def rel(a, ref_):
        return float(np.abs(a - ref_).max() / np.abs(ref_).max())

    out["linear_out_dtype"] = y.dtype.name
    out["linear_fwd_rel"] = rel(host(y), yr)
    out["linear_dw_rel"] = rel(host(w.grad), gb2.T @ xb2)
    out["linear_db_rel"] = rel(host(b.grad), gb2.sum(0))
    out["linear_ok"] = (y.dtype is bt.bfloat16 and w.grad.dtype is bt.float32 and out["linear_fwd_rel"] < 1e-2
                        and out["linear_dw_rel"] < 1e-2 and out["linear_db_rel"] < 1e-2)

    z = bt.tensor(r.standard_normal((512, 50304)).astype(np.float32) * 3, device="cuda")
    tgt = bt.tensor(r.integers(0, 50257, 512), device="cuda")
    z16 = z.to(bt.bfloat16)
    z16.requires_grad = True
    with bt.autocast("cuda"):
        l16 = F.cross_entropy(z16, tgt)
    l16.backward()
    l32 = F.cross_entropy(z16.detach().float(), tgt)
    out["ce_loss_dtype"] = l16.dtype.name
    out["ce_float_loss_abs_diff"] = abs(float(l16.item()) - float(l32.item()))
    out["ce_grad_dtype"] = z16.grad.dtype.name
    out["ce_ok"] = l16.dtype is bt.float32 and out["ce_float_loss_abs_diff"] < 1e-4 and z16.grad.dtype is bt.bfloat16
    return out


def micro_bench() -> dict:
    """GPU ms of the pieces the bf16 step adds, at GPT-2 124M B=16 T=1024 shapes (CUDA events, median of 20)."""
    import cupy
    from blutensor.backend import bf16_bits_to_f32
    from blutensor.cuda_ops.cast import to_bf16, to_f32
    from blutensor.cuda_ops.linalg import bf16_provider, bias_grad, mm

    def ms(fn, n=20):
        fn()
        ts = []
        for _ in range(n):
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(cupy.cuda.get_elapsed_time(a, b))
        return sorted(ts)[n // 2]

    prov = bf16_provider()
    M = B * T
    x32 = cupy.random.standard_normal((M, 768), dtype=cupy.float32)
    x16 = to_bf16(x32)
    out = {"cast_f32_to_bf16_12.6M": ms(lambda: to_bf16(x32)), "cast_bf16_to_f32_12.6M": ms(lambda: to_f32(x16))}
    for n in (768, 2304, 3072):
        g = to_bf16(cupy.random.standard_normal((M, n), dtype=cupy.float32))
        out[f"bias_grad_gemv_N{n}"] = ms(lambda g=g: bias_grad(prov, g))
        out[f"bias_grad_widen_sum_N{n}"] = ms(lambda g=g: bf16_bits_to_f32(g, cupy).sum(axis=0))
    w = to_bf16(cupy.random.standard_normal((3072, 768), dtype=cupy.float32))
    out["gemm_fwd_16384x768->3072"] = ms(lambda: mm(prov, x16, w, trans_b=True))
    return out


def gpt2_compare(out_dir: Path) -> dict:
    import blutensor as bt
    import cupy
    import torch
    from blumodels.config import ModelConfig
    from blumodels.gpt2 import build_model
    from e2e_gpt2 import batches
    from torch_gpt2 import from_blutrain, train_torch

    cfg = ModelConfig(n_layer=12, n_head=12, d_model=768, block_size=1024, vocab_size=50257)
    ours = build_model(cfg, device="cpu", seed=0)
    theirs = from_blutrain(ours, device="cuda")
    tr = train_torch(theirs, batches(B, T, STEPS), LR, False, "bf16")
    del theirs
    torch.cuda.empty_cache()

    bt.set_gemm_provider("cublas")
    ours.to("cuda")
    opt = bt.optim.AdamW(ours.param_groups(0.1), lr=LR, betas=(0.9, 0.95), eps=1e-8, fused=True)

    def step(x, y):
        with bt.autocast("cuda", dtype=bt.bfloat16):
            _, loss = ours(x, y)
        loss.backward()
        bt.optim.clip_grad_norm_(ours.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    losses, times, host = [], [], []
    cache = None
    for x, y in batches(B, T, STEPS):
        xi, yi = bt.tensor(x, device="cuda"), bt.tensor(y, device="cuda")
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        loss = step(xi, yi)
        host.append(time.perf_counter() - t0)  # Python done, GPU maybe not: ~= step time means CPU-bound
        cupy.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.item()))
        cache = cache or bt.amp.cache_info()
    master_dtypes = sorted({p.dtype.name for p in ours.parameters()})

    def med(ts):
        t = sorted(ts[WARM:])
        return t[len(t) // 2] * 1e3

    ours_ms, torch_ms = med(times), med(tr["step_s"])
    dl = [abs(a - b) for a, b in zip(losses, tr["losses"])]
    res = {
        "losses_blutrain_bf16": losses, "losses_torch_bf16": tr["losses"],
        "max_abs_loss_diff_first10": max(dl[:CHECK_STEPS]), "max_abs_loss_diff_all": max(dl),
        "step_ms_blutrain_bf16": ours_ms, "step_ms_torch_eager_bf16": torch_ms,
        "tokens_per_s_blutrain_bf16": B * T / ours_ms * 1e3, "tokens_per_s_torch_eager_bf16": B * T / torch_ms * 1e3,
        "speedup_vs_torch_eager_bf16": torch_ms / ours_ms, "target_speedup": 1.05,
        "host_ms_blutrain_bf16": med(host), "step_s_blutrain": times, "step_s_torch": tr["step_s"],
        "master_dtypes": master_dtypes,
        "cast_cache_first_step": cache, "torch": tr.get("torch"),
        "peak_reserved_gib_torch": tr.get("peak_reserved_gib"),
        "pool_reserved_gib_blutrain": cupy.get_default_memory_pool().total_bytes() / 2**30,
    }
    res["loss_ok"] = res["max_abs_loss_diff_first10"] < 2e-2
    res["speed_ok"] = res["speedup_vs_torch_eager_bf16"] >= 1.05

    # per-op profile of one bf16 step (GPU times)
    try:
        import bluprofiler as bp

        it = iter(list(batches(B, T, 3)))

        def step_fn():
            x, y = next(it)
            return float(step(bt.tensor(x, device="cuda"), bt.tensor(y, device="cuda")).item())

        prof_dir = out_dir / "profile_bf16"
        bp.profile_steps(step_fn, 1, prof_dir, memory=False, plot=False, sinks=("table",))
        res["profile_dir"] = str(prof_dir)
        txt = prof_dir / "summary.txt"
        if txt.exists():
            res["profile_table_head"] = txt.read_text().splitlines()[:40]
    except Exception as e:  # noqa: BLE001 - the comparison above still counts
        res["profile_error"] = f"{type(e).__name__}: {e}"
    return res


def main() -> None:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu_check_bf16_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    import cupy

    doc = {"gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "config": {"B": B, "T": T,
                                                                                        "steps": STEPS}}
    for name, fn in (("units", unit_checks), ("micro_ms", micro_bench), ("gpt2", lambda: gpt2_compare(out_dir))):
        t0 = time.time()
        try:
            doc[name] = fn()
        except Exception as e:  # noqa: BLE001 - record and continue
            doc[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        doc[name]["wall_s"] = round(time.time() - t0, 1)
        (out_dir / "bf16_check.json").write_text(json.dumps(doc, indent=1))
    u, g = doc["units"], doc["gpt2"]
    print("units:", {k: v for k, v in u.items() if k != "traceback"})
    print("micro (GPU ms):", doc["micro_ms"])
    if "error" in g:
        print("gpt2 ERROR", g["error"], g.get("traceback", ""))
    else:
        ours_ms, ref_ms = g["step_ms_blutrain_bf16"], g["step_ms_torch_eager_bf16"]
        verdict = "PASS" if g["speed_ok"] else "FAIL"
        print(f"gpt2 124M B={B} T={T}: blutrain bf16 {ours_ms:.1f} ms ({g['tokens_per_s_blutrain_bf16']:.0f} tok/s) "
              f"vs torch eager bf16 {ref_ms:.1f} ms -> x{g['speedup_vs_torch_eager_bf16']:.3f} (target 1.05) {verdict}")
        print(f"host (Python) time of our step {g['host_ms_blutrain_bf16']:.1f} ms: close to the step time = CPU-bound")
        print(f"losses: max |dloss| first {CHECK_STEPS} steps {g['max_abs_loss_diff_first10']:.4f} "
              f"(< 2e-2: {'PASS' if g['loss_ok'] else 'FAIL'})")
        print("ours ", " ".join(f"{x:.4f}" for x in g["losses_blutrain_bf16"][:CHECK_STEPS]))
        print("torch", " ".join(f"{x:.4f}" for x in g["losses_torch_bf16"][:CHECK_STEPS]))
        for line in g.get("profile_table_head", [])[:30]:
            print(line)
        if "profile_error" in g:
            print("profile error:", g["profile_error"])
    print("json:", out_dir / "bf16_check.json")


if __name__ == "__main__":
    main()
