"""The CUDA kernels' correctness checks against the NumPy float64 references of dev/kernel_reference.py, at the
tolerances in kernel_reference.TOL: LayerNorm, GELU, the fused cross-entropy, embedding, multi-tensor AdamW,
the gradient norm, flash attention (f32 SIMT, tf32 and bf16 mma) and the op kernel classes through blutensor's
dispatch against the generic CPU ops. tests/test_cuda_kernels.py runs each check_* as one cuda-marked test
(and dev/launch_argcheck.py runs them on a CuPy stand-in to compare launch arguments with the C signatures).
Each check appends its cases to RESULTS["checks"] (kernel, variant, error, tolerance, passed) and an
exception to RESULTS["errors"], so one failing case does not hide the others of the same kernel.
"""

from __future__ import annotations

import math
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dev"))
import kernel_reference as ref  # noqa: E402
import numpy as np  # noqa: E402

RESULTS: dict = {"checks": [], "errors": []}


def cp_mod():
    import cupy

    return cupy


# ------------------------------------------------------------------ helpers
def dev(a64, storage: str):
    """(device array, float64 values it holds) for storage 'f32' or 'bf16'."""
    cp = cp_mod()
    if storage == "bf16":
        bits = ref.f32_to_bf16_bits(np.asarray(a64, np.float32))
        return cp.asarray(bits), ref.bf16_bits_to_f64(bits)
    h = np.asarray(a64, np.float32)
    return cp.asarray(h), h.astype(np.float64)


def host(a):
    cp = cp_mod()
    h = cp.asnumpy(a)
    if h.dtype == np.uint16:
        return ref.bf16_bits_to_f64(h)
    return h.astype(np.float64)


def record(kernel: str, variant: str, err: float, tol: float, extra: str = "") -> None:
    ok = err <= tol
    RESULTS["checks"].append(dict(kernel=kernel, variant=variant, err=err, tol=tol, passed=ok, info=extra))
    print(f"{'PASS' if ok else 'FAIL'}  {kernel:22s} {variant:34s} err={err:.3e} tol={tol:.1e} {extra}", flush=True)


def check(kernel: str, variant: str, out, expect, tol_key: str, storage: str, extra: str = "") -> None:
    record(
        kernel,
        variant,
        ref.rel_err(host(out) if not isinstance(out, np.ndarray) else out, expect),
        ref.TOL[tol_key][storage],
        extra,
    )


def guarded(fn):
    def run():
        try:
            fn()
        except Exception as e:
            msg = f"{fn.__name__}: {type(e).__name__}: {e}"
            RESULTS["errors"].append(dict(where=fn.__name__, error=msg, tb=traceback.format_exc()[-3000:]))
            print(f"ERROR {msg}\n{traceback.format_exc()[-1500:]}", flush=True)

    run.__name__ = fn.__name__
    return run


RNG = np.random.default_rng(20261129)


# ------------------------------------------------------------------ checks
@guarded
def check_layer_norm():
    from blutensor.backends.cupy.layer_norm import layer_norm_backward, layer_norm_forward

    for storage in ("f32", "bf16"):
        for N, C, resid in ((7, 771, False), (33, 768, True), (130, 1600, False), (5, 37, True)):
            x, x64 = dev(RNG.standard_normal((N, C)) * 2 + 0.5, storage)
            w, w64 = dev(RNG.standard_normal(C), storage)
            b, b64 = dev(RNG.standard_normal(C), storage)
            r, r64 = dev(RNG.standard_normal((N, C)), storage) if resid else (None, None)
            y, mean, rstd, s = layer_norm_forward(x, w, b, 1e-5, residual=r)
            s64 = x64 + r64 if resid else x64
            if storage == "bf16" and resid:
                s64 = ref.bf16_round(s64)  # the kernel normalises the bf16-rounded residual sum
            ey, emu, ers, _ = ref.layer_norm(s64, w64, b64, 1e-5)
            tag = f"{storage} {N}x{C}{' +resid' if resid else ''}"
            check("layer_norm.fwd", tag, y, ey, "layer_norm.fwd", storage)
            record("layer_norm.fwd.stats", tag, max(ref.rel_err(host(mean), emu), ref.rel_err(host(rstd), ers)), 2e-6)
            if resid:
                check("layer_norm.fwd.sum", tag, s, s64, "layer_norm.fwd", storage)
            g, g64 = dev(RNG.standard_normal((N, C)), storage)
            gs, gs64 = dev(RNG.standard_normal((N, C)), storage) if resid else (None, None)
            xin = s if resid else x
            dx, dw, db = layer_norm_backward(g, xin, w, mean, rstd, grad_sum=gs)
            edx, edw, edb = ref.layer_norm_backward(g64, s64, w64, 1e-5)
            if resid:
                edx = edx + gs64
            check("layer_norm.bwd.dx", tag, dx, edx, "layer_norm.bwd", storage)
            check("layer_norm.bwd.dw", tag, dw, edw, "layer_norm.bwd", storage)
            check("layer_norm.bwd.db", tag, db, edb, "layer_norm.bwd", storage)
            if storage == "f32" and N == 130:
                _, dw2, db2 = layer_norm_backward(g, xin, w, mean, rstd)
                same = bool((dw2 == dw).all()) and bool((db2 == db).all())
                record("layer_norm.bwd.determinism", tag, 0.0 if same else 1.0, 0.0)


