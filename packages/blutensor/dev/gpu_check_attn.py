"""GPU check of blutensor's flash attention: every variant (f32 SIMT, tf32, tf32x3, bf16) for correctness,
then speed next to PyTorch's scaled_dot_product_attention.

Run from the repo root on the GPU machine:  python3 packages/blutensor/dev/gpu_check_attn.py OUT_DIR
(PYTHONPATH is set up here: packages/*/src). Sections, each written to OUT_DIR/attn_check.json as soon as it
ends (a timeout keeps what finished):
  kernels  registers / local memory (spills) of every entry as NVRTC built them for this GPU
  correct  fwd (o, lse) and bwd (dq, dk, dv) vs a float64 torch reference, dense (BH, L, HD) and strided
           fused-qkv entries, causal and not, odd sizes, HD 64/128: max abs error / max |ref| per tensor,
           PASS within the variant's tolerance; tf32x3's error also as a multiple of the f32 SIMT kernel's
           tf32 and tf32x3 backward both ways: the fused kernel (atomic dQ) and the two split kernels ('mode')
  determinism  two backward runs bitwise equal (GPT-2 shape) under bt.use_deterministic_algorithms(True); the
           fused backward's run-to-run difference is recorded (not required to be zero)
  speed    GPT-2 (B=16, H=12, T=1024, HD=64, causal, fused-qkv strided entries) and long context (B=2, H=12,
           T=16384, HD=64, causal): fwd and fwd+bwd ms (CUDA events, warm-up, median) per variant, next to
           torch SDPA in fp32 (allow_tf32=False), fp32 with tf32 allowed, bf16 (+ which backends accept them)
Env: BLU_ATTN_SKIP=speed,long,torch,... (comma list of sections to skip; 'torch': no PyTorch timings),
BLU_ATTN_VARIANTS=tf32,tf32x3 (only these variants; tf32x3's x_f32 ratio needs f32 in the list),
BLU_ATTN_REPS (default 5). Quick run (~1 min): BLU_ATTN_VARIANTS=tf32,tf32x3 BLU_ATTN_SKIP=torch,determinism.
Runs in < 2.5 minutes on an H200.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
for src in sorted((ROOT / "packages").glob("*/src")):
    sys.path.insert(0, str(src))

import numpy as np  # noqa: E402

VARIANTS = tuple(
    v for v in ("f32", "tf32", "tf32x3", "bf16")
    if v in (os.environ.get("BLU_ATTN_VARIANTS") or "f32,tf32,tf32x3,bf16").split(",")
)
#: max abs error / max |ref| (fwd: o and lse; bwd: dq, dk, dv)
TOL = {
    "f32": {"fwd": 1e-5, "bwd": 5e-5},
    "tf32x3": {"fwd": 2e-5, "bwd": 5e-5},
    "tf32": {"fwd": 4e-3, "bwd": 1e-2},
    "bf16": {"fwd": 2e-2, "bwd": 4e-2},
}
#: tf32x3 error must stay within this multiple of the SIMT kernel's (above a 1e-6 floor), per head dim: HD 64
#: stages its long sums (TF32X3::mma_acc); HD 128 does not (registers), its truncation bias grows with the keys
X3_VS_F32 = {64: 3.0, 128: 12.0}
RES: dict = {"kernels": [], "correct": [], "determinism": [], "speed": [], "torch": {}, "errors": []}
FUSED = ("tf32", "tf32x3")  # variants with a fused backward (sdpa.FUSED_BWD)


def modes(variant: str) -> tuple[str, ...]:
    """Backward modes to check for ``variant``: 'fused' and 'split' where a fused kernel exists."""
    return ("fused", "split") if variant in FUSED else ("split",)


def set_mode(mode: str) -> None:
    """Select the backward kernels (BLUTRAIN_SDPA_BWD) for the calls that follow."""
    os.environ["BLUTRAIN_SDPA_BWD"] = mode
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def save(out: Path) -> None:
    RES["elapsed_s"] = round(time.time() - T0, 1)
    tmp = out / "attn_check.json.tmp"
    tmp.write_text(json.dumps(RES, indent=1, default=str))
    tmp.replace(out / "attn_check.json")


def section(name: str, out: Path):
    """Decorator: run a section under try/except, log its time, save the JSON after it."""

    def wrap(fn):
        def run(*a, **k):
            if name in os.environ.get("BLU_ATTN_SKIP", "").split(","):
                log(f"== {name}: skipped (BLU_ATTN_SKIP)")
                return None
            log(f"== {name}")
            try:
                return fn(*a, **k)
            except Exception as e:  # one failing section does not stop the others
                RES["errors"].append(dict(section=name, error=repr(e), tb=traceback.format_exc()[-3000:]))
                log(f"!! {name} failed: {e!r}")
            finally:
                save(out)

        return run

    return wrap


# ------------------------------------------------------------------ data helpers
def storage(variant: str) -> str:
    return "bf16" if variant == "bf16" else "f32"


def to_dev(x64: np.ndarray, variant: str):
    """(device array in the variant's storage, float64 values it holds)."""
    import cupy as cp
    import ml_dtypes

    if variant == "bf16":
        b = np.asarray(x64, np.float32).astype(ml_dtypes.bfloat16)
        return cp.asarray(b.view(np.uint16)), b.astype(np.float64)
    h = np.asarray(x64, np.float32)
    return cp.asarray(h), h.astype(np.float64)


def to_host(a) -> np.ndarray:
    import cupy as cp
    import ml_dtypes

    h = cp.asnumpy(a)
    if h.dtype == np.uint16:
        return h.view(ml_dtypes.bfloat16).astype(np.float64)
    return h.astype(np.float64)


def reference(q64, k64, v64, do64, causal):
    """float64 (o, lse, dq, dk, dv) of (N, L, HD) arrays with torch on the GPU (autograd in double)."""
    import torch

    dev = "cuda"
    q, k, v = (torch.tensor(a, dtype=torch.float64, device=dev, requires_grad=True) for a in (q64, k64, v64))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        L, S = s.shape[-2:]
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool, device=dev).tril(), float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ v
    o.backward(torch.tensor(do64, dtype=torch.float64, device=dev))
    return [t.detach().cpu().numpy() for t in (o, lse, q.grad, k.grad, v.grad)]


