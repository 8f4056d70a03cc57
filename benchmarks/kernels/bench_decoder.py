"""blutensor's Llama decoder kernels (RMSNorm, residual add + RMSNorm, RoPE, SwiGLU) on llama-1b's training shapes,
forward and backward, fp32 and bf16, beside PyTorch eager and torch.compile, each checked against float64.

    python3 benchmarks/kernels/bench_decoder.py --out OUT.json [--only rms_norm,add_rms_norm,rope,swiglu]
        [--no-compile]
    python3 benchmarks/kernels/bench_decoder.py --device cpu --size tiny --out OUT.json   # the plumbing, on the CPU

Shapes (``--size llama-1b``, the llama-1b preset's micro-batch: B=4, T=2048, so B*T = 8192 rows): RMSNorm and the
residual add + RMSNorm over d_model 2048, RoPE on the query (32 heads of 64) and key (8 heads of 64) projections in
the (B, T, heads, 64) layout the projections give, rotated and written as attention's (B, heads, T, 64) (the
``transpose=True`` form the model calls), SwiGLU on (8192, 8192) gate and up projections. Dtypes: ``f32`` and
``bf16`` storage of every tensor, and for the residual add + RMSNorm also ``autocast``, the mix the model runs under
bf16 autocast (bf16 sublayer output, fp32 residual stream and weight, bf16 normalised output).

blutensor is called through its public functional API (``bt.nn.functional.rms_norm``, ``add_rms_norm``, ``rope``,
``swiglu``) on activations (non-leaf tensors, as in a model); backward is the autograd engine's pass from the
outputs stopped at the op's inputs (``bt.ext.run_backward`` with ``capture``: the gradients as the op hands them
to the previous one). ``blutrain_ms`` is the op as called from Python (dispatch, autograd recording and
allocation included), ``blutrain_kernel_ms`` the same call replayed from a CUDA graph
(benchmarks/kernels/bench_memkern.py's timers: host launch gaps out; eager batches where the capture fails, listed
in ``graph_errors``). PyTorch: ``torch.nn.functional.rms_norm``, the add then ``rms_norm`` (then the cast to bf16
under the autocast mix), Hugging Face Llama's rotate-half RoPE (tables in the input's dtype) followed by the copy
into the (B, heads, T, 64) layout, and ``silu(gate) * up``; eagerly (``torch_ms``) and through ``torch.compile``
(``compile_ms``), each timed in a CUDA graph where it captures (``*_graphed``; a backward's graph holds only
``torch.autograd.grad`` from outputs made on the capture stream beforehand: PyTorch runs a backward op on its
forward's stream; a backward capture that fails is listed in ``torch_graph_errors``). ``bytes``: what must cross HBM
(inputs read once, outputs written once); ``frac_copy_bw``: bytes / blutrain_kernel_ms against a 2 GiB device copy
of the same run; ``speedup_vs_torch`` and ``speedup_vs_compile``: PyTorch's time / blutrain_kernel_ms.

Correctness: every output of every row (forward outputs; backward: the gradients of every input) against a float64
NumPy reference computed from the same inputs (bf16 inputs as stored, the float32 RoPE tables as stored). Error:
max |out - ref| / max |ref|; the tolerance is chosen by the output's storage and the pass (``TOL``). PyTorch
eager's error on the same inputs is recorded beside it (``torch_err``). The JSON records the command and the
commit and is rewritten after every family; the exit status is 1 when a check fails or a row errs.

``--device cpu --size tiny`` runs every row with toy shapes on blutensor's CPU kernels and PyTorch's CPU ops
(wall-clock times, no torch.compile, no bandwidth): the plumbing and the checks, for tests.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_memkern as mk  # noqa: E402 - the timers the memory-bound kernel benchmark uses

FAMILIES = ("rms_norm", "add_rms_norm", "rope", "swiglu")
#: B, T, d_model, ffn hidden, query heads, key-value heads, head dim
SIZES = {
    "llama-1b": dict(B=4, T=2048, d=2048, ffn=8192, hq=32, hkv=8, hd=64),
    "tiny": dict(B=2, T=16, d=64, ffn=96, hq=4, hkv=2, hd=16),
}
EPS = 1e-5  # the llama presets' ln_eps
ROPE_THETA = 500000.0
#: (pass, output storage) -> tolerance on max |out - ref| / max |ref| (fp32 math in every kernel; a bf16 output
#: carries its final rounding to bf16)
TOL = {("fwd", "f32"): 1e-5, ("bwd", "f32"): 2e-5, ("fwd", "bf16"): 8e-3, ("bwd", "bf16"): 1.6e-2}
DOC: dict = {"rows": [], "errors": [], "graph_errors": [], "torch_graph_errors": []}


# ------------------------------------------------------------------ devices: tensors and timers
class Ctx:
    """The device, its timers and the way tensors cross to the host (CUDA: CUDA events and graphs; CPU: wall clock)."""

    def __init__(self, device: str, compile_: bool, reps: int) -> None:
        import blutensor as bt
        import torch

        self.bt, self.torch, self.device = bt, torch, device
        self.compile = compile_ and device == "cuda"
        self.reps = reps

    # tensors
    def bt_in(self, a: np.ndarray, storage: str, grad: bool = True):
        """A blutensor leaf on the device from float32 host data, in ``storage`` (bf16: rounded once, here)."""
        bt = self.bt
        t = bt.tensor(a.astype(np.float32), device=self.device)
        t = (t.to(bt.bfloat16) if storage == "bf16" else t).detach()
        t.requires_grad = grad
        return t

    def host(self, t) -> np.ndarray:
        """A blutensor or torch tensor's values as float64 on the host."""
        if isinstance(t, self.torch.Tensor):
            return t.detach().float().cpu().numpy().astype(np.float64)
        return t.detach().to("cpu").to(self.bt.float32).numpy().astype(np.float64)

    def raw(self, ref: np.ndarray, storage: str):
        """The values ``ref`` as the raw storage array the engine passes between backward formulas: CuPy float32 or
        bf16 bits on CUDA, a NumPy float32 or bfloat16 array on the CPU."""
        bt = self.bt
        a32 = np.ascontiguousarray(ref, dtype=np.float32)
        if self.device == "cuda":
            cp = mk._cp()
            a = cp.asarray(a32)
            return bt.ext.f32_to_bf16_bits(a, cp) if storage == "bf16" else a
        t = bt.tensor(a32)
        return (t.to(bt.bfloat16) if storage == "bf16" else t).numpy()

    def host_raw(self, a) -> np.ndarray:
        """A raw storage array (see :meth:`raw`) as float64 on the host."""
        if self.device == "cuda":
            cp = mk._cp()
            if a.dtype == np.uint16:
                a = self.bt.ext.bf16_bits_to_f32(a, cp)
            return cp.asnumpy(a).astype(np.float64)
        return np.asarray(a).astype(np.float64)

    def torch_in(self, ref: np.ndarray, storage: str, grad: bool = True):
        """A torch leaf holding exactly the values ``ref`` (float64 copies of what blutensor stores)."""
        torch = self.torch
        dt = torch.bfloat16 if storage == "bf16" else torch.float32
        t = torch.from_numpy(ref.astype(np.float32)).to(self.device).to(dt)
        return t.requires_grad_(grad)

    # timers
    def time_blu(self, fn) -> dict:
        if self.device == "cuda":
            return {"blutrain_ms": mk.time_eager(fn), "blutrain_kernel_ms": mk.time_graph(fn)}
        ms = self._wall(fn)
        return {"blutrain_ms": ms, "blutrain_kernel_ms": ms}

    def time_torch(self, fn) -> tuple[float, bool]:
        """(median ms, whether timed in a CUDA graph) of a PyTorch call: ``fn()``, or for a backward a pair
        (setup, bwd) timing ``bwd(setup())``'s bwd part only."""
        if isinstance(fn, tuple):
            return self._time_torch_bwd(*fn)
        if self.device == "cuda":
            return mk.time_torch(fn)
        return self._wall(fn), False

    def _time_torch_bwd(self, setup, bwd, reps: int = 10) -> tuple[float, bool]:
        """PyTorch runs each backward op on its forward's stream, so the forward (``setup()``) runs on the capture
        stream, outside the graph, and the graph holds ``reps`` calls of ``bwd(outputs)``; eager batches where the
        capture fails."""
        if self.device != "cuda":
            outs = setup()
            return self._wall(lambda: bwd(outs)), False
        torch = self.torch
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                outs = setup()
                for _ in range(2):
                    bwd(outs)
            s.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                for _ in range(reps):
                    bwd(outs)
            g.replay()
            ts = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b) / reps)
            return float(np.median(ts)), True
        except Exception as e:  # noqa: BLE001 - recorded; eager batches instead
            DOC["torch_graph_errors"].append(f"backward: {type(e).__name__}: {e}"[:300])
            torch.cuda.synchronize()
            outs = setup()
            return mk.time_torch(lambda: bwd(outs), graph=False)

    def _wall(self, fn) -> float:
        fn()
        ts = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return float(np.median(ts))

    def free(self) -> None:
        if self.device == "cuda":
            mk._cp().get_default_memory_pool().free_all_blocks()
            self.torch.cuda.empty_cache()


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    """max |out - ref| / max |ref| (inf when out holds a non-finite value or its shape differs)."""
    if out.shape != ref.shape or not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref))) / max(float(np.max(np.abs(ref))), 1e-30)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def row(ctx: Ctx, name: str, op: str, pass_: str, dtype: str, shape: str, nbytes: int, blu_fn, outs: dict,
        refs: dict, storages: dict, torch_fn=None, torch_outs: dict | None = None, compile_fn=None) -> None:
    """Check ``outs`` (host float64, blutensor's) against ``refs``, time blutensor's call and PyTorch's, and record
    the row. ``storages`` names each output's storage (its tolerance)."""
    r: dict = dict(name=name, op=op, pass_=pass_, dtype=dtype, shape=shape, bytes=nbytes)
    try:
        r["err"] = {k: rel_err(outs[k], refs[k]) for k in refs}
        r["tol"] = {k: TOL[(pass_, storages[k])] for k in refs}
        r["ok"] = all(r["err"][k] <= r["tol"][k] for k in refs)
        if torch_outs is not None:
            r["torch_err"] = {k: rel_err(torch_outs[k], refs[k]) for k in refs}
        r.update(ctx.time_blu(blu_fn))
        if ctx.device == "cuda":
            r["GBps"] = nbytes / r["blutrain_kernel_ms"] / 1e6
            r["frac_copy_bw"] = r["GBps"] / DOC["copy_bw_GBps"]
        if torch_fn is not None:
            r["torch_ms"], r["torch_graphed"] = ctx.time_torch(torch_fn)
            r["speedup_vs_torch"] = r["torch_ms"] / r["blutrain_kernel_ms"]
        if compile_fn is not None:
            try:
                r["compile_ms"], r["compile_graphed"] = ctx.time_torch(compile_fn)
                r["speedup_vs_compile"] = r["compile_ms"] / r["blutrain_kernel_ms"]
            except Exception as e:  # noqa: BLE001 - recorded; the eager comparison stands
                r["compile_error"] = f"{type(e).__name__}: {e}"[:400]
    except Exception as e:  # noqa: BLE001 - one row's failure is recorded; the others still run
        r["error"] = f"{type(e).__name__}: {e}"[:400]
        DOC["errors"].append(dict(where=name, error=r["error"], tb=traceback.format_exc()[-2000:]))
    DOC["rows"].append(r)
    _print(r)