@guarded
def check_gelu():
    from blutensor.backends.cupy.gelu import gelu_backward, gelu_forward

    for storage in ("f32", "bf16"):
        for approx in ("tanh", "none"):
            for n in (300_007, 4096):
                x, x64 = dev(RNG.standard_normal(n) * 3, storage)
                g, g64 = dev(RNG.standard_normal(n), storage)
                tag = f"{storage} {approx} n={n}"
                check("gelu.fwd", tag, gelu_forward(x, approx), ref.gelu(x64, approx), "gelu.fwd", storage)
                check(
                    "gelu.bwd",
                    tag,
                    gelu_backward(g, x, approx),
                    ref.gelu_backward(g64, x64, approx),
                    "gelu.bwd",
                    storage,
                )
        # unaligned view (scalar path)
        x, x64 = dev(RNG.standard_normal(1001), storage)
        xs = x[1:]  # 4- or 2-byte offset: scalar path
        check(
            "gelu.fwd",
            f"{storage} unaligned view",
            gelu_forward(xs, "tanh"),
            ref.gelu(x64[1:], "tanh"),
            "gelu.fwd",
            storage,
        )


@guarded
def check_cross_entropy():
    from blutensor.backends.cupy.cross_entropy import cross_entropy_forward, scale_grad_

    cp = cp_mod()
    for storage in ("f32", "bf16"):
        for N, C, ls, red in (
            (37, 50257, 0.0, "mean"),
            (64, 50304, 0.0, "mean"),
            (19, 1003, 0.1, "sum"),
            (23, 512, 0.0, "none"),
        ):
            z, z64 = dev(RNG.standard_normal((N, C)) * 3, storage)
            t_h = RNG.integers(0, C, N)
            t_h[::5] = -100
            t = cp.asarray(t_h.astype(np.int64))
            eloss, egrad, else_ = ref.cross_entropy(z64, t_h, -100, red, ls)
            tag = f"{storage} {N}x{C} ls={ls} {red}"
            loss, grad, lse = cross_entropy_forward(z, t, -100, red, ls, want_grad=True, inplace_grad=False)
            check("cross_entropy.loss", tag, loss, np.asarray(eloss), "cross_entropy.loss", storage)
            record("cross_entropy.lse", tag, ref.rel_err(host(lse), else_), 1e-5)
            check("cross_entropy.grad", tag, grad, egrad, "cross_entropy.grad", storage)
            if red == "mean":
                gval = 0.25
                g, _ = dev(np.array([gval]), storage)
                scale_grad_(grad, g)
                check("cross_entropy.grad", tag + " x0.25", grad, egrad * gval, "cross_entropy.grad", storage)
                z2, _ = dev(z64, storage)
                _, grad2, _ = cross_entropy_forward(z2, t, -100, red, ls, want_grad=True, inplace_grad=True)
                same = grad2.data.ptr == z2.data.ptr
                check(
                    "cross_entropy.grad",
                    tag + " inplace",
                    grad2,
                    egrad,
                    "cross_entropy.grad",
                    storage,
                    "" if same else "NOT IN PLACE",
                )
            if C % 8 == 0:  # also the two-pass kernel (rows re-read from L2) on a vectorisable width
                import blutensor.backends.cupy.cross_entropy as ce_mod

                ce_mod.USE_SMEM_ROW = False
                try:
                    _, grad2, _ = cross_entropy_forward(z, t, -100, red, ls, want_grad=True, inplace_grad=False)
                finally:
                    ce_mod.USE_SMEM_ROW = True
                check("cross_entropy.grad", tag + " two-pass", grad2, egrad, "cross_entropy.grad", storage)
            if red == "none":
                gr, gr64 = dev(RNG.standard_normal(N), storage)
                scale_grad_(grad, gr)
                check(
                    "cross_entropy.grad", tag + " per-row g", grad, egrad * gr64[:, None], "cross_entropy.grad", storage
                )


