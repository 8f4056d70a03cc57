"""GPU checks of blumodels' model, Trainer and resume (on a CUDA machine; < 3 minutes).

    python3 packages/blumodels/dev/gpu_check.py OUT_DIR

1. GPT-2 forward/backward on CUDA equals the CPU (NumPy) result on the same weights (fp32 strict);
   blutensor's fused AdamW (the Trainer's default on CUDA) follows the eager AdamW.
2. gpt2-124m (GPT-2-size vocabulary padded to 50304) trains ~20 steps at B=8, T=1024 on the built-in
   corpus with the Trainer: losses fall, tokens/s, MFU, memory.
3. Bit-exact resume on the GPU (small config with dropout): uninterrupted vs stop + new Trainer + resume.
4. Top-k sampling on the GPU.
Writes OUT_DIR/blumodels_gpu_check.json. Needs no tokenizer library: when ``tokenizers`` is missing the
corpus is tokenized as raw bytes (vocab 256) for these checks.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
for pkg in ("blutensor", "blumodels", "bluallocator", "blublas"):
    p = ROOT / "packages" / pkg / "src"
    if p.is_dir() and str(p) not in sys.path:
        sys.path.insert(0, str(p))

import blutensor as bt  # noqa: E402
from blumodels.config import ModelConfig, apply_overrides, from_dict, load_preset  # noqa: E402
from blumodels.gpt2 import build_model  # noqa: E402

RESULTS: dict = {"checks": {}}
#: BLUMODELS_GPU_CHECK_DEVICE=cpu: a scaled-down dry run of every check on the CPU (catches script errors)
DEV = os.environ.get("BLUMODELS_GPU_CHECK_DEVICE", "cuda")
DRY = DEV == "cpu"


def check(name):
    def deco(fn):
        def run(*a):
            t0 = time.perf_counter()
            try:
                out = fn(*a) or {}
                out["ok"] = bool(out.get("ok", True))
            except Exception as e:  # record and go on with the next check
                out = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            out["seconds"] = round(time.perf_counter() - t0, 2)
            RESULTS["checks"][name] = out
            print(f"[{'PASS' if out['ok'] else 'FAIL'}] {name} ({out['seconds']}s) "
                  f"{ {k: v for k, v in out.items() if k not in ('trace', 'losses')} }", flush=True)
            return out
        return run
    return deco


def make_data(d: Path, max_bytes: int) -> dict:
    """Token shards of the built-in corpus: BPE through prepare() when `tokenizers` exists, else bytes."""
    try:
        import tokenizers  # noqa: F401
        from blumodels.data.prepare import prepare

        return prepare(d, corpus="pydocs", tokenizer="bpe", vocab_size=4096, val_fraction=0.05,
                       max_corpus_bytes=max_bytes)
    except ImportError:
        from blumodels.data.corpus import builtin_corpus
        from blumodels.data.shards import shard_name, write_shard

        docs = builtin_corpus("pydocs", max_bytes=max_bytes)
        n_val = max(1, len(docs) // 20)
        d.mkdir(parents=True, exist_ok=True)
        for split, part in (("train", docs[n_val:]), ("val", docs[:n_val])):
            toks = np.frombuffer(b"".join(b"\0" + x.encode("utf-8") for x in part), dtype=np.uint8)
            write_shard(d / shard_name(split, 0), toks.astype(np.uint16))
        meta = {"tokenizer": "bytes", "vocab_size": 256, "eot_token": 0, "corpus": "pydocs"}
        (d / "meta.json").write_text(json.dumps(meta))
        return meta


@check("cuda_vs_cpu_forward_backward")
def cuda_vs_cpu():
    cfg = ModelConfig(n_layer=2, n_head=4, d_model=128, block_size=64, vocab_size=1000)
    rng = np.random.default_rng(0)
    idx, tgt = rng.integers(0, 1000, (4, 64)), rng.integers(0, 1000, (4, 64))
    out = {}
    bt.set_matmul_precision("fp32")
    for dev in ("cpu", DEV):
        m = build_model(cfg, seed=5).to(dev)  # the same weights on both devices
        _, loss = m(bt.tensor(idx, dtype=bt.int64, device=dev), bt.tensor(tgt, dtype=bt.int64, device=dev))
        loss.backward()
        out[dev] = (float(loss.item()), {n: p.grad.to("cpu").numpy() for n, p in m.named_parameters()},
                    {n: p.detach().to("cpu").numpy() for n, p in m.named_parameters()})
    direct = build_model(cfg, device=DEV, seed=5)  # initialised on the GPU: Philox gives the CPU's draws
    same_init = all(np.allclose(out["cpu"][2][n], p.detach().to("cpu").numpy(), rtol=0, atol=1e-7)
                    for n, p in direct.named_parameters())
    gerr = max(float(np.abs(out["cpu"][1][n] - out[DEV][1][n]).max() / (np.abs(out["cpu"][1][n]).max() + 1e-12))
               for n in out["cpu"][1])
    lerr = abs(out["cpu"][0] - out[DEV][0])
    return {"ok": lerr < 1e-4 and gerr < 1e-3, "init_on_gpu_equals_cpu": same_init, "loss_cpu": out["cpu"][0],
            "loss_cuda": out[DEV][0], "loss_abs_err": lerr, "grad_max_rel_err": gerr}


@check("fused_vs_eager_adamw")
def fused_adamw():
    """The Trainer uses blutensor's fused (multi-tensor) AdamW on CUDA: it must follow the eager one."""
    cfg = ModelConfig(n_layer=2, n_head=4, d_model=128, block_size=64, vocab_size=1000)
    rng = np.random.default_rng(1)
    idx, tgt = rng.integers(0, 1000, (4, 64)), rng.integers(0, 1000, (4, 64))
    bt.set_matmul_precision("fp32")
    res = {}
    for fused in (False, True):
        m = build_model(cfg, seed=2).to(DEV)
        groups = m.param_groups(0.1)
        opt = bt.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=fused and not DRY)
        losses = []
        for _ in range(5):
            _, loss = m(bt.tensor(idx, dtype=bt.int64, device=DEV), bt.tensor(tgt, dtype=bt.int64, device=DEV))
            loss.backward()
            bt.optim.clip_grad_norm_(list(m.parameters()), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.item()))
        res[fused] = (losses, {n: p.to("cpu").numpy() for n, p in m.named_parameters()})
    perr = max(float(np.abs(res[True][1][n] - res[False][1][n]).max()) for n in res[True][1])
    lerr = max(abs(a - b) for a, b in zip(res[True][0], res[False][0]))
    return {"ok": perr < 1e-5 and lerr < 1e-5, "param_max_abs_err": perr, "loss_max_abs_err": lerr}