def _print(r: dict) -> None:
    txt = f"{r['name']:34s} {r['shape']:18s}"
    if "blutrain_kernel_ms" in r:
        txt += f" op {r['blutrain_ms']:8.4f} ms  kernel {r['blutrain_kernel_ms']:8.4f} ms"
        if "frac_copy_bw" in r:
            txt += f" ({100 * r['frac_copy_bw']:3.0f}% copy)"
        if "torch_ms" in r:
            txt += f"  torch x{r['speedup_vs_torch']:4.2f}"
        if "compile_ms" in r:
            txt += f"  compile x{r['speedup_vs_compile']:4.2f}"
    if "err" in r:
        worst = max(r["err"].values()) if r["err"] else 0.0
        txt += f"  err {worst:.1e} {'ok' if r['ok'] else 'FAIL'}"
    print(txt + (f"  ERROR {r['error']}" if "error" in r else ""), flush=True)


def _compiled(ctx: Ctx, fn):
    """torch.compile of ``fn`` (static shapes), or None when compiling is off (CPU, --no-compile)."""
    return ctx.torch.compile(fn, dynamic=False) if ctx.compile else None


def _fwd_bwd_rows(ctx: Ctx, op: str, dtype: str, shape: str, bytes_fwd: int, bytes_bwd: int, blu_call, blu_inputs,
                  blu_grads, torch_call, torch_inputs, torch_grads, ref_fwd: dict, ref_bwd: dict, out_names,
                  in_names, st_out: dict, st_in: dict, label: str = "") -> None:
    """The forward row and the backward row of one op and dtype. blutensor: ``blu_call(*inputs)`` returns its
    outputs (``out_names``), the inputs being activations as in a model (non-leaf tensors: clones of
    ``blu_inputs``); its backward is the engine's pass from the outputs with ``blu_grads``, stopped at the inputs
    (``bt.ext.run_backward`` with ``capture``: the gradients that would flow on to the previous op, ``in_names``,
    as the op's backward hands them over, neither copied nor accumulated into a leaf). PyTorch:
    ``torch.autograd.grad`` of ``torch_call(*torch_inputs)`` into its inputs, eager and compiled."""
    bt, torch = ctx.bt, ctx.torch
    sub = f" {label}" if label else ""

    def as_tuple(o):
        return o if isinstance(o, tuple) else (o,)

    ins = tuple(t.clone() for t in blu_inputs)
    outs = as_tuple(blu_call(*ins))
    t_outs = as_tuple(torch_call(*torch_inputs))
    row(ctx, f"{op}.fwd{sub} {dtype}", op, "fwd", dtype, shape, bytes_fwd, lambda: blu_call(*ins),
        {k: ctx.host(o) for k, o in zip(out_names, outs)}, ref_fwd, st_out,
        lambda: torch_call(*torch_inputs), {k: ctx.host(o) for k, o in zip(out_names, t_outs)},
        (lambda c=_compiled(ctx, torch_call): c(*torch_inputs)) if ctx.compile else None)
    nodes = [t.grad_fn for t in ins]
    raw = [ctx.raw(ctx.host(g), "bf16" if g.dtype == bt.bfloat16 else "f32") for g in blu_grads]

    def blu_bwd():
        got = dict.fromkeys(nodes)
        bt.ext.run_backward(list(outs), raw, retain_graph=True, capture=got)
        return got

    got = blu_bwd()
    t_grads = torch.autograd.grad(t_outs, torch_inputs, torch_grads, retain_graph=True)

    def t_bwd(o):
        return torch.autograd.grad(o, torch_inputs, torch_grads, retain_graph=True)

    compile_bwd = None
    if ctx.compile:
        compiled = _compiled(ctx, torch_call)
        compile_bwd = (lambda: as_tuple(compiled(*torch_inputs)), t_bwd)
    row(ctx, f"{op}.bwd{sub} {dtype}", op, "bwd", dtype, shape, bytes_bwd, blu_bwd,
        {k: ctx.host_raw(got[n]) for k, n in zip(in_names, nodes)}, ref_bwd, st_in,
        (lambda: as_tuple(torch_call(*torch_inputs)), t_bwd), {k: ctx.host(g) for k, g in zip(in_names, t_grads)},
        compile_bwd)