@guarded
def check_embedding():
    from blutensor.backends.cupy.embedding import embedding_backward, embedding_forward

    cp = cp_mod()
    for storage in ("f32", "bf16"):
        for V, C, N in ((1001, 771, 4097), (8192, 768, 2048), (17, 64, 300)):
            w, w64 = dev(RNG.standard_normal((V, C)), storage)
            idx_h = RNG.integers(0, V, N)
            idx_h[: N // 4] = idx_h[0]  # a long run of one token
            idx = cp.asarray(idx_h.astype(np.int64))
            tag = f"{storage} V={V} C={C} N={N}"
            check("embedding.fwd", tag, embedding_forward(idx, w), w64[idx_h], "embedding.fwd", storage)
            g, g64 = dev(RNG.standard_normal((N, C)), storage)
            dw = embedding_backward(idx, g, V)
            check("embedding.bwd", tag, dw, ref.embedding_backward(idx_h, g64, V), "embedding.bwd", storage)
            dw2 = embedding_backward(idx, g, V)
            record("embedding.bwd.determinism", tag, 0.0 if bool((dw2 == dw).all()) else 1.0, 0.0)


@guarded
def check_adamw():
    from blutensor.backends.cupy.adamw import multi_tensor_adamw

    cp = cp_mod()
    sizes = [768, 1, 300_001, 2304 * 768, 65536, 65537, 3]
    for storage in ("f32", "bf16"):
        for dev_hyper in (False, True):
            ps, p64 = zip(*(dev(RNG.standard_normal(n), storage) for n in sizes))
            ps, p64 = list(ps), list(p64)
            p_init = [a.copy() for a in p64]
            ms = [cp.zeros(n, cp.float32) for n in sizes]
            vs = [cp.zeros(n, cp.float32) for n in sizes]
            m64 = [np.zeros(n) for n in sizes]
            v64 = [np.zeros(n) for n in sizes]
            lr, b1, b2, eps, wd = (1e-2 if storage == "f32" else 1e-1), 0.9, 0.95, 1e-8, 0.1
            for step in (1, 2, 3):
                gs, g64 = zip(*(dev(RNG.standard_normal(n) * 0.1, storage) for n in sizes))
                if dev_hyper:
                    multi_tensor_adamw(
                        ps,
                        list(gs),
                        ms,
                        vs,
                        cp.asarray([step], cp.float32),
                        cp.asarray([lr], cp.float32),
                        b1,
                        b2,
                        eps,
                        wd,
                    )
                else:
                    multi_tensor_adamw(ps, list(gs), ms, vs, step, lr, b1, b2, eps, wd)
                for i in range(len(sizes)):
                    p64[i], m64[i], v64[i] = ref.adamw(p64[i], g64[i], m64[i], v64[i], step, lr, b1, b2, eps, wd)
                    if storage == "bf16":
                        p64[i] = ref.bf16_round(p64[i])  # the parameter is stored in bf16 after each step
            tag = f"{storage} {len(sizes)} tensors, 3 steps, {'device' if dev_hyper else 'host'} lr/step"
            if storage == "f32":  # compare the updates (params move by ~lr per step)
                err_p = max(ref.rel_err(host(ps[i]) - p_init[i], p64[i] - p_init[i]) for i in range(len(sizes)))
            else:  # bf16 params: error in bf16 ulps of the largest magnitude the element had (start, end,
                # or the 3 steps' movement), so a 1-ulp rounding flip early on stays 1 ulp if the value later
                # crosses zero
                err_p = max(
                    float(
                        np.max(
                            np.abs(host(ps[i]) - p64[i])
                            / (np.maximum(np.maximum(np.abs(p64[i]), np.abs(p_init[i])), 3 * lr) * 2**-7)
                        )
                    )
                    for i in range(len(sizes))
                )
            err_m = max(ref.rel_err(host(ms[i]), m64[i]) for i in range(len(sizes)))
            err_v = max(ref.rel_err(host(vs[i]), v64[i]) for i in range(len(sizes)))
            record("adamw.param", tag, err_p, ref.TOL["adamw"][storage], "" if storage == "f32" else "(ulps)")
            record("adamw.exp_avg", tag, err_m, 1e-5)
            record("adamw.exp_avg_sq", tag, err_v, 1e-5)


@guarded
def check_grad_norm():
    from blutensor.backends.cupy.norm import clip_grads_, global_grad_norm

    sizes = [768, 1, 300_001, 2304 * 768, 65537]
    for storage in ("f32", "bf16"):
        gs, g64 = zip(*(dev(RNG.standard_normal(n), storage) for n in sizes))
        n = global_grad_norm(list(gs))
        e = ref.grad_norm(g64)
        record("grad_norm", f"{storage} {len(sizes)} tensors", abs(float(n) - e) / e, ref.TOL["grad_norm"][storage])
        clip_grads_(list(gs), 1.0, n)
        n2 = float(global_grad_norm(list(gs)))
        record("grad_norm.clip", f"{storage} to 1.0", abs(n2 - 1.0), 1e-4 if storage == "f32" else 1e-2)


def _sdpa_case(variant, B, H, L, S, hd, causal, with_bwd=True):
    from blutensor.backends.cupy.sdpa import flash_attention_backward, flash_attention_forward

    storage = "bf16" if variant == "bf16" else "f32"
    q, q64 = dev(RNG.standard_normal((B * H, L, hd)), storage)
    k, k64 = dev(RNG.standard_normal((B * H, S, hd)), storage)
    v, v64 = dev(RNG.standard_normal((B * H, S, hd)), storage)
    o, lse = flash_attention_forward(q, k, v, causal, None, variant)
    eo, else_ = ref.sdpa(q64, k64, v64, causal)
    tag = f"{variant} {B}x{H} L={L} S={S} hd={hd} causal={int(causal)}"
    check("sdpa.fwd.o", tag, o, eo, "sdpa.fwd", variant)
    record("sdpa.fwd.lse", tag, ref.rel_err(host(lse), else_), ref.TOL["sdpa.fwd"][variant])
    if not with_bwd:
        return
    do, do64 = dev(RNG.standard_normal((B * H, L, hd)), storage)
    dq, dk, dv = flash_attention_backward(q, k, v, o, lse, do, causal, None, variant)
    edq, edk, edv = ref.sdpa_backward(q64, k64, v64, do64, causal)
    for name, a, e in (("dq", dq, edq), ("dk", dk, edk), ("dv", dv, edv)):
        check(f"sdpa.bwd.{name}", tag, a, e, "sdpa.bwd", variant)


def _sdpa_checks(variant):
    hds = (32, 64, 128) if variant == "f32" else (64, 128)
    for hd in hds:
        for causal in (False, True):
            _sdpa_case(variant, 2, 3, 77, 77, hd, causal)
    _sdpa_case(variant, 1, 2, 256, 256, 64, True)
    _sdpa_case(variant, 1, 2, 100, 130, 64, False)
    _sdpa_case(variant, 1, 1, 130, 100, 64, True)


@guarded
def check_sdpa_f32():
    _sdpa_checks("f32")


def _sdpa_mma_checks(variant):
    """Checks of one mma variant; when one fails, re-run two cases on fallback builds of sdpa_mma.cu
    (-DBLU_NO_LDMATRIX: plain shared loads; -DBLU_SYNC_TILES: no cp.async pipeline) to localise the fault."""
    n0 = len(RESULTS["checks"])
    _sdpa_checks(variant)
    if all(c["passed"] for c in RESULTS["checks"][n0:]):
        return
    from blutensor.backends.cupy import _loader

    cp = cp_mod()
    d = cp.cuda.runtime.getDevice()
    src = (_loader.KERNEL_DIR / "sdpa_mma.cu").read_text()
    cc = cp.cuda.Device(d).compute_capability
    saved = _loader._modules.get(("sdpa_mma.cu", d))
    try:
        for defines in (("-DBLU_NO_LDMATRIX",), ("-DBLU_SYNC_TILES",), ("-DBLU_NO_LDMATRIX", "-DBLU_SYNC_TILES")):
            print(f"  {variant} attention failed: re-running with {' '.join(defines)}", flush=True)
            _loader._modules[("sdpa_mma.cu", d)] = cp.RawModule(code=src, options=_loader.compile_options(cc) + defines)
            _loader._functions.clear()
            _loader._smem_set.clear()
            n1 = len(RESULTS["checks"])
            _sdpa_case(variant, 2, 3, 77, 77, 64, False)
            _sdpa_case(variant, 2, 3, 77, 77, 64, True)
            for c in RESULTS["checks"][n1:]:
                c["variant"] += " [" + " ".join(defines) + "]"
    finally:
        _loader._modules[("sdpa_mma.cu", d)] = saved
        _loader._functions.clear()
        _loader._smem_set.clear()


@guarded
def check_sdpa_bf16():
    _sdpa_mma_checks("bf16")


@guarded
def check_sdpa_tf32():
    _sdpa_mma_checks("tf32")


@guarded
def check_plugins():
    """The op kernel classes through blutensor's dispatch vs the generic CPU ops (fp32)."""
    import blutensor as bt
    import blutensor.nn.functional as F
    from blutensor.ops.dispatch import resolve

    for op in ("layer_norm", "gelu", "cross_entropy", "embedding", "sdpa"):
        for dt in ("float32", "bfloat16"):
            k = resolve(op, "cuda", dt)
            record("plugin.resolve", f"{op} {dt} -> {k.PLUGIN_NAME}", 0.0 if ".cuda." in k.PLUGIN_NAME else 1.0, 0.0)

    def run(device, fn, *arrays, dtype=None):
        ts = [
            bt.tensor(a, device=device, requires_grad=True, dtype=dtype)
            if a.dtype.kind == "f"
            else bt.tensor(a, device=device)
            for a in arrays
        ]
        out = fn(*ts)
        out.backward(bt.ones_like(out)) if out.ndim else out.backward()
        return out.numpy().astype(np.float64), [t.grad.numpy().astype(np.float64) for t in ts if t.requires_grad]

    x = RNG.standard_normal((6, 9, 96)).astype(np.float32)
    w = RNG.standard_normal(96).astype(np.float32)
    b = RNG.standard_normal(96).astype(np.float32)
    cases = {
        "layer_norm": (lambda x, w, b: F.layer_norm(x, (96,), w, b), x, w, b),
        "gelu": (lambda x: F.gelu(x, approximate="tanh"), x),
        "sdpa": (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            *(RNG.standard_normal((2, 3, 33, 64)).astype(np.float32) for _ in range(3)),
        ),
        "cross_entropy": (
            lambda z, t: F.cross_entropy(z, t),
            RNG.standard_normal((45, 301)).astype(np.float32),
            RNG.integers(0, 301, 45).astype(np.int64),
        ),
        "embedding": (
            lambda i, w: F.embedding(i, w),
            RNG.integers(0, 50, (4, 7)).astype(np.int64),
            RNG.standard_normal((50, 40)).astype(np.float32),
        ),
    }
    # bad indices give a clear ShapeError naming the op: lazily (default: recorded on device, raised by
    # index_check.raise_pending(), which the Trainer calls after every loss read and after evaluation) and
    # at the call under the policy's validate_indices='sync', like the generic ops
    from blutensor.backends.cupy import index_check
    from blutensor.errors import ShapeError

    w = bt.tensor(RNG.standard_normal((50, 8)).astype(np.float32), device="cuda")
    index_check.flag_array().fill(0)  # start from a clear flag
    for mode in ("lazy", "sync"):
        scope = bt.policy.scope(validate_indices=mode)
        scope.__enter__()
        for name, op, call in (
            ("embedding index 50 of 50", "embedding",
             lambda: F.embedding(bt.tensor(np.array([3, 50]), device="cuda"), w)),
            ("cross_entropy target 8 of 8", "cross_entropy",
             lambda: F.cross_entropy(w[:2], bt.tensor(np.array([1, 8]), device="cuda"))),
        ):
            try:
                call()
                if mode == "lazy":
                    index_check.raise_pending()
                record("plugin.bad_index", f"{name} ({mode})", 1.0, 0.0, "no error raised")
            except ShapeError as e:
                ok = op in str(e) and index_check.pending() is None  # names the op; the flag is cleared
                record("plugin.bad_index", f"{name} ({mode})", 0.0 if ok else 1.0, 0.0, str(e)[:120])
            except Exception as e:
                record("plugin.bad_index", f"{name} ({mode})", 1.0, 0.0, f"{type(e).__name__}: {e}"[:200])
        scope.__exit__(None, None, None)
    for dtname, dtype, tol in (("f32", None, 1e-4), ("bf16", bt.bfloat16, 4e-2)):
        for name, (fn, *arrays) in cases.items():
            try:
                oc, gc = run("cpu", fn, *arrays, dtype=dtype)
                og, gg = run("cuda", fn, *arrays, dtype=dtype)
                err = max([ref.rel_err(og, oc)] + [ref.rel_err(a, e) for a, e in zip(gg, gc)])
                record("plugin.dispatch", f"{name} {dtname} cuda vs cpu (fwd+bwd)", err, tol)
            except Exception as e:  # one op must not hide the others
                record(
                    "plugin.dispatch",
                    f"{name} {dtname} cuda vs cpu (fwd+bwd)",
                    math.inf,
                    tol,
                    f"{type(e).__name__}: {e}"[:300],
                )



# ------------------------------------------------------------------ every launch path of the memory-bound kernels
#: odd sizes that reach each launch path: register-resident and generic LayerNorm widths, persistent cross-entropy
#: grids with more rows than blocks, unaligned and tail GELU sizes, bf16 gradient norms; bitwise determinism of the
#: reductions and equality of the launch variants
PATHS_RNG = np.random.default_rng(5150)


@guarded
def check_layer_norm_paths():
    from blutensor.backends.cupy import layer_norm as ln

    cp = cp_mod()
    cases = [(3, 8), (129, 36), (1000, 768), (33, 1000), (517, 768), (65, 1032), (40, 1600), (7, 771), (700, 96)]
    for storage in ("f32", "bf16"):
        for i, (N, C) in enumerate(cases):
            resid = i % 2 == 1
            affine = i % 3 != 2
            x, x64 = dev(PATHS_RNG.standard_normal((N, C)) * 2 + 0.5, storage)
            w, w64 = dev(PATHS_RNG.standard_normal(C), storage) if affine else (None, np.ones(C))
            b, b64 = dev(PATHS_RNG.standard_normal(C), storage) if affine else (None, np.zeros(C))
            r, r64 = dev(PATHS_RNG.standard_normal((N, C)), storage) if resid else (None, None)
            y, mean, rstd, s = ln.layer_norm_forward(x, w, b, 1e-5, residual=r)
            s64 = x64 + r64 if resid else x64
            if storage == "bf16" and resid:
                s64 = ref.bf16_round(s64)
            ey, emu, ers, _ = ref.layer_norm(s64, w64, b64, 1e-5)
            nv = ln.reg_nv(C, x.dtype.itemsize, ln._FWD_NV) if C % (16 // x.dtype.itemsize) == 0 else None
            tag = f"{storage} {N}x{C}{' +resid' if resid else ''}{'' if affine else ' no-affine'} r{nv}"
            record("layer_norm.fwd", tag, ref.rel_err(host(y), ey), ref.TOL["layer_norm.fwd"][storage])
            record("layer_norm.fwd.stats", tag, max(ref.rel_err(host(mean), emu), ref.rel_err(host(rstd), ers)), 2e-6)
            if resid:
                record("layer_norm.fwd.sum", tag, ref.rel_err(host(s), s64), ref.TOL["layer_norm.fwd"][storage])
            g, g64 = dev(PATHS_RNG.standard_normal((N, C)), storage)
            gs, gs64 = dev(PATHS_RNG.standard_normal((N, C)), storage) if resid else (None, None)
            xin = s if resid else x
            dx, dw, db = ln.layer_norm_backward(g, xin, w, mean, rstd, grad_sum=gs)
            edx, edw, edb = ref.layer_norm_backward(g64, s64, w64, 1e-5)
            if resid:
                edx = edx + gs64
            tol = ref.TOL["layer_norm.bwd"][storage]
            record("layer_norm.bwd.dx", tag, ref.rel_err(host(dx), edx), tol)
            if affine:
                record("layer_norm.bwd.dw", tag, ref.rel_err(host(dw), edw), tol)
            record("layer_norm.bwd.db", tag, ref.rel_err(host(db), edb), tol)
            dx2, dw2, db2 = ln.layer_norm_backward(g, xin, w, mean, rstd, grad_sum=gs)
            same = bool((dx2 == dx).all()) and bool((db2 == db).all()) and (dw is None or bool((dw2 == dw).all()))
            record("layer_norm.bwd.determinism", tag, 0.0 if same else 1.0, 0.0)
            acc0 = ln.BWD_SMEM_ACC  # the other dW/db variant: the same fp32 operations in the same order
            ln.BWD_SMEM_ACC = not acc0
            try:
                dx5, dw5, db5 = ln.layer_norm_backward(g, xin, w, mean, rstd, grad_sum=gs)
            finally:
                ln.BWD_SMEM_ACC = acc0
            same = bool((dx5 == dx).all()) and bool((db5 == db).all()) and (dw is None or bool((dw5 == dw).all()))
            record("layer_norm.bwd smem-acc == reg-acc", tag, 0.0 if same else 1.0, 0.0)
            if i % 4 == 0:  # parameter grads only (need_dx False) and dx only
                _, dw3, db3 = ln.layer_norm_backward(g, xin, w, mean, rstd, grad_sum=gs, need_dx=False)
                record("layer_norm.bwd.db(no dx)", tag, float(not bool((db3 == db).all())), 0.0)
                dx4, _, _ = ln.layer_norm_backward(g, xin, w, mean, rstd, grad_sum=gs, need_dw=False, need_db=False)
                record("layer_norm.bwd.dx(no dw)", tag, float(not bool((dx4 == dx).all())), 0.0)
    cp.cuda.Device().synchronize()


@guarded
def check_gelu_paths():
    from blutensor.backends.cupy import gelu as ge

    for storage in ("f32", "bf16"):
        for approx in ("tanh", "none"):
            for n in (7, 1_000_003):
                x, x64 = dev(PATHS_RNG.standard_normal(n) * 3, storage)
                g, g64 = dev(PATHS_RNG.standard_normal(n), storage)
                tag = f"{storage} {approx} n={n}"
                record(
                    "gelu.fwd",
                    tag,
                    ref.rel_err(host(ge.gelu_forward(x, approx)), ref.gelu(x64, approx)),
                    ref.TOL["gelu.fwd"][storage],
                )
                record(
                    "gelu.bwd",
                    tag,
                    ref.rel_err(host(ge.gelu_backward(g, x, approx)), ref.gelu_backward(g64, x64, approx)),
                    ref.TOL["gelu.bwd"][storage],
                )
                if n == 1_000_003:  # the launch variants compute the same values bit for bit
                    y0, d0 = ge.gelu_forward(x, approx), ge.gelu_backward(g, x, approx)
                    for knob, val in (("PLAIN", True), ("ONE_WAVE", False)):
                        old = getattr(ge, knob)
                        setattr(ge, knob, val)
                        try:
                            y1, d1 = ge.gelu_forward(x, approx), ge.gelu_backward(g, x, approx)
                        finally:
                            setattr(ge, knob, old)
                        same = bool((y1 == y0).all()) and bool((d1 == d0).all())
                        record("gelu variant == default", f"{tag} {knob}={val}", 0.0 if same else 1.0, 0.0)
        x, x64 = dev(PATHS_RNG.standard_normal(100_003) * 4, storage)
        g, g64 = dev(PATHS_RNG.standard_normal(100_003), storage)
        record(
            "gelu.bwd",
            f"{storage} unaligned views",
            ref.rel_err(host(ge.gelu_backward(g[1:], x[1:], "tanh")), ref.gelu_backward(g64[1:], x64[1:], "tanh")),
            ref.TOL["gelu.bwd"][storage],
        )
    # fp32 tanh-form accuracy on a dense sweep (the fast exp formulation): relative to max |value|
    x64 = np.linspace(-12, 12, 2_000_001)
    x, x64 = dev(x64, "f32")
    record(
        "gelu.fwd",
        "f32 tanh sweep [-12,12]",
        ref.rel_err(host(ge.gelu_forward(x, "tanh")), ref.gelu(x64, "tanh")),
        ref.TOL["gelu.fwd"]["f32"],
    )
    y = host(ge.gelu_forward(x, "tanh"))
    u64 = 0.7978845608028654 * (x64 + 0.044715 * x64**3)
    ey = x64 / (1.0 + np.exp(-2.0 * u64))
    ok = (x64 >= -2.0) & (ey != 0)
    record(
        "gelu.fwd pointwise rel", "f32 tanh x in [-2,12]", float(np.max(np.abs(y[ok] - ey[ok]) / np.abs(ey[ok]))), 1e-6
    )
    one, _ = dev(np.ones_like(x64), "f32")
    record(
        "gelu.bwd",
        "f32 tanh sweep [-12,12]",
        ref.rel_err(host(ge.gelu_backward(one, x, "tanh")), ref.gelu_backward(np.ones_like(x64), x64, "tanh")),
        ref.TOL["gelu.bwd"]["f32"],
    )


def _cross_entropy_paths(storages: tuple[str, ...]) -> None:
    from blutensor.backends.cupy import cross_entropy as ce
    from blutensor.backends.cupy.occupancy import full_grid

    cp = cp_mod()
    for storage in storages:
        for N, C, ls, red in (
            (1, 8, 0.0, "mean"),
            (300, 50304, 0.0, "mean"),
            (300, 4096, 0.1, "sum"),
            (1200, 1000, 0.0, "none"),
            (77, 50264, 0.0, "mean"),
        ):
            z, z64 = dev(PATHS_RNG.standard_normal((N, C)) * 3, storage)
            t_h = PATHS_RNG.integers(0, C, N)
            t_h[::7] = -100
            t_h[-1] = C - 1
            t = cp.asarray(t_h.astype(np.int64))
            eloss, egrad, else_ = ref.cross_entropy(z64, t_h, -100, red, ls)
            name = f"blu_cross_entropy_forward_smem_{storage}"
            blk = 512 if storage == "bf16" else 1024
            grid = full_grid("cross_entropy.cu", name, blk, N, C * z.dtype.itemsize)
            tag = f"{storage} {N}x{C} ls={ls} {red} grid={grid}"
            for inplace in (False, True):
                zz = z.copy() if inplace else z
                loss, grad, lse = ce.cross_entropy_forward(zz, t, -100, red, ls, want_grad=True, inplace_grad=inplace)
                tg = tag + (" inplace" if inplace else "")
                record(
                    "cross_entropy.loss",
                    tg,
                    ref.rel_err(host(loss), np.asarray(eloss)),
                    ref.TOL["cross_entropy.loss"][storage],
                )
                record("cross_entropy.lse", tg, ref.rel_err(host(lse), else_), 1e-5)
                record("cross_entropy.grad", tg, ref.rel_err(host(grad), egrad), ref.TOL["cross_entropy.grad"][storage])
                if inplace:
                    record("cross_entropy.inplace", tg, float(grad.data.ptr != zz.data.ptr), 0.0)
                else:
                    _, grad2, _ = ce.cross_entropy_forward(z, t, -100, red, ls, want_grad=True)
                    record("cross_entropy.determinism", tg, float(not bool((grad2 == grad).all())), 0.0)


@guarded
def check_cross_entropy_paths_f32():
    """The fused cross-entropy's launch paths on fp32 logits (the float64 references of 50k-class rows take the
    time: one storage per test)."""
    _cross_entropy_paths(("f32",))


@guarded
def check_cross_entropy_paths_bf16():
    _cross_entropy_paths(("bf16",))


@guarded
def check_grad_norm_paths():
    from blutensor.backends.cupy.norm import clip_grads_, global_grad_norm

    for storage in ("f32", "bf16"):
        for sizes in ([1], [7, 8, 16384, 16385, 16391], [3 * 16384 + 5, 1, 100_000, 2_359_296]):
            gs, g64 = zip(*(dev(PATHS_RNG.standard_normal(n), storage) for n in sizes))
            n1 = global_grad_norm(list(gs))
            e = ref.grad_norm(g64)
            tag = f"{storage} {len(sizes)} tensors {sum(sizes)} el"
            record("grad_norm", tag, abs(float(n1) - e) / e, ref.TOL["grad_norm"][storage])
            n2 = global_grad_norm(list(gs))
            record("grad_norm.determinism", tag, float(float(n1) != float(n2)), 0.0)
            coef = 0.5 * e / (float(n1) + 1e-6)
            clip_grads_(list(gs), 0.5 * e, n1)
            err = max(ref.rel_err(host(a), a64 * coef) for a, a64 in zip(gs, g64))
            record("grad_norm.clip", tag + " x0.5", err, 1e-6 if storage == "f32" else 4e-3)
        # a view at an odd element offset (unaligned: scalar path)
        big, big64 = dev(PATHS_RNG.standard_normal(40_001), storage)
        record(
            "grad_norm",
            f"{storage} unaligned view",
            abs(float(global_grad_norm([big[1:]])) - ref.grad_norm([big64[1:]])) / ref.grad_norm([big64[1:]]),
            ref.TOL["grad_norm"][storage],
        )

CHECKS = (
    check_layer_norm,
    check_gelu,
    check_cross_entropy,
    check_embedding,
    check_adamw,
    check_grad_norm,
    check_sdpa_f32,
    check_sdpa_bf16,
    check_sdpa_tf32,
    check_plugins,
    check_layer_norm_paths,
    check_gelu_paths,
    check_cross_entropy_paths_f32,
    check_cross_entropy_paths_bf16,
    check_grad_norm_paths,
)
