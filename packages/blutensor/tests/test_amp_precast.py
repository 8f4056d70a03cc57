"""bt.amp.precast: every weight cast of a step made at once (one multi-tensor launch on CUDA) must give the
same forward and the same float32 master gradients, bit for bit, as casts made on first use."""

from __future__ import annotations

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
import pytest
from conftest import HAS_CUDA, host, rng

needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CuPy and a CUDA GPU")


def _params(dev):
    r = rng(0)
    shapes = [(16, 8), (16,), (8, 16), (8,), (8,), (5, 3)]  # last: a parameter no op lowers
    return [bt.nn.Parameter(bt.tensor(r.standard_normal(s).astype(np.float32) * 0.5, device=dev)) for s in shapes]


def _step(ps, x, pre: bool):
    w1, b1, w2, b2, ln, _ = ps
    for p in ps:
        p.grad = None
    with bt.autocast(x.device.type):
        n = bt.amp.precast(ps + [w1]) if pre else 0  # w1 twice: tied parameters are cast once
        h = F.gelu(F.linear(x, w1, b1), approximate="tanh")
        y = F.linear(h, w2, b2)
        y2 = F.linear(F.linear(x, w1), w2)  # w1, w2 used twice: the cached cast is reused
        loss = ((y.float() + y2.float()) * ln).sum()
        info = bt.amp.cache_info()
    loss.backward()
    return n, info, host(loss), [None if p.grad is None else host(p.grad) for p in ps]


def test_precast_equals_casts_on_first_use(device):
    ps = _params(device)
    x = bt.tensor(rng(1).standard_normal((4, 8)).astype(np.float32), device=device)
    n0, info0, l0, g0 = _step(ps, x, pre=False)
    n1, info1, l1, g1 = _step(ps, x, pre=True)
    assert n0 == 0 and n1 == 6  # every float32 parameter, w1 once
    assert info0["misses"] == 4 and info1["misses"] == 6 and info1["hits"] >= 6  # all lowered casts hit the cache
    assert l0 == l1
    for a, b in zip(g0, g1):
        if a is None:
            assert b is None
        else:
            np.testing.assert_array_equal(a, b)
    assert g1[5] is None  # the unused cast never reaches its master
    assert bt.amp.cache_info()["entries"] == 0  # the region's casts were dropped on exit


def test_precast_outside_a_region_or_without_cache_does_nothing():
    ps = _params("cpu")
    assert bt.amp.precast(ps) == 0
    with bt.autocast("cpu", cache_enabled=False):
        assert bt.amp.precast(ps) == 0
    with bt.autocast("cpu"), bt.no_grad():
        assert bt.amp.precast(ps) == 6
        assert bt.amp.precast(ps) == 0  # already cached


def test_pack_layout_aligned_and_disjoint():
    from blutensor.backends.cupy.cast import PACK_ALIGN, pack_layout

    sizes = [1, 64, 65, 0, 1000, 7]
    offs, total = pack_layout(sizes)
    assert (offs % PACK_ALIGN == 0).all()
    ends = offs + np.asarray(sizes)
    assert (ends[:-1] <= offs[1:]).all() and total >= ends.max() and total % PACK_ALIGN == 0
    assert pack_layout([])[1] == 0


@pytest.mark.cuda
@needs_gpu
def test_cuda_multi_cast_matches_single_casts():
    import cupy
    from blutensor.backends.cupy.cast import multi_to_bf16, to_bf16

    r = rng(2)
    big = cupy.asarray(r.standard_normal(40000).astype(np.float32) * 100)
    arrays = [cupy.asarray(r.standard_normal(s).astype(np.float32)) for s in [(3,), (64, 33), (20000,), (7, 5)]]
    arrays += [big[1:30001], cupy.asarray(np.array([np.inf, -np.inf, 0.0, -0.0, 1e-40], np.float32))]
    outs = multi_to_bf16(arrays)  # big[1:] starts unaligned: the scalar path
    for a, o in zip(arrays, outs):
        assert o.shape == a.shape and o.dtype == cupy.uint16 and o.data.ptr % 128 == 0
        assert bool((o == to_bf16(a)).all())