def rel(a: np.ndarray, e: np.ndarray) -> float:
    m = np.abs(e).max()
    return float(np.abs(a - e).max() / (m if m > 0 else 1.0))


# ------------------------------------------------------------------ sections
def kernels_info():
    from blutensor.cuda_ops import _loader

    for file in ("sdpa_mma.cu", "sdpa.cu"):
        mod = _loader.module(file)
        names = []
        if file == "sdpa_mma.cu":
            names = [
                f"blu_sdpa_{k}{s}_{v}_hd{d}"
                for v in ("tf32", "tf32x3", "bf16")
                for d in (64, 128)
                for k in ("forward", "backward_dkdv", "backward_dq")
                for s in ("", "_strided")
            ]
        else:
            names = [f"blu_sdpa_{k}{s}_simt_hd{d}" for d in (64, 128) for k in ("forward", "backward_dkdv",
                                                                               "backward_dq") for s in ("", "_strided")]
        for n in names:
            fn = mod.get_function(n)
            a = fn.attributes
            RES["kernels"].append(dict(entry=n, regs=a.get("num_regs"), local_bytes=a.get("local_size_bytes"),
                                       max_threads=a.get("max_threads_per_block")))
    spills = [k["entry"] for k in RES["kernels"] if k["local_bytes"]]
    log(f"{len(RES['kernels'])} entries built; with local memory (spills): {spills or 'none'}")
    for k in RES["kernels"]:
        if "strided" in k["entry"]:
            print(f"   {k['entry']:46s} regs {k['regs']:3d}  local {k['local_bytes']} B")


def _dense_case(variant, N, L, S, hd, causal, rng, e=None):
    from blutensor.cuda_ops.sdpa import flash_attention_backward, flash_attention_forward

    (q, q64), (k, k64), (v, v64), (do, do64) = (
        to_dev(rng.standard_normal((N, n, hd)), variant) for n in (L, S, S, L)
    )
    o, lse = flash_attention_forward(q, k, v, causal, None, variant)
    dq, dk, dv = flash_attention_backward(q, k, v, o, lse, do, causal, None, variant)
    got = [to_host(a) for a in (o, lse, dq, dk, dv)]
    return got, e if e is not None else reference(q64, k64, v64, do64, causal)


