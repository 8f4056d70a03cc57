"""blutensor's CUDA kernels: layer_norm, gelu, fused cross-entropy, embedding, multi-tensor AdamW,
grad norm, flash attention (f32 SIMT, tf32 and bf16 mma).

GPU tests (marked ``cuda``) run the checks of tests/kernel_checks.py against NumPy float64 references
(dev/kernel_reference.py) at the tolerances in ``kernel_reference.TOL`` and skip without CuPy or a GPU.
Each has a CPU twin asserting the same property of the reference against blutensor's generic CPU op, and
the pure-Python pieces (chunk table, kernel classes, sources, registration) are tested on CPU.
"""

from __future__ import annotations

import inspect
import math
import re
import subprocess
import sys
from pathlib import Path

import blutensor as bt
import numpy as np
import pytest
from blutensor.backends.cupy.multi_tensor import build_chunk_table

DEV = Path(__file__).resolve().parents[1] / "dev"
sys.path.insert(0, str(DEV))
import kernel_reference as ref  # noqa: E402

KDIR = Path(bt.__file__).resolve().parent / "backends" / "cupy" / "kernels"


def _cuda_ok() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


needs_gpu = pytest.mark.skipif(not _cuda_ok(), reason="needs CuPy and a CUDA GPU")


# ============================================================== pure Python (CPU)
@pytest.mark.parametrize(
    "numels,chunk",
    [
        ([3, 0, 10, 4], 4),
        ([1], 65536),
        ([65536, 65537, 1, 0], 65536),
        ([0, 0], 8),
        ([], 8),
        ([124_000_000 // 7] * 7, 65536),
    ],
)
def test_chunk_table_covers_every_element_once(numels, chunk):
    ct, cs = build_chunk_table(numels, chunk)
    assert ct.dtype == np.int32 and cs.dtype == np.int64 and len(ct) == len(cs)
    assert len(ct) == sum(math.ceil(n / chunk) for n in numels)
    for i, n in enumerate(numels):
        starts = cs[ct == i]
        assert list(starts) == list(range(0, n, chunk))  # contiguous, in order, no overlap, nothing missed
    assert (np.diff(ct) >= 0).all()  # grouped by tensor in list order


def test_chunk_table_rejects_bad_input():
    with pytest.raises(ValueError, match="chunk size"):
        build_chunk_table([4], 0)
    with pytest.raises(ValueError, match="negative"):
        build_chunk_table([4, -1], 8)


def test_gpt2_chunk_balance():
    """GPT-2 124M's parameters give enough equal chunks to fill 132 SMs several times over."""
    shapes = ref.gpt2_param_shapes()
    ct, _ = build_chunk_table([math.prod(s) for s in shapes])
    assert len(ct) > 8 * 132
    assert len(set(ct.tolist())) == len(shapes)


def _kernel_classes():
    from blutensor.backends.cupy import kernel_classes

    return kernel_classes()


def test_kernel_classes_follow_the_plugin_contract():
    from blutensor.ops.table import OPS, Kernel

    classes = _kernel_classes()
    assert {c.OP for c in classes} == {"layer_norm", "gelu", "cross_entropy", "embedding", "sdpa", "rms_norm", "rope",
                                       "swiglu"}
    for c in classes:
        assert issubclass(c, Kernel)
        assert c.PLUGIN_NAME == f"blutensor.cuda.{c.OP}"
        assert c.BACKEND == "cuda" and c.DTYPES == ("float32", "bfloat16") and c.PRIORITY == 10
        assert c.BF16_NATIVE is True
        generic = OPS[c.OP]
        assert c.DTYPE_ARG == generic.DTYPE_ARG
        gsig = inspect.signature(generic.forward)
        csig = inspect.signature(c.forward)
        for name, p in gsig.parameters.items():  # same positional inputs and attrs with the same defaults
            assert name in csig.parameters, (c.OP, name)
            assert csig.parameters[name].default == p.default, (c.OP, name)
        extra = set(csig.parameters) - set(gsig.parameters)
        assert extra <= {"inplace_grad", "float_loss"}, (c.OP, extra)


def test_kernel_classes_win_dispatch_on_cuda_only():
    from blutensor.ops.dispatch import resolve

    for op in ("layer_norm", "gelu", "cross_entropy", "embedding", "sdpa"):
        for dt in ("float32", "bfloat16"):
            assert resolve(op, "cuda", dt).PLUGIN_NAME == f"blutensor.cuda.{op}"
        assert resolve(op, "cpu", "float32").PLUGIN_NAME == f"blutensor.cpu.{op}"  # compiled CPU kernel (test_cpu_ops)
        assert resolve(op, "cuda", "float64").PLUGIN_NAME == f"blutensor.{op}"


def test_importing_kernel_classes_does_not_import_cupy():
    code = (
        "import sys, blutensor, blutensor.backends.cupy as c; c.kernel_classes(); "
        "import blutensor.backends.cupy.adamw, blutensor.backends.cupy.norm; print('cupy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_registration_hook_appends_cuda_kernels():
    """The CUDA classes are registered on every install (they import no CuPy), next to the generic ones."""
    import sys

    from blutensor import hooks

    names = {k.PLUGIN_NAME for k in hooks.blutrain_register_kernels()}
    assert {"blutensor.cuda.layer_norm", "blutensor.cuda.sdpa", "blutensor.layer_norm"} <= names
    if "cupy" not in sys.modules:
        from blutensor.backends.cupy import kernel_classes

        kernel_classes()
        assert "cupy" not in sys.modules


EXPECTED_ENTRIES = {
    "layer_norm.cu": [
        f"blu_layer_norm_{k}_{s}" for k in ("forward", "backward", "backward_reduce") for s in ("f32", "bf16")
    ],
    "gelu.cu": [f"blu_gelu_{k}_{s}" for k in ("forward", "backward") for s in ("f32", "bf16")],
    "cross_entropy.cu": ["blu_cross_entropy_count"]
    + [
        f"blu_cross_entropy_{k}_{s}" for k in ("forward", "forward_smem", "reduce", "backward") for s in ("f32", "bf16")
    ],
    "embedding.cu": [
        f"blu_embedding_{k}_{s}"
        for k in ("forward", "backward", "backward_pieces", "backward_runs")
        for s in ("f32", "bf16")
    ],
    "adamw.cu": ["blu_adamw_step", "blu_adamw_tensor"],
    "grad_norm.cu": ["blu_grad_norm_partial", "blu_grad_norm_finalize", "blu_grad_norm_scale"],
    "sdpa.cu": [f"blu_sdpa_{k}_simt_hd{d}" for k in ("forward", "backward_dkdv", "backward_dq") for d in (32, 64, 128)]
    + ["blu_sdpa_backward_preprocess_f32", "blu_sdpa_backward_preprocess_bf16"],
    "sdpa_mma.cu": [
        f"blu_sdpa_{k}{s}_{v}_hd{d}"
        for k in ("forward", "backward_dkdv", "backward_dq")
        for s in ("", "_strided")
        for v in ("tf32", "tf32x3", "bf16")
        for d in (64, 128)
    ],
    "sdpa_wgmma.cu": [f"blu_sdpa_wgmma_bf16_hd{d}_{k}" for k in ("fwd", "fwd_pp", "bwd_dkdv", "bwd_dq", "bwd_fused",
                                                                 "bwd_dq_convert", "preprocess")
                      for d in (64, 128)],
    "sdpa_wgmma_tf32.cu": [f"blu_sdpa_wgmma_tf32_hd{d}_{k}" for k in ("fwd", "transpose", "preprocess")
                           for d in (64, 128)]
    + ["blu_sdpa_wgmma_tf32_hd64_bwd_dkdv", "blu_sdpa_wgmma_tf32_hd64_bwd_dq"],
    "cast.cu": ["blu_cast_f32_to_bf16", "blu_cast_bf16_to_f32", "blu_add_bf16_forward", "blu_sum_slices_bf16_forward"],
    "rms_norm.cu": [f"blu_rms_norm_{k}_{s}" for k in ("forward", "backward", "backward_dw", "backward_reduce")
                    for s in ("f32", "bf16")] + ["blu_rms_norm_backward_reduce_acc"],
    # (its forward/backward entries come from nested macros, which _entries does not expand)
    "add_rms_norm.cu": [f"blu_add_rms_norm_backward_dw_{a}_{b}" for a in ("f32", "bf16") for b in ("f32", "bf16")]
    + [f"blu_add_rms_norm_backward_reduce_{s}" for s in ("f32", "bf16", "acc")],
    "rope.cu": [f"blu_rope_{k}_{s}" for k in ("forward", "backward") for s in ("f32", "bf16")],
    "swiglu.cu": [f"blu_swiglu_{k}_{s}" for k in ("forward", "backward") for s in ("f32", "bf16")],
}


def _entries(src: str) -> set[str]:
    """Names of the extern "C" entry points, with the ENTRIES-style macros expanded."""
    names = set(re.findall(r'extern "C" __global__ void\s+(?:__launch_bounds__\([\d, ]+\)\s+)?(blu_\w+)\(', src))
    for m in re.finditer(r"#define (\w+)\(([^)]*)\)((?:[^\n]*\\\n)*[^\n]*)", src):
        macro, params, body = m.group(1), [p.strip() for p in m.group(2).split(",")], m.group(3)
        templates = re.findall(r"(blu_[\w#]+)\(", body)
        for call in re.finditer(rf"^{macro}\(([^)]*)\)", src, re.M):
            args = [a.strip() for a in call.group(1).split(",")]
            for name in templates:
                for p, a in zip(params, args):
                    name = name.replace(f"##{p}##", a).replace(f"##{p}", a)
                names.add(name)
    return names


@pytest.mark.parametrize("file", sorted(EXPECTED_ENTRIES))
def test_kernel_sources_are_self_contained_with_blu_entries(file):
    from blutensor.backends.cupy._loader import source

    src = source(file)  # what NVRTC compiles: the loader inlines the package's own headers
    assert "#include" not in src  # no include paths needed: NVRTC compiles it anywhere
    assert set(EXPECTED_ENTRIES[file]) <= _entries(src), set(EXPECTED_ENTRIES[file]) - _entries(src)


def test_every_kernel_file_is_known():
    assert sorted(p.name for p in KDIR.glob("*.cu")) == sorted(EXPECTED_ENTRIES)


# ============================================================== CPU twins: the references vs the generic ops
RNG = np.random.default_rng(5)


def _run_cpu(fn, *arrays):
    ts = [bt.tensor(a, requires_grad=a.dtype.kind == "f") for a in arrays]
    out = fn(*ts)
    out.backward(bt.ones_like(out)) if out.ndim else out.backward()
    return out.numpy(), [t.grad.numpy() for t in ts if t.requires_grad]


@pytest.mark.parametrize("N,C", [(7, 771), (33, 768), (5, 37)])
def test_cpu_layer_norm_reference(N, C):
    x, w, b = RNG.standard_normal((N, C)) * 2 + 0.5, RNG.standard_normal(C), RNG.standard_normal(C)
    g = RNG.standard_normal((N, C))
    ts = [bt.tensor(a, dtype=bt.float64, requires_grad=True) for a in (x, w, b)]
    y = bt.nn.functional.layer_norm(ts[0], (C,), ts[1], ts[2])
    y.backward(bt.tensor(g, dtype=bt.float64))
    ey, _, _, _ = ref.layer_norm(x, w, b)
    edx, edw, edb = ref.layer_norm_backward(g, x, w)
    assert ref.rel_err(y.numpy(), ey) < 1e-12
    for t, e in zip(ts, (edx, edw, edb)):
        assert ref.rel_err(t.grad.numpy(), e) < 1e-12


@pytest.mark.parametrize("approx", ["tanh", "none"])
def test_cpu_gelu_reference(approx):
    x, g = RNG.standard_normal(1001) * 3, RNG.standard_normal(1001)
    t = bt.tensor(x, dtype=bt.float64, requires_grad=True)
    y = bt.nn.functional.gelu(t, approximate=approx)
    y.backward(bt.tensor(g, dtype=bt.float64))
    assert ref.rel_err(y.numpy(), ref.gelu(x, approx)) < 1e-7
    assert ref.rel_err(t.grad.numpy(), ref.gelu_backward(g, x, approx)) < 1e-7


@pytest.mark.parametrize("red,ls", [("mean", 0.0), ("sum", 0.1), ("none", 0.0)])
def test_cpu_cross_entropy_reference(red, ls):
    N, C = 23, 301
    z = RNG.standard_normal((N, C)) * 3
    t = RNG.integers(0, C, N)
    t[::5] = -100
    zt = bt.tensor(z, dtype=bt.float64, requires_grad=True)
    loss = bt.nn.functional.cross_entropy(zt, bt.tensor(t), reduction=red, label_smoothing=ls)
    loss.backward(bt.ones_like(loss))
    eloss, egrad, _ = ref.cross_entropy(z, t, -100, red, ls)
    assert ref.rel_err(loss.numpy(), np.asarray(eloss)) < 1e-12
    assert ref.rel_err(zt.grad.numpy(), egrad) < 1e-12


def test_cpu_embedding_reference():
    V, C, N = 17, 9, 300
    idx = RNG.integers(0, V, N)
    idx[:80] = idx[0]
    w, g = RNG.standard_normal((V, C)), RNG.standard_normal((N, C))
    wt = bt.tensor(w, dtype=bt.float64, requires_grad=True)
    out = bt.nn.functional.embedding(bt.tensor(idx), wt)
    out.backward(bt.tensor(g, dtype=bt.float64))
    assert ref.rel_err(out.numpy(), w[idx]) == 0.0
    assert ref.rel_err(wt.grad.numpy(), ref.embedding_backward(idx, g, V)) < 1e-12


def _pieces_emulation(sorted_idx, order, g, V, piece):
    """NumPy transliteration of embedding.cu's two 'pieces' kernels (fp32 sums in the kernels' order)."""
    N, C = g.shape
    part = np.zeros((N, C), np.float32)
    dw = np.zeros((V, C), np.float32)
    for j in range(N):  # pass 1: block j sums its piece when it starts one
        v = sorted_idx[j]
        first = int(np.searchsorted(sorted_idx, v, side="left"))
        if (j - first) % piece:
            continue
        acc = np.zeros(C, np.float32)
        k = j
        while k < min(N, j + piece) and sorted_idx[k] == v:
            acc = acc + g[order[k]].astype(np.float32)
            k += 1
        part[j] = acc
    for j in range(N):  # pass 2: the run's first block adds the pieces in order
        v = sorted_idx[j]
        if j > 0 and sorted_idx[j - 1] == v:
            continue
        acc = np.zeros(C, np.float32)
        for k in range(j, N, piece):
            if sorted_idx[k] != v:
                break
            acc = acc + part[k]
        dw[v] = acc
    return dw


def test_cpu_embedding_backward_pieces_emulation():
    """CPU twin of the balanced embedding backward (BLUTRAIN_EMBEDDING_BWD=pieces): a run of 700 rows of one index
    (22 pieces of 32, the last partial), runs shorter than a piece and unused rows, against float64."""
    from blutensor.backends.cupy import embedding

    V, C, N = 50, 24, 1500
    idx = RNG.integers(0, V - 5, N)
    idx[RNG.permutation(N)[:700]] = 7  # one very frequent token
    g = RNG.standard_normal((N, C)).astype(np.float32)
    order = np.argsort(idx, kind="stable")
    got = _pieces_emulation(idx[order], order, g, V, embedding.PIECE)
    want = ref.embedding_backward(idx, g.astype(np.float64), V)
    assert ref.rel_err(got, want) < 1e-6
    assert not got[V - 5 :].any()  # rows never indexed stay zero
    assert embedding.PIECE == 32 and embedding.backward_mode() in embedding.EMBEDDING_BWD


def segments_emulation(sorted_idx, order, g, dw, piece):
    """NumPy transliteration of embedding.cu's 'segments' kernels: the same fp32 adds in the same order, added into
    ``dw`` (float32, modified and returned)."""
    N, C = g.shape
    V = dw.shape[0]
    pieces = -(-N // piece)
    part = np.zeros((pieces, 2, C), np.float32)
    for p in range(pieces):  # pass 1
        s, n = p * piece, min(piece, N - p * piece)
        prev_key = sorted_idx[s - 1] if s > 0 else -1
        next_key = sorted_idx[s + n] if s + n < N else -1
        acc, k0 = np.zeros(C, np.float32), 0
        for k in range(n):
            acc = acc + g[order[s + k]].astype(np.float32)
            v = sorted_idx[s + k]
            if k + 1 < n and sorted_idx[s + k + 1] == v:
                continue
            if k0 == 0 and prev_key == v:
                part[p, 0] = acc
            elif k + 1 == n and next_key == v:
                part[p, 1] = acc
            elif 0 <= v < V:
                dw[v] = dw[v] + acc
            acc, k0 = np.zeros(C, np.float32), k + 1
    for p in range(pieces):  # pass 2: the owner of each run that crosses pieces
        s, e = p * piece, min(p * piece + piece, N)
        if e >= N or sorted_idx[e] != sorted_idx[e - 1]:
            continue
        v = sorted_idx[e - 1]
        k0 = e - 1
        while k0 > s and sorted_idx[k0 - 1] == v:
            k0 -= 1
        if k0 == s and s > 0 and sorted_idx[s - 1] == v:
            continue
        acc = part[p, 1].copy()
        q = p + 1
        while q < pieces and sorted_idx[q * piece] == v:
            acc = acc + part[q, 0]
            q += 1
        dw[v] = dw[v] + acc
    return dw


def test_cpu_embedding_backward_segments_emulation():
    """CPU twin of the default embedding backward (BLUTRAIN_EMBEDDING_BWD=segments): runs of every length (one
    token 700 times: 44 pieces, runs shorter than, equal to and across piece boundaries), added into a buffer that
    already holds a gradient, against float64."""
    from blutensor.backends.cupy import embedding

    V, C, N = 50, 24, 1500
    idx = RNG.integers(0, V - 5, N)
    idx[RNG.permutation(N)[:700]] = 7
    idx[RNG.permutation(N)[:33]] = 40  # a run just over two pieces
    g = RNG.standard_normal((N, C)).astype(np.float32)
    order = np.argsort(idx, kind="stable")
    base = RNG.standard_normal((V, C)).astype(np.float32)
    got = segments_emulation(idx[order], order, g, base.copy(), embedding.SEG_PIECE)
    want = base.astype(np.float64) + ref.embedding_backward(idx, g.astype(np.float64), V)
    assert ref.rel_err(got, want) < 1e-6
    np.testing.assert_array_equal(got[V - 5 :], base[V - 5 :])  # rows never indexed keep their gradient
    for n in (1, 15, 16, 17, 32):  # piece-sized edge cases: one piece, exactly full, one over
        i = np.zeros(n, np.int64)
        gg = RNG.standard_normal((n, 3)).astype(np.float32)
        o = np.argsort(i, kind="stable")
        out = segments_emulation(i[o], o, gg, np.zeros((2, 3), np.float32), embedding.SEG_PIECE)
        np.testing.assert_allclose(out[0], gg.astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)
        assert not out[1].any()


def test_embedding_backward_mode_setting(monkeypatch):
    from blutensor.backends.cupy import embedding

    monkeypatch.delenv("BLUTRAIN_EMBEDDING_BWD", raising=False)
    bt.policy.reset_defaults()
    assert embedding.backward_mode() == "segments"
    with bt.policy.scope(embedding_backward="runs"):
        assert embedding.backward_mode() == "runs"
    assert bt.ExecutionPolicy.from_env({"BLUTRAIN_EMBEDDING_BWD": "Pieces"}).embedding_backward == "pieces"
    monkeypatch.setenv("BLUTRAIN_EMBEDDING_BWD", "runs")
    bt.policy.reset_defaults()
    assert embedding.backward_mode() == "runs"
    with pytest.raises(ValueError, match="BLUTRAIN_EMBEDDING_BWD"):
        bt.ExecutionPolicy.from_env({"BLUTRAIN_EMBEDDING_BWD": "atomics"})


def test_cpu_adamw_reference():
    p0 = RNG.standard_normal(1001)
    p = bt.nn.Parameter(bt.tensor(p0, dtype=bt.float64))
    opt = bt.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    e, m, v = p0, np.zeros_like(p0), np.zeros_like(p0)
    for step in (1, 2, 3):
        g = RNG.standard_normal(1001) * 0.1
        p.grad = bt.tensor(g, dtype=bt.float64)
        opt.step()
        e, m, v = ref.adamw(e, g, m, v, step, 1e-2, 0.9, 0.95, 1e-8, 0.1)
    assert ref.rel_err(p.numpy() - p0, e - p0) < 1e-12


def test_cpu_grad_norm_reference():
    gs = [RNG.standard_normal(n) for n in (768, 1, 3001)]
    ps = []
    for g in gs:
        p = bt.nn.Parameter(bt.zeros(len(g), dtype=bt.float64))
        p.grad = bt.tensor(g, dtype=bt.float64)
        ps.append(p)
    n = bt.nn.utils.clip_grad_norm_(ps, 1e9) if hasattr(bt.nn, "utils") else bt.optim.clip_grad_norm_(ps, 1e9)
    assert abs(float(n) - ref.grad_norm(gs)) / ref.grad_norm(gs) < 1e-12


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L,S", [(33, 33), (20, 27)])
def test_cpu_sdpa_reference(causal, L, S):
    q, k, v = (RNG.standard_normal((2, 3, n, 16)) for n in (L, S, S))
    do = RNG.standard_normal((2, 3, L, 16))
    ts = [bt.tensor(a, dtype=bt.float64, requires_grad=True) for a in (q, k, v)]
    o = bt.nn.functional.scaled_dot_product_attention(*ts, is_causal=causal)
    o.backward(bt.tensor(do, dtype=bt.float64))
    eo, lse = ref.sdpa(q, k, v, causal)
    assert ref.rel_err(o.numpy(), eo) < 1e-12
    for t, e in zip(ts, ref.sdpa_backward(q, k, v, do, causal)):
        assert ref.rel_err(t.grad.numpy(), e) < 1e-12
    s = q @ np.swapaxes(k, -1, -2) / 4.0
    if causal:
        s = np.where(np.tril(np.ones((L, S), bool)), s, -np.inf)
    assert np.allclose(lse, np.log(np.exp(s).sum(-1)))


def test_cpu_bf16_rounding_matches_ml_dtypes():
    import ml_dtypes

    x = np.concatenate(
        [
            RNG.standard_normal(10000).astype(np.float32),
            np.array([0.0, -0.0, np.inf, -np.inf, 1e38, 1.00390625, 1.01171875], np.float32),
        ]
    )
    assert (ref.bf16_round(x) == x.astype(ml_dtypes.bfloat16).astype(np.float64)).all()
    assert np.isnan(ref.bf16_round(np.array([np.nan], np.float32))).all()


def test_reference_tolerances_are_documented():
    for kernel in (
        "layer_norm.fwd",
        "gelu.fwd",
        "cross_entropy.grad",
        "embedding.bwd",
        "adamw",
        "grad_norm",
        "sdpa.fwd",
        "sdpa.bwd",
    ):
        assert kernel in ref.TOL
    assert set(ref.TOL["sdpa.fwd"]) == {"f32", "tf32", "bf16"}


def test_bad_index_clear_error_cpu_twin(monkeypatch):
    """CPU twin of check_plugins' bad-index part: the op named in a ShapeError (raised at the call on CPU; on
    CUDA lazily by index_check.raise_pending, or at the call with BLUTRAIN_VALIDATE_INDICES=sync)."""
    from blutensor.backends.cupy import index_check
    from blutensor.errors import ShapeError

    F = bt.nn.functional
    w = bt.tensor(np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32))
    with pytest.raises(ShapeError, match="embedding: index"):
        F.embedding(bt.tensor(np.array([3, 50])), w)
    with pytest.raises(ShapeError, match="cross_entropy: target index 8"):
        F.cross_entropy(w[:2], bt.tensor(np.array([1, 8])))
    for v, m in (("sync", "sync"), ("eager", "sync"), ("0", "off"), ("lazy", "lazy"), ("1", "lazy")):
        assert bt.ExecutionPolicy.from_env({"BLUTRAIN_VALIDATE_INDICES": v}).validate_indices == m
        with bt.policy.scope(validate_indices=m):
            assert index_check.mode() == m
    with pytest.raises(ValueError, match="BLUTRAIN_VALIDATE_INDICES must be one of"):
        bt.ExecutionPolicy.from_env({"BLUTRAIN_VALIDATE_INDICES": "sometimes"})
    monkeypatch.delenv("BLUTRAIN_VALIDATE_INDICES", raising=False)
    bt.policy.reset_defaults()
    assert index_check.mode() == "lazy"


# ============================================================== GPU (cuda-marked): the same properties on device
def _run_gpu_check(name: str):
    import kernel_checks as gc

    gc.RESULTS["checks"].clear()
    gc.RESULTS["errors"].clear()
    getattr(gc, name)()
    from blutensor.backends.cupy import index_check

    left = index_check.pending()  # a check must not leave a recorded bad index for later code to trip on
    if left is not None:
        index_check.flag_array().fill(0)
    assert left is None, f"{name} left a bad index recorded on the device: {left}"
    assert not gc.RESULTS["errors"], gc.RESULTS["errors"][0]["tb"]
    failed = [c for c in gc.RESULTS["checks"] if not c["passed"]]
    assert gc.RESULTS["checks"] and not failed, failed[:5]


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize(
    "name",
    [
        "check_layer_norm",
        "check_gelu",
        "check_cross_entropy",
        "check_embedding",
        "check_adamw",
        "check_grad_norm",
        "check_sdpa_f32",
        "check_sdpa_bf16",
        "check_sdpa_tf32",
        "check_plugins",
        "check_layer_norm_paths",
        "check_gelu_paths",
        "check_cross_entropy_paths_f32",
        "check_cross_entropy_paths_bf16",
        "check_grad_norm_paths",
    ],
)
def test_cuda_kernel_matches_reference(name):
    _run_gpu_check(name)


@pytest.mark.cuda
@needs_gpu
def test_cuda_cross_entropy_inplace_grad_through_autograd():
    import cupy

    N, C = 17, 1003
    z = RNG.standard_normal((N, C)).astype(np.float32)
    t = RNG.integers(0, C, N)
    zt = bt.tensor(z, device="cuda", requires_grad=True)
    from blutensor.ops.dispatch import apply

    loss = apply("cross_entropy", zt, bt.tensor(t, device="cuda"), inplace_grad=True)
    loss.backward()
    _, egrad, _ = ref.cross_entropy(z.astype(np.float64), t)
    assert ref.rel_err(cupy.asnumpy(zt.grad._data), egrad) < ref.TOL["cross_entropy.grad"]["f32"]


@pytest.mark.parametrize("variant", ["tf32", "bf16"])
@pytest.mark.parametrize("L,S,causal", [(77, 77, True), (100, 130, False)])
def test_cpu_emulated_mma_flash_attention(variant, L, S, causal):
    """CPU twin of the tf32/bf16 GPU checks: a lane-level NumPy transliteration of sdpa_mma.cu
    (dev/emulate_sdpa_mma.py) meets the same tolerances against the float64 reference."""
    import emulate_sdpa_mma as em

    X = em.Tf32 if variant == "tf32" else em.Bf16
    hd = 64
    q, k, v, do = (X.cast(RNG.standard_normal((n, hd))) for n in (L, S, S, L))
    o, lse = em.forward(X, q, k, v, L, S, hd, 1 / 8, causal)
    eo, else_ = ref.sdpa(*(a.astype(np.float64) for a in (q, k, v)), causal)
    assert ref.rel_err(o, eo) <= ref.TOL["sdpa.fwd"][variant]
    assert ref.rel_err(lse, else_) <= ref.TOL["sdpa.fwd"][variant]
    D = (o.astype(np.float32) * do).sum(-1).astype(np.float32)
    grads = em.backward(X, q, k, v, do, lse, D, L, S, hd, 1 / 8, causal)
    for a, e in zip(grads, ref.sdpa_backward(*(a.astype(np.float64) for a in (q, k, v, do)), causal)):
        assert ref.rel_err(a, e) <= ref.TOL["sdpa.bwd"][variant]


@pytest.mark.parametrize("hd", [32, 64, 128])
@pytest.mark.parametrize("L,S,causal", [(77, 77, True), (100, 130, False)])
def test_cpu_emulated_simt_flash_attention(hd, L, S, causal):
    """CPU twin of the fp32 SIMT GPU checks: dev/emulate_sdpa_simt.py (same dim ownership, tiles, group
    sums and online softmax as sdpa.cu) meets the f32 tolerances against the float64 reference."""
    import emulate_sdpa_simt as em

    q, k, v, do = (RNG.standard_normal((n, hd)).astype(np.float32) for n in (L, S, S, L))
    sc = 1 / math.sqrt(hd)
    o, lse = em.forward(q, k, v, L, S, hd, sc, causal)
    eo, else_ = ref.sdpa(*(a.astype(np.float64) for a in (q, k, v)), causal)
    assert ref.rel_err(o, eo) <= ref.TOL["sdpa.fwd"]["f32"]
    assert ref.rel_err(lse, else_) <= ref.TOL["sdpa.fwd"]["f32"]
    D = (do * o).sum(-1, dtype=np.float32)
    grads = em.backward(q, k, v, do, lse, D, L, S, hd, sc, causal)
    for a, e in zip(grads, ref.sdpa_backward(*(a.astype(np.float64) for a in (q, k, v, do)), causal)):
        assert ref.rel_err(a, e) <= ref.TOL["sdpa.bwd"]["f32"]


def test_loader_inlines_the_shared_header_once():
    """CuPy compiles the loader's text: local headers inlined (its cache key then covers them), each once."""
    from blutensor.backends.cupy._loader import KERNEL_DIR, source

    for path in sorted(KERNEL_DIR.glob("*.cu")):
        text = source(path.name)
        assert '#include "' not in text, path.name
        if '#include "bf16_vec.cuh"' in path.read_text():
            assert text.count("typedef unsigned short bf16_t;") == 1
            assert "store_vec" in text and "load_vec" in text
