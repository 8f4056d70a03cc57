"""GPU checks of the whole-step CUDA graph, the sync-free eager step and fused-qkv attention. From the repo root:

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 packages/blumodels/dev/gpu_check_graph.py $OUT

(a) GPT-2 124M, B=16 T=1024, TF32 and fp32: 8 steps eager vs 2 eager + capture + 6 replays from the same
    init and batches: per-step losses (must agree within 1e-5), median step ms eager vs graph; TF32 also
    the op-by-op q/k/v split attention (as before sdpa_qkv) vs the fused-qkv path, 3 eager steps; bf16
    autocast: eager vs captured autocast step (losses within 1e-3, bit-identical noted), step ms of both,
    and the eager step with per-weight casts (no bt.amp.precast) for its ms;
(b) small GPT-2 with an lr that changes every step: graph == eager (losses, final parameters);
(c) host syncs: the eager step (forward, backward, clip, fused AdamW) and one graph replay are queued
    behind ~1.5 s of GPU work: without a host sync the Python call returns long before that work ends;
(e) the Trainer on CUDA (micro GPT-2, 8 steps, eval every 4): train.cuda_graph vs eager, TF32 (1e-5) and
    bf16 (1e-3): the real capture through graph_train_step, warm-up/capture/replay flags per step;
(d) pytest of test_sdpa_qkv.py (strided flash attention fwd/bwd vs float64, causal or not, odd T),
    test_cuda_kernels.py (incl. check_plugins: lazy and sync bad-index errors) and test_graph_step.py (incl.
    the Trainer graph-path twin, which failed on the GPU host when a stale device index flag was read).
Prints a compact summary, writes $OUT/graph_gpu_check.json. Budget: under 3 minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
for p in sorted(os.listdir(os.path.join(ROOT, "packages"))):
    sys.path.insert(0, os.path.join(ROOT, "packages", p, "src"))
T0 = time.time()
RES: dict = {}


def setup_gemm() -> str:
    """Make sure a capture-safe GEMM provider is registered and selected (PYTHONPATH-only machines)."""
    import blutensor as bt
    from blutensor.plugin import get_host

    try:
        import blublas.hooks

        get_host().register(blublas.hooks, name="blublas")
    except ImportError:
        return "xp (blublas missing: capture impossible)"
    bt.set_gemm_provider("cublas")
    return "cublas"


def batches(B, T, n, V, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    toks = rng.integers(0, V, size=(n, B, T + 1))
    return [(toks[i, :, :-1], toks[i, :, 1:]) for i in range(n)]


def gpt2(cfg_kw, seed=0):
    from blumodels.config import ModelConfig
    from blumodels.gpt2 import build_model

    return build_model(ModelConfig(**cfg_kw), device="cuda", seed=seed)


PRECAST = [True]  # bf16 eager: all weight casts in one launch (bt.amp.precast), as the Trainer does


def eager_step(model, opt, x, y, lr, clip, bf16=False):
    import blutensor as bt

    for g in opt.param_groups:
        g["lr"] = lr
    with bt.autocast("cuda", dtype=bt.bfloat16, enabled=bf16):  # bf16: forward + loss only, like the Trainer
        if bf16 and PRECAST[0]:
            bt.amp.precast(model.parameters())
        _, loss = model(x, y)
    loss.backward()
    if clip:
        bt.optim.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad()
    return loss


def run(cfg_kw, data, sched, clip, graph: bool, warm=2, observer=False, bf16=False):
    """Per-step losses and step seconds of one run (eager, or eager warm-up + graph replays)."""
    import blutensor as bt
    import cupy as cp
    from blumodels.graph_step import GraphedTrainStep
    model = gpt2(cfg_kw)
    opt = bt.optim.AdamW(model.param_groups(0.1), lr=sched[0], betas=(0.9, 0.95), eps=1e-8, fused=True)
    dev = [(bt.tensor(x, device="cuda"), bt.tensor(y, device="cuda")) for x, y in data]
    import blutensor.cuda_ops.sdpa as sdpa_mod

    fused_ok = sdpa_mod._fused_ok
    if observer:  # the op-by-op attention (view/permute/contiguous + sdpa), as before sdpa_qkv
        sdpa_mod._fused_ok = lambda *a, **k: None
    losses, times, gs = [], [], None
    try:
        for s, (x, y) in enumerate(dev):
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            if graph and s >= warm:
                if gs is None:
                    amp = (lambda: bt.autocast("cuda", dtype=bt.bfloat16)) if bf16 else None
                    gs = GraphedTrainStep(model, opt, sched, clip, tuple(x.shape), "cuda", autocast=amp)
                    gs.capture(s)
                    cp.cuda.Device().synchronize()
                    t0 = time.perf_counter()
                loss, _ = gs.step(x, y, s)
                loss = loss.copy()
            else:
                loss = eager_step(model, opt, x, y, sched[s], clip, bf16=bf16)._data
            cp.cuda.Device().synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(loss)
    finally:
        sdpa_mod._fused_ok = fused_ok
    params = {n: p._data.copy() for n, p in model.named_parameters()} if cfg_kw["n_layer"] <= 2 else None
    return [float(v) for v in losses], times, params, gs


def _free():
    import gc

    import cupy as cp

    gc.collect()
    cp.get_default_memory_pool().free_all_blocks()


def med_ms(ts):
    t = sorted(ts)
    return 1e3 * t[len(t) // 2] if t else None


def check_a():
    import blutensor as bt

    cfg = dict(n_layer=12, n_head=12, d_model=768, block_size=1024, vocab_size=50257)
    data = batches(16, 1024, 8, 50257)
    sched = [6e-4] * 8
    out = {}
    for prec in ("tf32", "fp32"):
        bt.set_matmul_precision(prec)
        le, te, _, _ = run(cfg, data, sched, 1.0, graph=False)
        _free()
        lg, tg, _, _ = run(cfg, data, sched, 1.0, graph=True)
        _free()
        d = max(abs(a - b) for a, b in zip(le, lg))
        out[prec] = {"eager_losses": le, "graph_losses": lg, "max_abs_diff": d, "ok": d <= 1e-5,
                     "eager_step_ms": med_ms(te[2:]), "graph_step_ms": med_ms(tg[3:])}
        if prec == "tf32":
            lo, to, _, _ = run(cfg, data[:3], sched, 1.0, graph=False, observer=True)
            d2 = max(abs(a - b) for a, b in zip(le[:3], lo))
            out["tf32_opbyop_vs_fused_qkv"] = {"max_abs_diff": d2, "ok": d2 <= 1e-4,
                                               "opbyop_step_ms": med_ms(to[1:]), "fused_step_ms": med_ms(te[1:3])}
    # bf16 autocast (fp32 masters, fp32 matmul precision outside autocast as in the Trainer / e2e benchmark):
    # the captured autocast step == the eager one (bit-identical when every kernel is deterministic)
    bt.set_matmul_precision("fp32")
    try:
        out["bf16"] = _bf16_a(cfg, data, sched)
    except Exception as e:  # noqa: BLE001 - keep the TF32/fp32 results
        PRECAST[0] = True
        out["bf16"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:600],
                       "traceback": traceback.format_exc()[-2000:]}
    out["ok"] = all(v.get("ok") for v in out.values() if isinstance(v, dict))
    return out


def _bf16_a(cfg, data, sched):
    """Part a's bf16 autocast runs: eager (precast) vs graph, and eager with per-weight casts."""
    from blutensor import amp

    le, te, _, _ = run(cfg, data, sched, 1.0, graph=False, bf16=True)
    _free()
    lg, tg, _, gs = run(cfg, data, sched, 1.0, graph=True, bf16=True)
    cache = amp.cache_info()["entries"]
    del gs
    _free()
    PRECAST[0] = False  # the per-weight casts on first use (before precast), 5 eager steps
    ln, tn, _, _ = run(cfg, data[:5], sched, 1.0, graph=False, bf16=True)
    PRECAST[0] = True
    _free()
    d = max(abs(a - b) for a, b in zip(le, lg))
    dn = max(abs(a - b) for a, b in zip(le[:5], ln))
    return {"eager_losses": le, "graph_losses": lg, "max_abs_diff": d, "bit_identical": le == lg,
            "cast_cache_entries_after": cache, "precast_vs_percast_max_abs_diff": dn,
            "ok": d <= 1e-3 and cache == 0 and dn <= 1e-3,
            "eager_step_ms": med_ms(te[2:]), "eager_no_precast_step_ms": med_ms(tn[2:]),
            "graph_step_ms": med_ms(tg[3:]), "torch_eager_bf16_ms_ref": 50.7, "target_ms_1.05x": 48.3}


