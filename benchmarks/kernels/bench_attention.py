"""blutensor's flash attention as GPT-2 calls it (one fused qkv projection, causal) beside PyTorch SDPA.

    python3 benchmarks/kernels/bench_attention.py [--shape gpt2|hd128|long ...] [--rows all|bf16] [--reps 5]
        [--out OUT.json]

Shapes: ``gpt2`` one GPT-2 124M layer (B=16, H=12, T=1024, HD=64), ``hd128`` head dim 128 at T=2048 (B=4, H=32),
``long`` long context (B=2, H=12, T=16384, HD=64). blutensor: ``bt.ext.sdpa_qkv`` on a (B, T, 3*C) Tensor (the
strided kernels read q, k, v in place), forward and forward + backward through autograd, per kernel variant as a
user selects it: fp32 under ``bt.set_float32_matmul_precision("highest")`` (``tf32x3``;
``BLUTRAIN_SDPA_FP32=simt`` the SIMT ``f32``), ``"high"`` (``tf32``, ``BLUTRAIN_SDPA_TF32=mma``;
``BLUTRAIN_SDPA_TF32=wgmma`` the Hopper ``tf32_wgmma``, an error row elsewhere), bfloat16 (the default:
``bf16_wgmma`` on sm_90; ``BLUTRAIN_SDPA_KERNEL=wgmma`` the Hopper kernel, an error row elsewhere, with
``BLUTRAIN_SDPA_SCHEDULE=free`` its forward without the default turn-taking schedule; ``BLUTRAIN_SDPA_KERNEL=mma`` the
mma.sync ``bf16``), and for the variants with a fused backward (tf32x3, tf32, the Hopper bf16 kernel) both
``BLUTRAIN_SDPA_BWD=fused`` and ``split``.
PyTorch: SDPA on (B, H, T, HD) views of the same layout as nanoGPT calls it, fp32, fp32 with TF32 allowed, bf16
(PyTorch's choice of backend), and bf16 pinned to the cuDNN and to the flash backend
(``torch.nn.attention.sdpa_kernel``; a backend this build or GPU lacks is an error row). ``--rows bf16`` runs
only the bfloat16 rows (wgmma, mma.sync, PyTorch cuDNN / flash / default). Times: median of ``--reps``
CUDA-event timings after two warm-up calls, of a CUDA graph holding ``--graph-calls`` calls (per call: the kernels'
time, as the captured training step runs them), and of single eager calls (``*_eager_ms``: host dispatch included,
which is what a one-call timing measures when the host is slower than the kernels). Correctness against float64
is the cuda-marked packages/blutensor/tests/test_sdpa_variants_cuda.py and test_sdpa_wgmma_vs_mma.py (wgmma
beside mma.sync). The
JSON (default ``benchmarks/results/attention_<gpu>.json``; it records the command and the commit) is rewritten
after every shape.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {"gpt2": (16, 12, 1024, 64), "hd128": (4, 32, 2048, 128), "long": (2, 12, 16384, 64)}
#: (label, dtype, float32 matmul precision, switches) of each blutensor variant: the switches are spelled as their
#: environment variables and applied as an execution-policy scope (bt.policy.scope)
BLU_RUNS = [
    ("f32 simt", "float32", "highest", {"BLUTRAIN_SDPA_FP32": "simt"}),
    ("tf32x3 fused", "float32", "highest", {"BLUTRAIN_SDPA_BWD": "fused"}),
    ("tf32x3 split", "float32", "highest", {"BLUTRAIN_SDPA_BWD": "split"}),
    ("tf32 fused", "float32", "high", {"BLUTRAIN_SDPA_TF32": "mma", "BLUTRAIN_SDPA_BWD": "fused"}),
    ("tf32 split", "float32", "high", {"BLUTRAIN_SDPA_TF32": "mma", "BLUTRAIN_SDPA_BWD": "split"}),
    ("tf32 wgmma", "float32", "high", {"BLUTRAIN_SDPA_TF32": "wgmma", "BLUTRAIN_SDPA_BWD": "split"}),
    ("bf16 wgmma fused", "bfloat16", "highest", {"BLUTRAIN_SDPA_KERNEL": "wgmma", "BLUTRAIN_SDPA_BWD": "fused"}),
    ("bf16 wgmma split", "bfloat16", "highest", {"BLUTRAIN_SDPA_KERNEL": "wgmma", "BLUTRAIN_SDPA_BWD": "split"}),
    ("bf16 wgmma free", "bfloat16", "highest", {"BLUTRAIN_SDPA_KERNEL": "wgmma", "BLUTRAIN_SDPA_BWD": "split",
                                                "BLUTRAIN_SDPA_SCHEDULE": "free"}),
    ("bf16 mma", "bfloat16", "highest", {"BLUTRAIN_SDPA_KERNEL": "mma"}),
    ("bf16 default", "bfloat16", "highest", {}),
]
#: (label, dtype name, TF32 allowed, torch.nn.attention.SDPBackend member or None for PyTorch's own choice)
TORCH_RUNS = [
    ("fp32", "float32", False, None),
    ("tf32", "float32", True, None),
    ("bf16", "bfloat16", False, None),
    ("bf16 cudnn", "bfloat16", False, "CUDNN_ATTENTION"),
    ("bf16 flash", "bfloat16", False, "FLASH_ATTENTION"),
]
ROW_SETS = ("all", "bf16")
SWITCHES = ("BLUTRAIN_SDPA_FP32", "BLUTRAIN_SDPA_BWD", "BLUTRAIN_SDPA_KERNEL", "BLUTRAIN_SDPA_TF32",
            "BLUTRAIN_SDPA_SCHEDULE")


def _flops(B: int, H: int, T: int, hd: int) -> float:
    return 4.0 * B * H * T * T * hd / 2  # QK^T and PV, causal


def _event_median(run, reps: int, event) -> float:
    """Median ms of ``reps`` calls of ``run`` (already warmed up), each between two events."""
    ts = []
    for _ in range(reps):
        a, b = event(), event()
        a.record()
        run()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) if hasattr(a, "elapsed_time") else _cp_elapsed(a, b))
    return float(np.median(ts))


def _median_ms(fn, reps: int, event, sync) -> float:
    for _ in range(2):
        fn()
    sync()
    return _event_median(fn, reps, event)


def _graph_ms(fn, reps: int, calls: int, capture, event, sync) -> float:
    """Median per-call ms of ``calls`` calls of ``fn`` captured in one CUDA graph (``capture(fn, calls)`` returns its
    replay), replayed ``reps`` times between two events: kernel time without the host's dispatch, as the captured
    training step runs it."""
    replay = capture(fn, calls)
    replay()
    sync()
    return _event_median(replay, reps, event) / calls


def _bt_capture(fn, calls: int):
    import blutensor as bt

    g = bt.cuda.CUDAGraph()
    with bt.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g.replay


def _torch_capture(fn, calls: int):
    import torch

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g.replay


def _timings(fwd, fwdbwd, reps: int, calls: int, capture, event, sync) -> dict:
    """fwd / fwd+bwd times: from CUDA-graph replays (the kernels' time) and from eager calls (host dispatch included:
    where it is longer than the kernels, the eager numbers measure the host)."""
    out = {"fwd_eager_ms": _median_ms(fwd, reps, event, sync), "fwdbwd_eager_ms": _median_ms(fwdbwd, reps, event, sync)}
    try:
        out.update(fwd_ms=_graph_ms(fwd, reps, calls, capture, event, sync),
                   fwdbwd_ms=_graph_ms(fwdbwd, reps, calls, capture, event, sync), timing="cuda graph")
    except Exception as e:  # noqa: BLE001 - a call that cannot be captured is timed eagerly, and says so
        out.update(fwd_ms=out["fwd_eager_ms"], fwdbwd_ms=out["fwdbwd_eager_ms"], timing="eager",
                   graph_error=f"{type(e).__name__}: {e}"[:300])
    out["bwd_ms"] = out["fwdbwd_ms"] - out["fwd_ms"]
    return out


def _cp_elapsed(a, b) -> float:
    import cupy

    return cupy.cuda.get_elapsed_time(a, b)


def bench_blu(shape: str, reps: int, rows_set: str = "all", calls: int = 10) -> list[dict]:
    import blutensor as bt
    import cupy as cp

    B, H, T, hd = SHAPES[shape]
    rng = np.random.default_rng(1)
    base = rng.standard_normal((B, T, 3 * H * hd), dtype=np.float32)
    grad = rng.standard_normal((B, T, H * hd), dtype=np.float32)
    rows = []
    for label, dtype, prec, env in BLU_RUNS:
        if rows_set == "bf16" and dtype != "bfloat16":
            continue
        pol = bt.ExecutionPolicy.from_env(env)
        changes = {f: getattr(pol, f) for f, var in bt.policy.ENV.items() if var in SWITCHES}
        scope = bt.policy.scope(**changes)
        scope.__enter__()
        bt.set_float32_matmul_precision(prec)  # writes the scope's policy
        try:
            dt = getattr(bt, dtype)
            qkv = bt.tensor(base, device="cuda", dtype=dt, requires_grad=True)
            g = bt.tensor(grad, device="cuda", dtype=dt)
            variant = bt.ext.pick_attention_variant(np.uint16 if dtype == "bfloat16" else np.float32, hd)

            def fwd(qkv=qkv):
                with bt.no_grad():
                    bt.ext.sdpa_qkv(qkv, H, is_causal=True)

            def fwdbwd(qkv=qkv, g=g):
                qkv.grad = None
                bt.ext.sdpa_qkv(qkv, H, is_causal=True).backward(g)

            row = dict(shape=shape, impl=f"blutrain {label}", variant=variant, switches=env,
                       **_timings(fwd, fwdbwd, reps, calls, _bt_capture, cp.cuda.Event, cp.cuda.Device().synchronize))
        except Exception as e:  # noqa: BLE001 - a variant this GPU lacks is recorded, the others still run
            row = dict(shape=shape, impl=f"blutrain {label}", switches=env, error=f"{type(e).__name__}: {e}"[:300])
        scope.__exit__(None, None, None)
        rows.append(row)
        _print(row, _flops(B, H, T, hd))
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def bench_torch(shape: str, reps: int, rows_set: str = "all", calls: int = 10) -> list[dict]:
    import contextlib

    import torch

    B, H, T, hd = SHAPES[shape]
    rng = np.random.default_rng(1)
    base = torch.tensor(rng.standard_normal((B, T, 3, H, hd), dtype=np.float32), device="cuda")
    dbase = torch.tensor(rng.standard_normal((B, H, T, hd), dtype=np.float32), device="cuda")
    rows, saved = [], torch.backends.cuda.matmul.allow_tf32
    F = torch.nn.functional
    try:
        for label, dname, tf32, backend in TORCH_RUNS:
            if rows_set == "bf16" and dname != "bfloat16":
                continue
            dt = getattr(torch, dname)
            torch.backends.cuda.matmul.allow_tf32 = tf32
            qkv = base.to(dt, copy=True).requires_grad_(True)
            do = dbase.to(dt)

            def pinned(backend=backend):
                if backend is None:
                    return contextlib.nullcontext()
                from torch.nn.attention import SDPBackend, sdpa_kernel

                return sdpa_kernel(getattr(SDPBackend, backend))

            def fwd(qkv=qkv, pinned=pinned):
                with torch.no_grad(), pinned():
                    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)

            def fwdbwd(qkv=qkv, do=do, pinned=pinned):
                qkv.grad = None
                with pinned():
                    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
                    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                y.backward(do)

            def event():
                return torch.cuda.Event(enable_timing=True)

            try:
                row = dict(shape=shape, impl=f"torch {label}", backend=backend or "auto",
                           **_timings(fwd, fwdbwd, reps, calls, _torch_capture, event, torch.cuda.synchronize))
            except Exception as e:  # noqa: BLE001 - a backend this build or GPU lacks is recorded, the rest run
                row = dict(shape=shape, impl=f"torch {label}", backend=backend or "auto",
                           error=f"{type(e).__name__}: {e}"[:300])
            rows.append(row)
            _print(row, _flops(B, H, T, hd))
            torch.cuda.empty_cache()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return rows


def _print(r: dict, flops: float) -> None:
    if "error" in r:
        print(f"   {r['shape']:5s} {r['impl']:24s} ERROR {r['error']}", flush=True)
        return
    r.update(fwd_tflops=flops / r["fwd_ms"] / 1e9, bwd_tflops=2.5 * flops / max(r["bwd_ms"], 1e-9) / 1e9)
    print(f"   {r['shape']:5s} {r['impl']:24s} fwd {r['fwd_ms']:8.3f} ms ({r['fwd_tflops']:6.1f} TF/s)  "
          f"fwd+bwd {r['fwdbwd_ms']:8.3f} ms  bwd {r['bwd_ms']:8.3f} ms ({r['bwd_tflops']:6.1f} TF/s)  "
          f"[{r['timing']}; eager fwd {r['fwd_eager_ms']:.3f} fwd+bwd {r['fwdbwd_eager_ms']:.3f}]", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES))
    ap.add_argument("--rows", choices=ROW_SETS, default="all",
                    help="all: every variant; bf16: wgmma, mma.sync and PyTorch's bf16 backends only")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--graph-calls", type=int, default=10, help="calls captured in each timed CUDA graph")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.reps < 1 or args.graph_calls < 1:
        ap.error("--reps and --graph-calls must be at least 1")
    import cupy as cp
    import torch

    props = cp.cuda.runtime.getDeviceProperties(0)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    out = args.out or ROOT / "benchmarks" / "results" / f"attention_{gpu.split()[-1].lower()}.json"
    shapes = args.shape or ["gpt2", "hd128", "long"]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    doc = dict(command="python3 benchmarks/kernels/bench_attention.py" + "".join(f" --shape {s}" for s in shapes)
               + f" --rows {args.rows} --reps {args.reps} --graph-calls {args.graph_calls}"
               + (f" --out {args.out}" if args.out else ""),
               commit=commit, device=gpu, cupy=cp.__version__, torch=torch.__version__,
               shapes={s: dict(zip(("B", "H", "T", "HD"), SHAPES[s])) for s in shapes}, rows=[])
    out.parent.mkdir(parents=True, exist_ok=True)
    for s in shapes:
        doc["rows"] += (bench_blu(s, args.reps, args.rows, args.graph_calls)
                        + bench_torch(s, args.reps, args.rows, args.graph_calls))
        out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"-> {out}")
    return 1 if any("error" in r for r in doc["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
