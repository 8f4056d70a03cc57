"""Check every compiled CPU kernel (src/blutensor/backends/numpy/kernels.c) against its float64 NumPy reference.

    .venv/bin/python packages/blutensor/dev/cpu_check.py [OUT_DIR] [--threads N]

The kernel-development convention: each kernel has a NumPy reference (``ops/nn_ops.py`` / ``optim``, the
generic kernels that also serve as the fallback, and the float64 formulas of ``kernel_reference.py`` that the
CUDA kernels are checked against) and a check here with the tolerance of ``kernel_reference.TOL['...']['f32']``,
run through blutensor's public API at the training step's shapes (GPT-2 tiny and d 384). Prints PASS/FAIL per
check; with OUT_DIR, writes ``OUT_DIR/cpu_check.json``. Speed: benchmarks/cpu_gpt2.py. The unit tests
(tests/test_cpu_ops.py) hold the same kernels to the same references over edge cases; this script is what to run
while changing a kernel.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import blutensor as bt  # noqa: E402
import blutensor.nn.functional as F  # noqa: E402
import kernel_reference as ref  # noqa: E402

SHAPES = {"tiny": dict(B=16, T=128, d=128, H=4, V=1024), "larger": dict(B=8, T=256, d=384, H=6, V=1024)}
R = np.random.default_rng(0)


def f32(*shape, scale=1.0):
    return (R.standard_normal(shape) * scale).astype(np.float32)


def grads_of(fn, *arrays):
    ts = [bt.tensor(a, requires_grad=True) if a.dtype.kind == "f" else bt.tensor(a) for a in arrays]
    out = fn(*ts)
    g = f32(*out.shape) if out.ndim else np.float32(1.0)
    out.backward(bt.tensor(g) if out.ndim else None)
    return out.numpy(), [t.grad.numpy() if t.requires_grad else None for t in ts], g


def checks(s: dict) -> list[tuple]:
    """(kernel name, fn -> [(part, output, float64 reference)]) per kernel."""
    B, T, d, H, V = s["B"], s["T"], s["d"], s["H"], s["V"]
    N = B * T
    x = f32(N, 4 * d, scale=2.0)
    ln_x, ln_w, ln_b = f32(N, d, scale=2.0) + 1.0, f32(d), f32(d)
    z, t = f32(N, V, scale=3.0), R.integers(0, V, N)
    idx, emb = R.integers(0, V, (B, T)), f32(V, d)
    hd = d // H
    q, k, v = f32(B, H, T, hd), f32(B, H, T, hd), f32(B, H, T, hd)

    def gelu():
        y, (gx,), g = grads_of(lambda a: F.gelu(a, approximate="tanh"), x)
        x64 = x.astype(np.float64)
        return [("fwd", y, ref.gelu(x64)), ("bwd", gx, ref.gelu_backward(g.astype(np.float64), x64))]

    def layer_norm():
        y, (gx, gw, gb), g = grads_of(lambda a, w, b: F.layer_norm(a, (d,), w, b), ln_x, ln_w, ln_b)
        x64, w64 = ln_x.astype(np.float64), ln_w.astype(np.float64)
        dx, dw, db = ref.layer_norm_backward(g.astype(np.float64), x64, w64)
        yr = ref.layer_norm(x64, w64, ln_b.astype(np.float64))[0]
        return [("fwd", y, yr), ("bwd", gx, dx), ("bwd", gw, dw), ("bwd", gb, db)]

    def cross_entropy():
        y, (gz, _), _ = grads_of(lambda a, b: F.cross_entropy(a, b), z, t)
        loss, p, _ = ref.cross_entropy(z.astype(np.float64), t)
        return [("loss", y, loss), ("grad", gz, p)]

    def embedding():
        _, (_, gw), g = grads_of(lambda i, w: F.embedding(i, w), idx, emb)
        return [("bwd", gw, ref.embedding_backward(idx.reshape(-1), g.reshape(-1, d).astype(np.float64), V))]

    def sdpa():
        y, (gq, gk, gv), g = grads_of(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
                                      q, k, v)
        q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
        o, _ = ref.sdpa(q64, k64, v64, causal=True)
        dq, dk, dv = ref.sdpa_backward(q64, k64, v64, g.astype(np.float64), causal=True)
        return [("fwd", y, o), ("bwd", gq, dq), ("bwd", gk, dk), ("bwd", gv, dv)]

    def adamw():
        p0, g = f32(N, d, scale=0.02), f32(N, d, scale=0.1)  # GPT-2 init scale: float32 p - p0 resolves the update
        p = bt.nn.Parameter(bt.tensor(p0.copy()))
        opt = bt.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        p.grad = bt.tensor(g)
        opt.step()
        want = ref.adamw(p0.astype(np.float64), g.astype(np.float64), 0.0, 0.0, 1, 1e-3, 0.9, 0.95, 1e-8, 0.1)[0]
        return [("f32", p.numpy() - p0, want - p0)]

    def grad_norm():
        grads = [f32(*sh) for sh in ((V, d), (4 * d, d), (d,), (3 * d, d))]
        ps = [bt.nn.Parameter(bt.tensor(np.zeros_like(gr))) for gr in grads]
        for pp, gr in zip(ps, grads):
            pp.grad = bt.tensor(gr.copy())
        total = bt.optim.clip_grad_norm_(ps, 1e9)
        return [("f32", total.numpy(), np.asarray(ref.grad_norm(grads)))]

    return [("gelu", gelu), ("layer_norm", layer_norm), ("cross_entropy", cross_entropy), ("embedding", embedding),
            ("sdpa", sdpa), ("adamw", adamw), ("grad_norm", grad_norm)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    if a.threads:
        bt.set_num_threads(a.threads)
    st = bt.backends.numpy.status()
    print(f"compiled CPU kernels: {st}; threads {bt.get_num_threads()}")
    rows, failed = [], 0
    for sname, shape in SHAPES.items():
        for name, fn in checks(shape):
            for part, out, want in fn():
                key = f"{name}.{part}" if f"{name}.{part}" in ref.TOL else name
                tol = ref.TOL[key]["f32"]
                err = ref.rel_err(out, want)
                ok = err <= tol
                failed += not ok
                rows.append({"shapes": sname, "check": f"{name}.{part}", "rel_err": err, "tol": tol, "pass": ok})
                print(f"{'PASS' if ok else 'FAIL'} {sname:<7} {name}.{part:<5} rel err {err:.2e} (tol {tol:.0e})")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "cpu_check.json").write_text(json.dumps({"status": st, "threads": bt.get_num_threads(),
                                                                "rows": rows}, indent=1, default=str) + "\n")
    print(f"{len([r for r in rows if 'pass' in r]) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