# ------------------------------------------------------------------ the four families
def bench_rms_norm(ctx: Ctx, s: dict, storage: str) -> None:
    F, tF = ctx.bt.nn.functional, ctx.torch.nn.functional
    N, C = s["B"] * s["T"], s["d"]
    rng = _rng(1)
    x = ctx.bt_in(rng.standard_normal((N, C)) * 2 + 0.5, storage)
    w = ctx.bt_in(1 + 0.1 * rng.standard_normal(C), storage)
    g = ctx.bt_in(rng.standard_normal((N, C)), storage, grad=False)
    xr, wr, gr = ctx.host(x), ctx.host(w), ctx.host(g)
    rstd = 1 / np.sqrt((xr * xr).mean(-1, keepdims=True) + EPS)
    xh = xr * rstd
    gw = gr * wr
    ref_bwd = {"dx": rstd * (gw - xh * (gw * xh).mean(-1, keepdims=True)), "dw": (gr * xh).sum(0)}
    es = 2 if storage == "bf16" else 4
    _fwd_bwd_rows(ctx, "rms_norm", storage, f"{N}x{C}", 2 * N * C * es + 4 * N, 3 * N * C * es + 4 * N,
                  lambda a, b: F.rms_norm(a, (C,), b, EPS), (x, w), (g,),
                  lambda a, b: tF.rms_norm(a, (C,), b, EPS),
                  (ctx.torch_in(xr, storage), ctx.torch_in(wr, storage)), (ctx.torch_in(gr, storage, False),),
                  {"y": xh * wr}, ref_bwd, ("y",), ("dx", "dw"), {"y": storage}, {"dx": storage, "dw": storage})


