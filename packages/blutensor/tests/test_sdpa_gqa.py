"""Grouped-query flash attention (backends/cupy/sdpa_gqa.py): K/V heads read in place, never repeated.

CPU: the launches of gqa_forward / gqa_backward run on a NumPy emulation of the strided flash kernels that follows
their address math (struct Lay: base(bh) = (bh / H) * sb + (bh % H) * sh; lse and D rows at bh * L), so the
layouts, group offsets and the gathered log-sum-exp rows are checked against a float64 reference of grouped
attention (forward and backward, causal or not). GPU (cuda-marked): F.scaled_dot_product_attention(enable_gqa=True)
records the one op 'sdpa_gqa' (no expand/reshape/repeat_interleave of k or v) and equals the float64 reference.
"""

from __future__ import annotations

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
import pytest

rng = np.random.default_rng(5)


def _cuda_ok() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _reference(q, k, v, do, causal, scale):
    """float64 grouped attention: o, dq, dk, dv (k/v head j serves query heads j*G .. j*G + G - 1)."""
    G = q.shape[1] // k.shape[1]
    kr, vr = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    L, S = q.shape[2], k.shape[2]
    s = q @ kr.swapaxes(-1, -2) * scale
    if causal:
        s = s + np.triu(np.full((L, S), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = p @ vr
    dp = do @ vr.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = ds @ kr * scale
    B, Hk = k.shape[:2]
    dk = (ds.swapaxes(-1, -2) @ q * scale).reshape(B, Hk, G, S, -1).sum(2)
    dv = (p.swapaxes(-1, -2) @ do).reshape(B, Hk, G, S, -1).sum(2)
    return o, dq, dk, dv


def _rows(flat, lay, H, bh, n, E):
    sb, sh, st = lay
    base = (bh // H) * sb + (bh % H) * sh
    return np.stack([flat[base + r * st: base + r * st + E] for r in range(n)]).astype(np.float64)


def _put(flat, lay, H, bh, val):
    sb, sh, st = lay
    base = (bh // H) * sb + (bh % H) * sh
    for r in range(val.shape[0]):
        flat[base + r * st: base + r * st + val.shape[1]] = val[r]


def _emulate(name, grid, args):
    """The strided kernels' results, block by block (one head bh per blockIdx.y) through their address math."""
    if name.startswith("blu_sdpa_backward_preprocess_"):
        do, o, D, rows, E = args
        D.reshape(-1)[:] = (do.reshape(-1, int(E)) * o.reshape(-1, int(E))).sum(-1)
        return
    heads = grid[1]
    if name.startswith("blu_sdpa_forward_strided_"):
        q, k, v, o, lse, L, S, sc, causal = args[:9]
    else:
        q, k, v, do, lse, D = args[:6]
        outs = args[6:7] if "_dq_" in name else args[6:8]
        L, S, sc, causal = args[len(outs) + 6: len(outs) + 10]
    H = int(args[-10])
    lq, lk, lo = (tuple(int(a) for a in args[-9 + 3 * i: -6 + 3 * i or None]) for i in range(3))
    L, S, E = int(L), int(S), lq[2]
    qf, kf, vf = (a.reshape(-1) for a in (q, k, v))
    for bh in range(heads):
        Q, K, V = _rows(qf, lq, H, bh, L, E), _rows(kf, lk, H, bh, S, E), _rows(vf, lk, H, bh, S, E)
        s = Q @ K.T * float(sc)
        if causal:
            s = s + np.triu(np.full((L, S), -np.inf), 1)
        if name.startswith("blu_sdpa_forward_strided_"):
            m = s.max(-1, keepdims=True)
            ls = m[:, 0] + np.log(np.exp(s - m).sum(-1))
            _put(o.reshape(-1), lo, H, bh, np.exp(s - ls[:, None]) @ V)
            lse.reshape(-1)[bh * L:(bh + 1) * L] = ls
            continue
        P = np.exp(s - lse.reshape(-1)[bh * L:(bh + 1) * L, None])
        dO = _rows(do.reshape(-1), lo, H, bh, L, E)
        dS = P * (dO @ V.T - D.reshape(-1)[bh * L:(bh + 1) * L, None])
        if "_dq_" in name:
            _put(outs[0].reshape(-1), lq, H, bh, dS @ K * float(sc))
        else:
            _put(outs[0].reshape(-1), lk, H, bh, dS.T @ Q * float(sc))
            _put(outs[1].reshape(-1), lk, H, bh, P.T @ dO)


@pytest.mark.parametrize("B, Hq, Hk, L, E, causal", [(2, 4, 2, 5, 64, True), (1, 6, 2, 7, 64, False),
                                                     (1, 8, 1, 4, 64, True)])
def test_gqa_launches_address_the_groups(monkeypatch, B, Hq, Hk, L, E, causal):
    from blutensor.backends.cupy import sdpa_gqa

    launched = []

    def launch(file, name, grid, block, args, shared_mem=0):
        launched.append((name, grid))
        _emulate(name, grid, args)

    monkeypatch.setattr(sdpa_gqa, "cupy", lambda: np)
    monkeypatch.setattr(sdpa_gqa, "launch", launch)
    q = rng.standard_normal((B, Hq, L, E)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hk, L, E)).astype(np.float32) for _ in range(2))
    do = rng.standard_normal((B, Hq, L, E)).astype(np.float32)
    sc = 1 / np.sqrt(E)
    o, lse = sdpa_gqa.gqa_forward(q, k, v, causal, sc, "tf32")
    dq, dk, dv = sdpa_gqa.gqa_backward(q, k, v, o, lse, do, causal, sc, "tf32")
    want = _reference(*(a.astype(np.float64) for a in (q, k, v, do)), causal, sc)
    for got, ref in zip((o, dq, dk, dv), want):
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    G = Hq // Hk
    names = [n for n, _ in launched]
    assert names == (["blu_sdpa_forward_strided_tf32_hd64", "blu_sdpa_backward_preprocess_f32",
                      "blu_sdpa_backward_dq_strided_tf32_hd64"] + ["blu_sdpa_backward_dkdv_strided_tf32_hd64"] * G)
    assert launched[0][1][1] == B * Hq and launched[-1][1][1] == B * Hk  # K/V blocks over the kv heads only


def _hopper_views(log):
    """NumPy stand-ins for sdpa_wgmma.forward / backward: dense attention over (B, n, H, E) views (any strides),
    writing o / lse / dq / dk / dv through the views they are given, as the TMA kernels do."""

    def heads(a):
        return a.transpose(0, 2, 1, 3).astype(np.float64)  # (B, H, n, E)

    def scores(q, k, causal, scale):
        s = heads(q) @ heads(k).swapaxes(-1, -2) * scale
        if causal:
            s = s + np.triu(np.full(s.shape[-2:], -np.inf), 1)
        return s

    def forward(q, k, v, o, lse, causal, scale):
        log.append(("forward", q, k, v))
        s = scores(q, k, causal, scale)
        m = s.max(-1, keepdims=True)
        ls = m[..., 0] + np.log(np.exp(s - m).sum(-1))
        o[...] = (np.exp(s - ls[..., None]) @ heads(v)).transpose(0, 2, 1, 3)
        lse[...] = ls.reshape(lse.shape)

    def backward(q, k, v, o, lse, do, dq, dk, dv, causal, scale):
        log.append(("backward", q, k, v))
        s = scores(q, k, causal, scale)
        P = np.exp(s - lse.reshape(s.shape[:-1])[..., None])
        dO = heads(do)
        dS = P * (dO @ heads(v).swapaxes(-1, -2) - (dO * heads(o)).sum(-1, keepdims=True))
        dq[...] = (dS @ heads(k) * scale).transpose(0, 2, 1, 3)
        dk[...] = (dS.swapaxes(-1, -2) @ heads(q) * scale).transpose(0, 2, 1, 3)
        dv[...] = (P.swapaxes(-1, -2) @ dO).transpose(0, 2, 1, 3)

    return forward, backward


@pytest.mark.parametrize("B, Hq, Hk, L, S, causal", [(2, 4, 2, 5, 5, True), (1, 6, 2, 7, 9, False),
                                                     (1, 8, 1, 4, 4, True)])
def test_hopper_gqa_runs_each_group_member_on_kv_in_place(monkeypatch, B, Hq, Hk, L, S, causal):
    """Variant 'bf16_wgmma': one dense Hopper launch per group member over the B*Hkv heads, its queries the
    strided view q[:, g::G], k and v the caller's arrays (views, never copies); dK/dV summed over the members."""
    from blutensor.backends.cupy import sdpa_gqa

    log = []
    fwd, bwd = _hopper_views(log)
    monkeypatch.setattr(sdpa_gqa, "cupy", lambda: np)
    monkeypatch.setattr(sdpa_gqa._wgmma, "forward", fwd)
    monkeypatch.setattr(sdpa_gqa._wgmma, "backward", bwd)
    E = 64
    q = rng.standard_normal((B, Hq, L, E)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hk, S, E)).astype(np.float32) for _ in range(2))
    do = rng.standard_normal((B, Hq, L, E)).astype(np.float32)
    sc = 1 / np.sqrt(E)
    o, lse = sdpa_gqa.gqa_forward(q, k, v, causal, sc, "bf16_wgmma")
    dq, dk, dv = sdpa_gqa.gqa_backward(q, k, v, o, lse, do, causal, sc, "bf16_wgmma")
    want = _reference(*(a.astype(np.float64) for a in (q, k, v, do)), causal, sc)
    for got, ref in zip((o, dq, dk, dv), want):
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    G = Hq // Hk
    assert [c[0] for c in log] == ["forward"] * G + ["backward"] * G
    for _, qg, kg, vg in log:
        assert qg.shape == (B, L, Hk, E) and np.shares_memory(qg, q)
        assert np.shares_memory(kg, k) and np.shares_memory(vg, v)  # K/V read in place