@check("gpt2_124m_train")
def train_124m(data: Path, work: Path):
    from blumodels.trainer import Trainer

    B, T, steps = (1, 64, 3) if DRY else (8, 1024, 20)
    cfg = apply_overrides(load_preset("gpt2-124m"), [
        f"data.dir={data}", f"train.device={DEV}", f"train.steps={steps}", f"train.micro_batch={B}",
        f"train.seq_len={T}", f"train.batch_tokens={2 * B * T}", "train.warmup_steps=5", "train.eval_interval=10",
        "train.eval_steps=2", "train.checkpoint_interval=0", "train.plot=false", "train.sample_tokens=0",
        "train.precision=tf32", "train.lr=6e-4"])
    tr = Trainer(cfg, work / "run124m", quiet=True)
    t0 = time.perf_counter()
    tr.fit(min(3, steps), save_final=False)  # time the first steps, then keep the whole check within ~90 s of training
    per = (time.perf_counter() - t0) / min(3, steps)
    planned = min(steps, max(6, int(90 / max(per, 1e-3))))
    s = tr.fit(planned)
    wall = time.perf_counter() - t0
    tr.close()
    h = tr.history
    tps = [r["tokens_per_s"] for r in h[3:]] or [h[-1]["tokens_per_s"]]
    return {"ok": all(np.isfinite(r["loss"]) for r in h) and (DRY or h[-1]["loss"] < h[0]["loss"] - 1.0),
            "steps_run": tr.step, "params": tr.model.num_params(), "padded_vocab": tr.model.wte.weight.shape[0],
            "grad_accum": 2,
            "losses": [round(r["loss"], 4) for r in h], "first_loss": h[0]["loss"], "last_loss": h[-1]["loss"],
            "val": [r["val_loss"] for r in h if "val_loss" in r], "summary_last_val": s["last_val_loss"],
            "tokens_per_s_median": float(np.median(tps)),
            "step_ms_median": float(np.median([r["step_ms"] for r in h[3:] or h])),
            "mfu_median": float(np.median([r["mfu"] for r in h[3:]])) if h[-1]["mfu"] is not None else None,
            "mem_bytes": h[-1]["mem_bytes"], "wall_s": wall, "device": DEV if DRY else bt.cuda.get_device_name()}