def check_b():
    import blutensor as bt
    import numpy as np

    bt.set_matmul_precision("tf32")
    cfg = dict(n_layer=2, n_head=4, d_model=128, block_size=64, vocab_size=512)
    n = 10
    data = batches(4, 64, n, 512, seed=1)
    sched = [1e-3 * (s + 1) / 3 if s < 3 else 5e-4 + 4e-4 * np.cos(s) for s in range(n)]
    le, _, pe, _ = run(cfg, data, sched, 0.5, graph=False)
    lg, _, pg, gs = run(cfg, data, sched, 0.5, graph=True)
    d = max(abs(a - b) for a, b in zip(le, lg))
    dp = max(float(abs(pe[k] - pg[k]).max()) for k in pe)
    counts = {st["step"] for st in gs.optimizer.state.values()}
    return {"eager_losses": le, "graph_losses": lg, "max_abs_loss_diff": d, "max_abs_param_diff": dp,
            "host_step_counts": sorted(counts), "ok": d <= 1e-5 and dp <= 1e-5 and counts == {n}}


def check_c():
    """Queue ~1.5 s of GPU work, then call the step: a host sync inside would make the call wait for it."""
    import blutensor as bt
    import cupy as cp
    from blumodels.graph_step import GraphedTrainStep

    bt.set_matmul_precision("tf32")
    cfg = dict(n_layer=2, n_head=12, d_model=768, block_size=256, vocab_size=50257)
    data = batches(4, 256, 6, 50257, seed=2)
    model = gpt2(cfg)
    opt = bt.optim.AdamW(model.param_groups(0.1), lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    dev = [(bt.tensor(x, device="cuda"), bt.tensor(y, device="cuda")) for x, y in data]
    for s in range(2):
        eager_step(model, opt, *dev[s], 6e-4, 1.0)
    a = cp.random.random((8192, 8192), dtype=cp.float32)
    cp.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(5):
        a = a @ a * 1e-4
    cp.cuda.Device().synchronize()
    per = (time.perf_counter() - t) / 5
    reps = max(5, int(1.0 / per))

    def probe(call):
        cp.cuda.Device().synchronize()
        b = a
        t0 = time.perf_counter()
        for _ in range(reps):
            b = b @ b * 1e-4
        t1 = time.perf_counter()
        call()
        t2 = time.perf_counter()
        cp.cuda.Device().synchronize()
        t3 = time.perf_counter()
        return {"busy_s": round(t3 - t0, 3), "enqueue_busy_s": round(t1 - t0, 3), "step_call_s": round(t2 - t1, 4),
                "no_sync": (t2 - t1) < 0.4 * (t3 - t1)}

    out = {"eager_step": probe(lambda: eager_step(model, opt, *dev[2], 6e-4, 1.0))}
    # the same probe per piece, to name a sync's source: forward, backward, clip, AdamW
    held = {}

    def fwd():
        held["loss"] = model(*dev[2])[1]

    out["pieces"] = {"forward": probe(fwd)["no_sync"], "backward": probe(lambda: held["loss"].backward())["no_sync"],
                     "clip": probe(lambda: bt.optim.clip_grad_norm_(model.parameters(), 1.0))["no_sync"],
                     "adamw": probe(opt.step)["no_sync"]}
    opt.zero_grad()
    emb = model.wte.weight
    idx = dev[2][0]

    def emb_bwd():
        bt.nn.functional.embedding(idx, emb).sum().backward()

    out["pieces"]["embedding_fwd_bwd"] = probe(emb_bwd)["no_sync"]  # cupy.argsort (thrust) may sync
    opt.zero_grad()
    gs = GraphedTrainStep(model, opt, [6e-4] * 6, 1.0, tuple(dev[3][0].shape), "cuda")
    gs.capture(3)
    out["graph_replay"] = probe(lambda: gs.step(*dev[3], 3))
    out["ok"] = out["eager_step"]["no_sync"] and out["graph_replay"]["no_sync"]
    # embedding backward's sort: thrust (cupy.argsort, eager default) vs the sync-free radix (graphs)
    from blutensor.cuda_ops.sort import stable_argsort

    keys = dev[4][0]._data.reshape(-1)
    same = bool((stable_argsort(keys, 50304, cp) == cp.argsort(keys)).all())
    tm = {}
    for name, f in (("thrust_ms", lambda: cp.argsort(keys)), ("radix_ms", lambda: stable_argsort(keys, 50304, cp))):
        f()
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        for _ in range(20):
            f()
        cp.cuda.Device().synchronize()
        tm[name] = round((time.perf_counter() - t) / 20 * 1e3, 3)
    out["embedding_sort"] = {"radix_equals_thrust": same, **tm,
                             "radix_no_sync": probe(lambda: stable_argsort(keys, 50304, cp))["no_sync"],
                             "thrust_no_sync": probe(lambda: cp.argsort(keys))["no_sync"]}
    # can CuPy's argsort (thrust) be captured at all? (syncs on CuPy without cupy#9497)
    from blutensor.cuda_graph import CUDAGraph, graph

    try:
        g = CUDAGraph()
        idx = dev[4][0]._data.reshape(-1)
        with graph(g):
            order = cp.argsort(idx)
        g.replay()
        cp.cuda.Device().synchronize()
        out["argsort_capture"] = {"ok": bool((idx[order][1:] >= idx[order][:-1]).all())}
    except Exception as e:  # noqa: BLE001
        out["argsort_capture"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
    return out


def check_e():
    """The Trainer on CUDA: train.cuda_graph (real capture through graph_train_step) vs eager, TF32 and bf16."""
    import tempfile

    sys.path.insert(0, os.path.join(ROOT, "packages", "blumodels", "tests"))
    from blumodels.trainer import Trainer
    from models_helpers import micro_config

    out = {}
    for prec, tol in (("tf32", 1e-5), ("bf16", 1e-3)):
        hist = {}
        for graph in (False, True):
            cfg = micro_config(batch_tokens=128, steps=8, eval_interval=4, eval_steps=2, checkpoint_interval=0,
                               grad_clip=0.5, precision=prec, device="cuda", cuda_graph=graph)
            tr = Trainer(cfg, tempfile.mkdtemp(prefix="gcg-"), quiet=True)
            tr.fit(save_final=False)
            tr.close()
            hist[graph] = tr.history
        le = [r["loss"] for r in hist[False]]
        lg = [r["loss"] for r in hist[True]]
        d = max(abs(a - b) for a, b in zip(le, lg))
        ve = [r["val_loss"] for r in hist[False] if "val_loss" in r]
        vg = [r["val_loss"] for r in hist[True] if "val_loss" in r]
        dv = max(abs(a - b) for a, b in zip(ve, vg)) if ve else float("inf")
        flags = [bool(r.get("cuda_graph", False)) for r in hist[True]]
        out[prec] = {"eager_losses": le, "graph_losses": lg, "max_abs_diff": d, "val_max_abs_diff": dv,
                     "graph_steps": sum(flags), "ok": d <= tol and dv <= tol and len(le) == len(lg) == 8
                     and len(ve) == len(vg) == 3 and flags == [False] * 2 + [True] * 6}
    out["ok"] = all(v["ok"] for v in out.values())
    return out


def check_d():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, "packages", p, "src") for p in sorted(os.listdir(os.path.join(ROOT, "packages")))]
        + [os.path.join(ROOT, "packages", "blutensor", "tests")] + [env.get("PYTHONPATH", "")])
    tests = [os.path.join(ROOT, "packages/blutensor/tests/test_sdpa_qkv.py"),
             os.path.join(ROOT, "packages/blutensor/tests/test_cuda_kernels.py"),
             os.path.join(ROOT, "packages/blutensor/tests/test_amp_precast.py"),
             os.path.join(ROOT, "packages/blumodels/tests/test_graph_step.py")]
    budget = max(40, int(175 - (time.time() - T0)))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=budget)
    tail = p.stdout.strip().splitlines()[-15:]
    return {"rc": p.returncode, "tail": tail, "ok": p.returncode == 0}


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out, exist_ok=True)
    RES["gemm"] = setup_gemm()
    for name, fn in (("b_small_lr_schedule", check_b), ("c_host_syncs", check_c), ("a_gpt2_124m", check_a),
                     ("e_trainer_cuda", check_e), ("d_kernels_pytest", check_d)):
        t = time.time()
        try:
            RES[name] = fn()
        except Exception as e:  # noqa: BLE001 - record and go on
            RES[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2500:], "ok": False}
        RES[name]["seconds"] = round(time.time() - t, 1)
        with open(os.path.join(out, "graph_gpu_check.json"), "w") as f:
            json.dump(RES, f, indent=1)
        print(name, json.dumps({k: v for k, v in RES[name].items() if k not in ("traceback",)})[:1500], flush=True)
        _free()
    print("SUMMARY", {k: v.get("ok") if isinstance(v, dict) else v for k, v in RES.items()},
          f"total {time.time() - T0:.0f}s")


if __name__ == "__main__":
    main()