def _strided_case(variant, B, H, T, hd, causal, rng, e=None):
    from blutensor.cuda_ops.sdpa import qkv_attention_backward, qkv_attention_forward

    qkv, qkv64 = to_dev(rng.standard_normal((B, T, 3, H, hd)), variant)
    do, do64 = to_dev(rng.standard_normal((B, T, H, hd)), variant)
    o, lse = qkv_attention_forward(qkv, causal, None, variant)
    dqkv = qkv_attention_backward(qkv, o, lse, do, causal, None, variant)
    q64, k64, v64 = (qkv64[:, :, i].transpose(0, 2, 1, 3).reshape(B * H, T, hd) for i in range(3))
    if e is None:
        e = reference(q64, k64, v64, do64.transpose(0, 2, 1, 3).reshape(B * H, T, hd), causal)
    g = to_host(dqkv)
    got = [to_host(o).transpose(0, 2, 1, 3).reshape(B * H, T, hd), to_host(lse)]
    got += [g[:, :, i].transpose(0, 2, 1, 3).reshape(B * H, T, hd) for i in range(3)]
    return got, e


def correctness():
    cases = []
    for hd in (64, 128):
        for causal in (False, True):
            for L, S in ((77, 77), (1000, 1000), (100, 130)):
                cases.append(("dense", L, S, hd, causal))
            for T in (77, 1000):
                cases.append(("strided", T, T, hd, causal))
    f32_err: dict = {}
    refs: dict = {}  # float64 references of the fp32 inputs, shared by f32, tf32 and tf32x3
    print(f"   {'variant':7s} {'entry':7s} {'L':>5s} {'S':>5s} hd  c  {'o':>8s} {'lse':>8s} {'dq':>8s} {'dk':>8s} "
          f"{'dv':>8s}  x_f32  ok")
    for variant, mode in ((v, m) for v in VARIANTS for m in modes(v)):  # f32 first: tf32x3 is compared with it
        set_mode(mode)
        for kind, L, S, hd, causal in cases:
            key = (kind, L, S, hd, causal)
            r = np.random.default_rng([L, S, hd, int(causal), kind == "dense"])  # same data for every variant
            rkey = key + (storage(variant),)
            try:
                if kind == "dense":
                    got, e = _dense_case(variant, 3, L, S, hd, causal, r, refs.get(rkey))
                else:
                    got, e = _strided_case(variant, 2, 3, L, hd, causal, r, refs.get(rkey))
                refs[rkey] = e
            except Exception as ex:
                RES["correct"].append(dict(variant=variant, mode=mode, kind=kind, L=L, S=S, hd=hd, causal=causal,
                                           passed=False, error=repr(ex)))
                print(f"   {variant:7s} {kind:7s} {L:5d} {S:5d} {hd:3d} {int(causal)}  ERROR {ex!r}")
                continue
            errs = dict(zip(("o", "lse", "dq", "dk", "dv"), (rel(a, b) for a, b in zip(got, e))))
            fwd, bwd = max(errs["o"], errs["lse"]), max(errs["dq"], errs["dk"], errs["dv"])
            ok = fwd <= TOL[variant]["fwd"] and bwd <= TOL[variant]["bwd"]
            ratio = None
            if variant == "f32":
                f32_err[key] = max(fwd, bwd)
            elif variant == "tf32x3" and key in f32_err:
                ratio = max(fwd, bwd) / max(f32_err[key], 1e-6)
                ok = ok and ratio <= X3_VS_F32[hd]
            RES["correct"].append(dict(variant=variant, mode=mode, kind=kind, L=L, S=S, hd=hd, causal=causal,
                                       errs=errs, tol=TOL[variant], x_f32=ratio, passed=bool(ok)))
            xs = f"{ratio:5.2f}" if ratio is not None else "    -"
            tag = variant + ("/" + mode[0] if variant in FUSED else "")
            print(f"   {tag:9s} {kind:7s} {L:5d} {S:5d} {hd:3d} {int(causal)}  "
                  + " ".join(f"{errs[n]:8.1e}" for n in ("o", "lse", "dq", "dk", "dv"))
                  + f"  {xs}  {'PASS' if ok else 'FAIL'}", flush=True)
    bad = [c for c in RES["correct"] if not c["passed"]]
    log(f"correctness: {len(RES['correct']) - len(bad)}/{len(RES['correct'])} PASS")
    set_mode("auto")
    failed = sorted({c["variant"] for c in bad if c["variant"] != "f32"})
    if failed:
        _localise(failed)