@pytest.mark.parametrize("causal", [True, False])
def test_hopper_gqa_keeps_the_model_layouts_without_copies(monkeypatch, causal):
    """A llama block's layouts: v the transposed view of its projection (B, S, Hkv, E), q and k dense (B, H, n, E)
    from the rotary kernel. The Hopper path reads v in place, stores o heads-last (so o.transpose(1, 2) is the
    dense (B, L, Hq, E) the output projection takes), lays dk out as k and dv as v, and reads a dO in o's layout
    in place; a dO in another layout gives the same gradients."""
    from blutensor.backends.cupy import sdpa_gqa

    log = []
    fwd, bwd = _hopper_views(log)
    monkeypatch.setattr(sdpa_gqa, "cupy", lambda: np)
    monkeypatch.setattr(sdpa_gqa._wgmma, "forward", fwd)
    monkeypatch.setattr(sdpa_gqa._wgmma, "backward", bwd)
    B, Hq, Hk, L, E = 2, 8, 2, 9, 64
    q = rng.standard_normal((B, Hq, L, E)).astype(np.float32)
    k = rng.standard_normal((B, Hk, L, E)).astype(np.float32)
    v_proj = rng.standard_normal((B, L, Hk * E)).astype(np.float32)
    v = v_proj.reshape(B, L, Hk, E).transpose(0, 2, 1, 3)
    assert sdpa_gqa._tma_ready(v, np) is v  # strided, 16-byte strides: no copy
    sc = 1 / np.sqrt(E)
    o, lse = sdpa_gqa.gqa_forward(q, k, v, causal, sc, "bf16_wgmma")
    assert o.transpose(0, 2, 1, 3).flags.c_contiguous
    do_proj = rng.standard_normal((B, L, Hq * E)).astype(np.float32)
    do = do_proj.reshape(B, L, Hq, E).transpose(0, 2, 1, 3)  # the gradient through the same transpose: o's layout
    assert do.strides == o.strides
    dq, dk, dv = sdpa_gqa.gqa_backward(q, k, v, o, lse, do, causal, sc, "bf16_wgmma")
    assert dq.flags.c_contiguous and dk.flags.c_contiguous and dv.transpose(0, 2, 1, 3).flags.c_contiguous
    assert np.shares_memory(log[-1][3], v_proj) and any(np.shares_memory(c[1], q) for c in log)
    want = _reference(*(a.astype(np.float64) for a in (q, k, v, do)), causal, sc)
    for got, ref in zip((o, dq, dk, dv), want):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    again = sdpa_gqa.gqa_backward(q, k, v, o, lse, np.ascontiguousarray(do), causal, sc, "bf16_wgmma")
    for got, ref in zip(again, want[1:]):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_tma_ready_copies_what_the_tensor_maps_cannot_read():
    from blutensor.backends.cupy import sdpa_gqa

    a = np.zeros((2, 3, 5, 64), np.uint16)
    assert sdpa_gqa._tma_ready(a, np) is a
    odd = np.zeros((2, 3, 5, 66), np.uint16)[..., :64]  # rows of 132 bytes: not a multiple of 16
    got = sdpa_gqa._tma_ready(odd, np)
    assert got is not odd and got.flags.c_contiguous and np.array_equal(got, odd)
    head_strided = np.zeros((2, 3, 5, 128), np.uint16)[..., ::2]  # head dim not contiguous
    assert sdpa_gqa._tma_ready(head_strided, np).strides[-1] == 2