def bench_add_rms_norm(ctx: Ctx, s: dict, dtype: str) -> None:
    """``dtype`` f32 / bf16: every tensor in that storage; autocast: bf16 x, fp32 residual and weight, bf16 y."""
    bt, torch = ctx.bt, ctx.torch
    F, tF = bt.nn.functional, torch.nn.functional
    N, C = s["B"] * s["T"], s["d"]
    sx = "bf16" if dtype in ("bf16", "autocast") else "f32"
    sr = "bf16" if dtype == "bf16" else "f32"  # the residual stream, h and the weight
    sy = sx
    rng = _rng(2)
    x = ctx.bt_in(rng.standard_normal((N, C)), sx)
    r = ctx.bt_in(rng.standard_normal((N, C)) * 2, sr)
    w = ctx.bt_in(1 + 0.1 * rng.standard_normal(C), sr)
    gy = ctx.bt_in(rng.standard_normal((N, C)), sy, grad=False)
    gh = ctx.bt_in(rng.standard_normal((N, C)), sr, grad=False)
    xr, rr, wr, gyr, ghr = (ctx.host(t) for t in (x, r, w, gy, gh))
    h = xr + rr
    rstd = 1 / np.sqrt((h * h).mean(-1, keepdims=True) + EPS)
    hh = h * rstd
    gw = gyr * wr
    d = ghr + rstd * (gw - hh * (gw * hh).mean(-1, keepdims=True))
    ref_bwd = {"dx": d, "dres": d, "dw": (gyr * hh).sum(0)}
    autocast = dtype == "autocast"

    def blu(a, b, c):
        with bt.autocast(ctx.device, dtype=bt.bfloat16, enabled=autocast):
            return F.add_rms_norm(a, b, (C,), c, EPS)

    tdt = torch.bfloat16 if sy == "bf16" else torch.float32

    def tch(a, b, c):
        hs = b + a
        return hs, tF.rms_norm(hs, (C,), c, EPS).to(tdt)

    es = {"bf16": 2, "f32": 4}
    ex, eh, ey = es[sx], es[sr], es[sy]
    # fwd: read x and r, write h and y (and rstd); bwd: read gy, gh, h (and rstd), write dres (and dx where the
    # storage of x differs from h's)
    bytes_fwd = N * C * (ex + eh + eh + ey) + 4 * N
    bytes_bwd = N * C * (ey + eh + eh + eh + (ex if ex != eh else 0)) + 4 * N
    _fwd_bwd_rows(ctx, "add_rms_norm", dtype, f"{N}x{C}", bytes_fwd, bytes_bwd, blu, (x, r, w), (gh, gy), tch,
                  (ctx.torch_in(xr, sx), ctx.torch_in(rr, sr), ctx.torch_in(wr, sr)),
                  (ctx.torch_in(ghr, sr, False), ctx.torch_in(gyr, sy, False)),
                  {"h": h, "y": hh * wr}, ref_bwd, ("h", "y"), ("dx", "dres", "dw"), {"h": sr, "y": sy},
                  {"dx": sx, "dres": sr, "dw": sr})