@pytest.mark.parametrize("accumulate", [False, True])
def test_precast_cuda_nodes_on_numpy(monkeypatch, accumulate):
    """CPU twin of the CUDA precast: the one-launch cast replaced by NumPy rounding, the cached copies' cast
    nodes (CastCuda's backward) must deliver the same float32 master gradients as per-weight casts."""
    import ml_dtypes
    from blutensor import amp
    from blutensor.backends.cupy import cast as cast_mod
    from blutensor.ops import dispatch

    ps = _params("cpu")
    x = bt.tensor(rng(1).standard_normal((4, 8)).astype(np.float32))
    _, _, l0, g0 = _step(ps, x, pre=False)
    calls = []

    def fake_multi(arrays):
        calls.append(len(arrays))
        return [a.astype(ml_dtypes.bfloat16) for a in arrays]

    monkeypatch.setattr(cast_mod, "multi_to_bf16", fake_multi)
    added = []

    def fake_accumulate(acc, g):
        added.append(g.shape)
        acc += g.astype(np.float32)

    monkeypatch.setattr(cast_mod, "accumulate_bf16", fake_accumulate)
    monkeypatch.setattr(cast_mod, "cupy", lambda: np)
    real_resolve = dispatch.resolve
    monkeypatch.setattr(dispatch, "resolve",
                        lambda op, b, d: cast_mod.CastCuda if op == "cast" else real_resolve(op, b, d))
    orig = amp.precast

    def precast_as_cuda(params):  # route the CPU device through the CUDA half
        todo = list({id(p): p for p in params}.values())
        assert amp._precast_cuda(todo, bt.device("cpu"), bt.bfloat16, True, bt.Tensor, accumulate)
        if accumulate:  # the captured step: masters hold zeroed float32 grads before backward
            for p in todo:
                p.grad = bt.zeros(*p.shape)
        return len(todo)

    monkeypatch.setattr(bt.amp, "precast", precast_as_cuda)
    _, info, l1, g1 = _step(ps, x, pre=True)
    monkeypatch.setattr(bt.amp, "precast", orig)
    assert calls == [6] and info["hits"] >= 6
    assert l0 == l1
    # accumulate: the 4 lowered weights' grads were added in place by the fused path (once per cast node: the
    # engine sums the two uses of w1 and w2 before the node's backward)
    assert sorted(added) == (sorted([(16, 8), (16,), (8, 16), (8,)]) if accumulate else [])
    for i, (a, b) in enumerate(zip(g0, g1)):
        if a is None:  # the unused cast: None, or the untouched zero buffer with accumulate
            assert b is None or (accumulate and not b.any()), i
        else:
            np.testing.assert_array_equal(a, b)


@pytest.mark.cuda
@needs_gpu
def test_cuda_precast_accumulate_equals_plain():
    """On the GPU: precast(accumulate=True) into zeroed fp32 grads gives the loss of casts on first use bit for
    bit, and the gradients within bf16 rounding: the precast weights' wgrad GEMMs add their float32 products
    straight into the fp32 buffers, where casts on first use round each weight gradient to bf16 first."""
    import cupy
    from blutensor.backends.cupy.cast import accumulate_bf16, to_bf16

    ps = _params("cuda")
    x = bt.tensor(rng(1).standard_normal((4, 8)).astype(np.float32), device="cuda")
    _, _, l0, g0 = _step(ps, x, pre=False)
    w1, b1, w2, b2, ln, _ = ps
    for p in ps:
        p.grad = bt.zeros(*p.shape, device="cuda")
    with bt.autocast("cuda"):
        assert bt.amp.precast(ps, accumulate=True) == 6
        h = F.gelu(F.linear(x, w1, b1), approximate="tanh")
        loss = ((F.linear(h, w2, b2).float() + F.linear(F.linear(x, w1), w2).float()) * ln).sum()
    loss.backward()
    assert host(loss) == l0
    for p, a in zip(ps, g0):
        want = np.zeros(p.shape, np.float32) if a is None else a
        np.testing.assert_allclose(host(p.grad), want, rtol=0, atol=2.0 ** -7 * float(np.abs(want).max()) + 1e-6)
    acc = cupy.asarray(rng(4).standard_normal(1003).astype(np.float32))
    g = to_bf16(cupy.asarray(rng(5).standard_normal(1003).astype(np.float32)))
    ref = acc + (g.astype(cupy.uint32) << 16).view(cupy.float32)
    accumulate_bf16(acc, g)
    assert bool((acc == ref).all())
    acc2, ref2 = acc.copy(), acc[1:] + (g[1:].astype(cupy.uint32) << 16).view(cupy.float32)
    accumulate_bf16(acc2[1:], g[1:])  # unaligned: scalar path
    assert bool((acc2[1:] == ref2).all())