def test_variants_without_strided_entries_run_mma():
    from blutensor.backends.cupy.sdpa_gqa import strided_variant

    assert strided_variant("bf16_wgmma", np.uint16, 64) == "bf16_wgmma"  # the Hopper kernel, member by member
    assert strided_variant("tf32x3", np.float32, 64) == "tf32x3" and strided_variant(None, np.float32, 64) is None
    assert strided_variant("bf16_fancy", np.uint16, 64) == "bf16"
    assert strided_variant("bf16_fancy", np.uint16, 96) is None


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_ok(), reason="needs CuPy and a GPU")
@pytest.mark.parametrize("dtype, attention", [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "wgmma")])
def test_cuda_gqa_reads_kv_in_place(dtype, attention):
    from blutensor.backends.cupy import sdpa_gqa
    from blutensor.backends.cupy.sdpa import _compute_capability
    from blutensor.ops import dispatch

    if attention == "wgmma" and _compute_capability() != 90:
        pytest.skip("the Hopper kernels need sm_90")
    B, Hq, Hk, T, E = 2, 8, 2, 70, 64
    q, k, v, do = (rng.standard_normal((B, h, T, E)) for h in (Hq, Hk, Hk, Hq))

    def dev(a):
        t = bt.tensor(a.astype(np.float32), device="cuda").to(getattr(bt, dtype)).detach()
        t.requires_grad = True
        return t

    qt, kt, vt = dev(q), dev(k), dev(v)
    ops = []

    def record(op, inputs, attrs, run):
        ops.append(op)
        return run()

    gt = bt.tensor(do.astype(np.float32), device="cuda").to(getattr(bt, dtype))
    with bt.policy.scope(attention=attention):
        if attention == "wgmma":
            assert sdpa_gqa.applies(qt, kt, vt, None, 0.0) == "bf16_wgmma"
        dispatch.add_observer(record)
        try:
            y = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
        finally:
            dispatch.remove_observer(record)
        (y * gt).sum().to(bt.float32).backward()
    assert ops == ["sdpa_gqa"], ops  # no expand / reshape / repeat_interleave of k or v
    r = lambda t: t.detach().to(bt.float32).to("cpu").numpy().astype(np.float64)  # noqa: E731
    o, dq, dk, dv = _reference(r(qt), r(kt), r(vt), r(gt), True, 1 / np.sqrt(E))
    tol = 2e-3 if dtype == "float32" else 3e-2
    for got, want in ((y, o), (qt.grad, dq), (kt.grad, dk), (vt.grad, dv)):
        np.testing.assert_allclose(r(got), want, rtol=tol, atol=tol * max(1.0, float(np.abs(want).max())))