def _localise(variants):
    """Re-run two failing-prone cases of the mma variants on fallback builds of sdpa_mma.cu (-DBLU_NO_LDMATRIX:
    plain shared loads; -DBLU_SYNC_TILES: no cp.async pipeline) to tell the fault's place."""
    import cupy as cp
    from blutensor.cuda_ops import _loader

    d = cp.cuda.runtime.getDevice()
    src = _loader.source("sdpa_mma.cu")
    cc = cp.cuda.Device(d).compute_capability
    saved = _loader._modules.get(("sdpa_mma.cu", d))
    try:
        for defines in (("-DBLU_NO_LDMATRIX",), ("-DBLU_SYNC_TILES",)):
            _loader._modules[("sdpa_mma.cu", d)] = cp.RawModule(code=src, options=_loader.compile_options(cc) + defines)
            _loader._functions.clear()
            _loader._smem_set.clear()
            for variant in variants:
                for kind, L, causal in (("dense", 77, True), ("strided", 1000, False)):
                    r = np.random.default_rng([L, L, 64, int(causal), kind == "dense"])
                    try:
                        if kind == "dense":
                            got, e = _dense_case(variant, 3, L, L, 64, causal, r)
                        else:
                            got, e = _strided_case(variant, 2, 3, L, 64, causal, r)
                        errs = dict(zip(("o", "lse", "dq", "dk", "dv"), (rel(a, b) for a, b in zip(got, e))))
                    except Exception as ex:
                        errs = {"error": repr(ex)}
                    RES.setdefault("localise", []).append(dict(defines=defines, variant=variant, kind=kind, L=L,
                                                               causal=causal, errs=errs))
                    log(f"   [{' '.join(defines)}] {variant} {kind} L={L} causal={int(causal)}: {errs}")
    finally:
        _loader._modules[("sdpa_mma.cu", d)] = saved
        _loader._functions.clear()
        _loader._smem_set.clear()


def determinism():
    import blutensor as bt
    import cupy as cp
    from blutensor.cuda_ops.sdpa import qkv_attention_backward, qkv_attention_forward

    rng = np.random.default_rng(3)
    for variant in VARIANTS:
        qkv, _ = to_dev(rng.standard_normal((4, 1024, 3, 12, 64)), variant)
        do, _ = to_dev(rng.standard_normal((4, 1024, 12, 64)), variant)
        o, lse = qkv_attention_forward(qkv, True, None, variant)
        bt.use_deterministic_algorithms(True)  # the default mode ('auto') must then be bitwise repeatable
        try:
            g1 = qkv_attention_backward(qkv, o, lse, do, True, None, variant)
            g2 = qkv_attention_backward(qkv, o, lse, do, True, None, variant)
        finally:
            bt.use_deterministic_algorithms(False)
        same = bool(cp.array_equal(g1, g2))
        row = dict(variant=variant, bitwise_equal=same)
        if variant in FUSED:  # the fused kernel's atomics: how far two runs (and the split result) are apart
            f1 = qkv_attention_backward(qkv, o, lse, do, True, None, variant)
            f2 = qkv_attention_backward(qkv, o, lse, do, True, None, variant)
            scale = float(cp.abs(g1).max())
            row.update(fused_bitwise_equal=bool(cp.array_equal(f1, f2)),
                       fused_run_to_run_rel=float(cp.abs(f1 - f2).max()) / scale,
                       fused_vs_split_rel=float(cp.abs(f1 - g1).max()) / scale)
        RES["determinism"].append(row)
        log(f"determinism {variant}: {row}")