def rope_tables(T: int, D: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 cos/sin (T, D/2) of the standard RoPE frequencies 1 / theta^(2i/D)."""
    ang = np.outer(np.arange(T), 1.0 / ROPE_THETA ** (np.arange(0, D, 2) / D))
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def bench_rope(ctx: Ctx, s: dict, storage: str) -> None:
    bt, torch = ctx.bt, ctx.torch
    F = bt.nn.functional
    B, T, D = s["B"], s["T"], s["hd"]
    c32, s32 = rope_tables(T, D)
    cos, sin = bt.tensor(c32, device=ctx.device), bt.tensor(s32, device=ctx.device)
    cr, sr = c32.astype(np.float64)[:, None], s32.astype(np.float64)[:, None]  # (T, 1, D/2)
    tdt = torch.bfloat16 if storage == "bf16" else torch.float32
    tc = torch.from_numpy(np.concatenate([c32, c32], -1)[:, None]).to(ctx.device).to(tdt)  # (T, 1, D), x's dtype
    ts = torch.from_numpy(np.concatenate([s32, s32], -1)[:, None]).to(ctx.device).to(tdt)

    def rot(a, sn):  # (B, T, H, D) rotated by the stored tables, float64
        a1, a2 = a[..., :D // 2], a[..., D // 2:]
        return np.concatenate([a1 * cr - a2 * sn, a2 * cr + a1 * sn], -1)

    def tch(a):  # Hugging Face Llama's rotate_half form, then attention's (B, H, T, D) layout
        half = torch.cat((-a[..., D // 2:], a[..., :D // 2]), -1)
        return (a * tc + half * ts).transpose(1, 2).contiguous()

    es = 2 if storage == "bf16" else 4
    for label, H in (("q", s["hq"]), ("k", s["hkv"])):
        rng = _rng(3 + H)
        x = ctx.bt_in(rng.standard_normal((B, T, H, D)), storage)
        g = ctx.bt_in(rng.standard_normal((B, H, T, D)), storage, grad=False)
        xr, gr = ctx.host(x), ctx.host(g)
        n = B * T * H * D
        tables = 2 * T * (D // 2) * 4
        _fwd_bwd_rows(ctx, "rope", storage, f"{B}x{T}x{H}x{D}", 2 * n * es + tables, 2 * n * es + tables,
                      lambda a: F.rope(a, cos, sin, transpose=True), (x,), (g,), tch, (ctx.torch_in(xr, storage),),
                      (ctx.torch_in(gr, storage, False),), {"y": rot(xr, sr).swapaxes(1, 2)},
                      {"dx": rot(gr.swapaxes(1, 2), -sr)}, ("y",), ("dx",), {"y": storage}, {"dx": storage},
                      label)
        ctx.free()


def bench_swiglu(ctx: Ctx, s: dict, storage: str) -> None:
    F, torch = ctx.bt.nn.functional, ctx.torch
    N, Fh = s["B"] * s["T"], s["ffn"]
    rng = _rng(5)
    a = ctx.bt_in(rng.standard_normal((N, Fh)) * 3, storage)
    b = ctx.bt_in(rng.standard_normal((N, Fh)), storage)
    g = ctx.bt_in(rng.standard_normal((N, Fh)), storage, grad=False)
    ar, br, gr = ctx.host(a), ctx.host(b), ctx.host(g)
    sg = 1 / (1 + np.exp(-ar))
    ref_fwd = {"y": ar * sg * br}
    ref_bwd = {"dgate": gr * br * sg * (1 + ar * (1 - sg)), "dup": gr * ar * sg}
    del sg
    es = 2 if storage == "bf16" else 4
    n = N * Fh
    _fwd_bwd_rows(ctx, "swiglu", storage, f"{N}x{Fh}", 3 * n * es, 5 * n * es, lambda p, q: F.swiglu(p, q), (a, b),
                  (g,), lambda p, q: torch.nn.functional.silu(p) * q,
                  (ctx.torch_in(ar, storage), ctx.torch_in(br, storage)), (ctx.torch_in(gr, storage, False),),
                  ref_fwd, ref_bwd, ("y",), ("dgate", "dup"), {"y": storage}, {"dgate": storage, "dup": storage})


BENCHES = {"rms_norm": (bench_rms_norm, ("f32", "bf16")), "add_rms_norm": (bench_add_rms_norm, ("f32", "bf16",
                                                                                                  "autocast")),
           "rope": (bench_rope, ("f32", "bf16")), "swiglu": (bench_swiglu, ("f32", "bf16"))}


def _gpu_or_exit(ap: argparse.ArgumentParser) -> str:
    """The GPU's name; a clear error (exit 2) without CuPy, a CUDA device or PyTorch with CUDA."""
    why = ""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            why = "CuPy sees no CUDA device"
    except Exception as e:  # noqa: BLE001
        why = f"CuPy with a CUDA device is needed: {type(e).__name__}: {e}"
    if not why:
        try:
            import torch

            if not torch.cuda.is_available():
                why = "PyTorch sees no CUDA device"
        except ImportError as e:
            why = f"PyTorch is needed for the comparison: {e}"
    if why:
        ap.error(f"--device cuda: {why} (--device cpu --size tiny runs the plumbing on the CPU)")
    props = cupy.cuda.runtime.getDeviceProperties(0)
    return props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(FAMILIES), help="comma list of kernel families")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--size", default="llama-1b", choices=tuple(SIZES))
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile columns")
    ap.add_argument("--reps", type=int, default=5, help="CPU: timed calls per measurement")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    fams = [f for f in args.only.split(",") if f]
    bad = sorted(set(fams) - set(FAMILIES))
    if bad or not fams:
        ap.error(f"--only: unknown kernel families {bad}; choose from {', '.join(FAMILIES)}")
    if args.device == "cpu" and args.size != "tiny":
        ap.error("--device cpu checks the plumbing only: use --size tiny (the llama-1b shapes are for the GPU)")
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    gpu = _gpu_or_exit(ap) if args.device == "cuda" else "cpu"
    import torch

    ctx = Ctx(args.device, not args.no_compile, args.reps)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    cmd = ["python3 benchmarks/kernels/bench_decoder.py --out OUT.json --only", ",".join(fams)]
    cmd += [f"--device {args.device}"] if args.device != "cuda" else []
    cmd += [f"--size {args.size}"] if args.size != "llama-1b" else []
    cmd += ["--no-compile"] if args.no_compile else []
    DOC.update(command=" ".join(cmd), commit=commit, device=gpu, torch=torch.__version__,
               sizes=SIZES[args.size], eps=EPS, tol={f"{p} {s}": v for (p, s), v in TOL.items()},
               torch_compile=ctx.compile)
    if args.device == "cuda":
        cp = mk._cp()
        mk.RES["copy_bw_GBps"] = DOC["copy_bw_GBps"] = mk.copy_bw()
        DOC["cupy"] = cp.__version__
        ctx.free()
        print(f"device {gpu}, CuPy {cp.__version__}, torch {torch.__version__}; copy {DOC['copy_bw_GBps']:.0f} GB/s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for fam in fams:
        fn, dtypes = BENCHES[fam]
        for dt in dtypes:
            try:
                fn(ctx, SIZES[args.size], dt)
            except Exception as e:  # noqa: BLE001 - a family that cannot even set up is recorded, the rest run
                DOC["errors"].append(dict(where=f"{fam} {dt}", error=f"{type(e).__name__}: {e}"[:400],
                                          tb=traceback.format_exc()[-2000:]))
                print(f"{fam} {dt}: ERROR {type(e).__name__}: {e}", flush=True)
            ctx.free()
        DOC["graph_errors"] = list(mk.RES["graph_errors"])
        checked = [r for r in DOC["rows"] if "ok" in r]
        DOC["checks"] = f"{sum(r['ok'] for r in checked)} of {len(checked)} passed"
        args.out.write_text(json.dumps(DOC, indent=1, default=str) + "\n")
    print(f"{len(DOC['rows'])} rows, checks {DOC.get('checks')}, {len(DOC['errors'])} errors -> {args.out}")
    failed = any(not r.get("ok", False) for r in DOC["rows"])
    return 1 if DOC["errors"] or failed else 0


if __name__ == "__main__":
    sys.exit(main())