def test_weight_copies_bookkeeping_cpu():
    """WeightCopies: a copy is current only at the version and storage it was written for; refresh writes the
    bf16 rounding of every weight (NumPy here, one launch on CUDA) into 128-byte-aligned views of one buffer."""
    from blutensor.backends import f32_to_bf16_bits

    ps = _params("cpu")
    wc = bt.amp.WeightCopies(ps + [ps[0]])  # a tied parameter once
    assert len(wc.params) == 6 and all(p in wc for p in ps) and bt.nn.Parameter(bt.ones(2)) not in wc
    assert not any(wc.current(p) for p in ps)
    assert wc.ensure_current() and not wc.ensure_current()
    for p in ps:
        np.testing.assert_array_equal(wc.view(p), f32_to_bf16_bits(p._data, np))
        assert wc.view(p).shape == tuple(p.shape)
    with bt.no_grad():
        ps[1].add_(1.0)  # an in-place update moves the version: that copy is stale
    assert not wc.current(ps[1]) and wc.current(ps[0])
    wc.mark([ps[1]])  # a writer (the fused AdamW) says it wrote it
    assert wc.current(ps[1])
    ps[2].data = bt.zeros(*ps[2].shape)  # new storage: stale
    assert not wc.current(ps[2])
    with pytest.raises(ValueError, match="WeightCopies: parameter 0 must be a C-contiguous float32"):
        bt.amp.WeightCopies([bt.nn.Parameter(bt.ones(2, dtype=bt.float64))])


@pytest.mark.cuda
@needs_gpu
def test_cuda_fused_adamw_writes_the_bf16_copies():
    """GPU twin: the fused AdamW with copies updates params and moments exactly as without, and leaves each copy
    equal, bit for bit, to the cast of the updated weight; precast then uses the copies without a launch."""
    import cupy
    from blutensor.backends.cupy import cast as cast_mod
    from blutensor.backends.cupy.adamw import fused_step

    def run(with_copies):
        ps = [bt.nn.Parameter(bt.tensor(rng(4).standard_normal(s).astype(np.float32), device="cuda"))
              for s in ((300, 70), (70,), (5, 3))]
        opt = bt.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
        wc = bt.amp.WeightCopies(ps) if with_copies else None
        for k in range(3):
            for i, p in enumerate(ps):
                p.grad = bt.tensor(rng(10 + k + i).standard_normal(p.shape).astype(np.float32), device="cuda")
            fused_step(opt, opt.param_groups[0], copies=wc)
        return ps, opt, wc

    ps0, opt0, _ = run(False)
    ps1, opt1, wc = run(True)
    for a, b in zip(ps0, ps1):
        assert bool((a._data == b._data).all())
        assert bool((opt0.state[a]["exp_avg_sq"]._data == opt1.state[b]["exp_avg_sq"]._data).all())
        assert wc.current(b) and bool((wc.view(b) == cast_mod.to_bf16(b._data)).all())
    calls = []
    real = cast_mod.multi_to_bf16
    cast_mod.multi_to_bf16 = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        with bt.autocast("cuda"):
            assert bt.amp.precast(ps1, copies=wc) == 3
            w = bt.amp._cast(ps1[0], bt.bfloat16)
        assert calls == [] and w._data.data.ptr == wc.view(ps1[0]).data.ptr
    finally:
        cast_mod.multi_to_bf16 = real
    cupy.cuda.Device().synchronize()