def _median_ms(fn, reps: int, warm: int = 2) -> float:
    import cupy as cp

    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b))
    return float(np.median(ts))


def _attn_flops(B, H, T, hd, causal):
    f = 4.0 * B * H * T * T * hd  # QK^T and PV
    return f / 2 if causal else f


def _speed_blu(shape_name, B, H, T, hd, reps):
    import cupy as cp

    rng = np.random.default_rng(1)
    base = rng.standard_normal((B, T, 3, H, hd), dtype=np.float32)
    dbase = rng.standard_normal((B, T, H, hd), dtype=np.float32)
    fl = _attn_flops(B, H, T, hd, True)
    for variant, mode in ((v, m) for v in VARIANTS for m in modes(v)):
        set_mode(mode)
        row = _time_blu(variant, base, dbase, T, reps)
        if variant in FUSED:
            row.update(impl=f"{row['impl']}/{mode}", mode=mode)
        row.update(shape=shape_name, fwd_tflops=fl / row["fwd_ms"] / 1e9,
                   bwd_tflops=2.5 * fl / max(row["bwd_ms"], 1e-9) / 1e9)
        RES["speed"].append(row)
        _print_speed(row)
        cp.get_default_memory_pool().free_all_blocks()
    set_mode("auto")


def _time_blu(variant, base, dbase, T, reps):
    """fwd and fwd+bwd ms of the strided fused-qkv entries of one variant."""
    from blutensor.cuda_ops.sdpa import qkv_attention_backward, qkv_attention_forward

    qkv, _ = to_dev(base, variant)
    do, _ = to_dev(dbase, variant)
    state = {}

    def fwd():
        state["o"], state["lse"] = qkv_attention_forward(qkv, True, None, variant)

    def fwdbwd():
        fwd()
        qkv_attention_backward(qkv, state["o"], state["lse"], do, True, None, variant)

    long = T > 4096
    r = max(2, reps // 2) if (variant == "f32" and long) else reps
    tf = _median_ms(fwd, r, warm=1 if long else 2)
    tfb = _median_ms(fwdbwd, r, warm=1 if long else 2)
    return dict(impl=f"blu {variant}", fwd_ms=tf, fwdbwd_ms=tfb, bwd_ms=tfb - tf)


def _torch_backends(q, k, v):
    """Names of the SDPA backends that accept (q, k, v) causal."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ok = []
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        be = getattr(SDPBackend, name, None)
        if be is None:
            continue
        try:
            with sdpa_kernel(be):
                torch.nn.functional.scaled_dot_product_attention(q[:1, :, :128], k[:1, :, :128], v[:1, :, :128],
                                                                 is_causal=True)
            ok.append(name)
        except Exception:
            pass
    return ok


def _speed_torch(shape_name, B, H, T, hd, reps):
    import torch

    rng = np.random.default_rng(1)
    base = torch.tensor(rng.standard_normal((B, T, 3, H, hd), dtype=np.float32), device="cuda")
    dbase = torch.tensor(rng.standard_normal((B, H, T, hd), dtype=np.float32), device="cuda")
    fl = _attn_flops(B, H, T, hd, True)
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        for mode, dt, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                               ("bf16", torch.bfloat16, False)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            row = _time_torch(base.to(dt, copy=True), dbase.to(dt), reps)
            RES["torch"][f"{shape_name}/{mode}"] = {"accepting_backends": row["backends"],
                                                    "default_priority": _torch_priority(),
                                                    "kernels": row.pop("kernels")}
            row.update(shape=shape_name, impl=f"torch {mode}", fwd_tflops=fl / row["fwd_ms"] / 1e9,
                       bwd_tflops=2.5 * fl / max(row["bwd_ms"], 1e-9) / 1e9)
            RES["speed"].append(row)
            _print_speed(row)
            torch.cuda.empty_cache()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def _time_torch(qkv, do, reps):
    """fwd and fwd+bwd ms of torch SDPA on (B, H, T, hd) views of qkv (B, T, 3, H, hd), as nanoGPT calls it."""
    import torch

    qkv.requires_grad_(True)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    with torch.no_grad():
        accepted = _torch_backends(q.detach(), k.detach(), v.detach())

    def fwd():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwdbwd():
        qkv.grad = None
        q_, k_, v_ = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, is_causal=True).backward(do)

    tf = _median_ms_torch(fwd, reps)
    tfb = _median_ms_torch(fwdbwd, reps)
    return dict(fwd_ms=tf, fwdbwd_ms=tfb, bwd_ms=tfb - tf, backends=accepted, kernels=_torch_kernels(fwdbwd))


def _torch_kernels(fn):
    """Names of the GPU kernels one call of ``fn`` runs (the profiler tells which SDPA backend torch used)."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = sorted({e.key for e in prof.key_averages()})
        return [n[:120] for n in names if any(w in n.lower() for w in ("fmha", "flash", "attention", "sdpa", "mha"))]
    except Exception as e:
        return [f"profiler failed: {e!r}"]


def _torch_priority():
    try:
        import torch
        from torch.nn.attention import SDPBackend

        names = {int(b.value): n for n, b in SDPBackend.__members__.items()}
        return [names.get(int(b), str(b)) for b in torch._C._get_sdp_priority_order()]
    except Exception:
        return None


def _median_ms_torch(fn, reps: int, warm: int = 2) -> float:
    import torch

    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return float(np.median(ts))


def _print_speed(r):
    print(f"   {r['shape']:6s} {r['impl']:18s} fwd {r['fwd_ms']:8.3f} ms ({r['fwd_tflops']:6.1f} TF/s)  "
          f"fwd+bwd {r['fwdbwd_ms']:8.3f} ms  bwd {r['bwd_ms']:8.3f} ms ({r['bwd_tflops']:6.1f} TF/s)"
          + (f"  backends {r['backends']}" if r.get("backends") is not None else ""), flush=True)


def speed(shape_name, B, H, T, hd, reps):
    _speed_blu(shape_name, B, H, T, hd, reps)
    if "torch" not in os.environ.get("BLU_ATTN_SKIP", "").split(","):
        _speed_torch(shape_name, B, H, T, hd, reps)


def summary():
    print("\n== summary (ms; GPT-2 per step = 12 layers)")
    rows = [r for r in RES["speed"] if r["shape"] == "gpt2"]
    for r in rows:
        print(f"   gpt2 {r['impl']:18s} fwd {r['fwd_ms']:7.3f} (x12 {12 * r['fwd_ms']:7.2f})  "
              f"fwd+bwd {r['fwdbwd_ms']:7.3f} (x12 {12 * r['fwdbwd_ms']:7.2f})")
    for r in RES["speed"]:
        if r["shape"] == "long":
            print(f"   long {r['impl']:18s} fwd {r['fwd_ms']:8.2f}  fwd+bwd {r['fwdbwd_ms']:8.2f}")
    bad = [c for c in RES["correct"] if not c["passed"]]
    print(f"   correctness {len(RES['correct']) - len(bad)}/{len(RES['correct'])} PASS; "
          f"determinism {sum(d['bitwise_equal'] for d in RES['determinism'])}/{len(RES['determinism'])}; "
          f"errors {len(RES['errors'])}; {time.time() - T0:.1f}s")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    reps = int(os.environ.get("BLU_ATTN_REPS", "5"))
    RES["config"] = dict(argv=argv, reps=reps, variants=VARIANTS, tol=TOL, x3_vs_f32=X3_VS_F32)
    try:
        import cupy as cp
        import torch

        RES["device"] = dict(name=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                             cupy=cp.__version__, torch=torch.__version__)
        log(f"device {RES['device']}")
    except Exception as e:
        RES["errors"].append(dict(section="setup", error=repr(e)))
        save(out)
        log(f"no GPU stack: {e!r}")
        return 1
    section("kernels", out)(kernels_info)()
    section("correct", out)(correctness)()
    section("determinism", out)(determinism)()
    section("speed", out)(speed)("gpt2", 16, 12, 1024, 64, reps)
    section("long", out)(speed)("long", 2, 12, 16384, 64, max(2, reps - 2))
    summary()
    save(out)
    bad = [c for c in RES["correct"] if not c["passed"]] + [d for d in RES["determinism"] if not d["bitwise_equal"]]
    return 1 if bad or RES["errors"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