@check("gpu_resume_bit_exact")
def resume(data: Path, work: Path):
    from blumodels.trainer import Trainer

    cfg = from_dict({"model": {"n_layer": 2, "n_head": 4, "d_model": 128, "block_size": 128, "dropout": 0.1},
                     "train": {"steps": 8, "batch_tokens": 2048, "micro_batch": 8, "seq_len": 128, "device": DEV,
                               "warmup_steps": 2, "eval_interval": 4, "eval_steps": 2, "checkpoint_interval": 0,
                               "plot": False, "precision": "fp32", "lr": 1e-3, "deterministic": True},
                     "data": {"dir": str(data)}})
    ref = Trainer(cfg, work / "ref", quiet=True)
    ref.fit()
    ref.close()
    a = Trainer(cfg, work / "split", quiet=True)
    a.fit(steps=3)
    a.close()
    b = Trainer(cfg, work / "split", resume=True, quiet=True)
    b.fit()
    b.close()
    la = [r["loss"] for r in map(json.loads, (work / "ref" / "log.jsonl").read_text().splitlines())]
    lb = [r["loss"] for r in map(json.loads, (work / "split" / "log.jsonl").read_text().splitlines())]
    pa = {n: p.to("cpu").numpy() for n, p in ref.model.named_parameters()}
    same_p = all(np.array_equal(pa[n], p.to("cpu").numpy()) for n, p in b.model.named_parameters())
    return {"ok": la == lb and same_p, "losses_equal": la == lb, "params_equal": same_p, "ref": la, "resumed": lb}


@check("gpu_sampling")
def sampling():
    from blumodels.sampling import generate

    cfg = ModelConfig(n_layer=2, n_head=4, d_model=64, block_size=32, vocab_size=100)
    m = build_model(cfg, device=DEV, seed=1)
    a = generate(m, [1, 2, 3], 20, top_k=5, seed=3)
    mc = build_model(cfg, device="cpu", seed=1)
    b = generate(mc, [1, 2, 3], 20, top_k=5, seed=3)
    return {"ok": len(a) == 23 and all(0 <= t < 100 for t in a), "tokens": a, "same_as_cpu": a == b}


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    if not DRY and not bt.cuda.is_available():
        print("no CUDA GPU: nothing to check (BLUMODELS_GPU_CHECK_DEVICE=cpu runs a CPU dry run)")
        RESULTS["skipped"] = "no CUDA"
    else:
        RESULTS["device"] = "cpu (dry run)" if DRY else bt.cuda.get_device_name()
        work = Path(tempfile.mkdtemp(prefix="blumodels-gpu-"))
        t0 = time.perf_counter()
        meta = make_data(work / "data", 300_000 if DRY else 3_000_000)
        RESULTS["data"] = {"tokenizer": meta.get("tokenizer"), "vocab_size": meta.get("vocab_size"),
                           "seconds": round(time.perf_counter() - t0, 1)}
        print("data:", RESULTS["data"], flush=True)
        cuda_vs_cpu()
        fused_adamw()
        train_124m(work / "data", work)
        resume(work / "data", work)
        sampling()
    RESULTS["all_ok"] = bool(RESULTS["checks"]) and all(c["ok"] for c in RESULTS["checks"].values())
    (out / "blumodels_gpu_check.json").write_text(json.dumps(RESULTS, indent=2, default=str))
    print("ALL OK" if RESULTS["all_ok"] else ("SKIPPED" if "skipped" in RESULTS else "SOME CHECKS FAILED"),
          flush=True)
    return 0 if RESULTS["all_ok"] or "skipped" in RESULTS else 1


if __name__ == "__main__":
    os.environ.setdefault("BLUTRAIN_TEST_BACKEND", "cuda")
    sys.exit(main())
