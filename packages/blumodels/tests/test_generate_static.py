"""The static-cache decode loop (blumodels.decode) and the device sampler (sampling.sample_next) on the CPU.

The decode step runs through its CPU twin (EagerCapture: captured once after the warm-up steps, then replayed):
tokens equal to the uncached loop and to a float64 host reference loop (greedy), batched prompts of different
lengths, stop tokens read every few steps cut exactly as a step-by-step loop would, the window slide past
block_size, static buffers kept and no tensor read on the host during replays. The sampler's top-k / top-p cut
equals NumPy's sort-based one, and its draws follow the reference distribution (chi-square, fixed seed).
The same assertions with a real CUDA graph: the cuda-marked tests at the end.
"""

from __future__ import annotations

import blutensor as bt
import numpy as np
import pytest
from blumodels.config import ModelConfig
from blumodels.decode import WARMUP_STEPS, Decoder, capture_refusal
from blumodels.families import build_model
from blumodels.generate import cached_forward, filter_logits, generate_batch
from blumodels.graph_step import EagerCapture
from blumodels.sampling import _largest_key_above, order_keys, sample_next

GPT2 = ModelConfig(n_layer=2, n_head=2, d_model=16, block_size=12, vocab_size=70)
LLAMA = ModelConfig(family="llama", n_layer=2, n_head=4, n_kv_heads=2, d_model=32, block_size=12, vocab_size=70,
                    bias=False, ffn_dim_multiple=16, tie_embeddings=False, rope_theta=500.0)
CFGS = pytest.mark.parametrize("cfg", [GPT2, LLAMA], ids=["gpt2", "llama"])


def _cuda_ok() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


cuda = [pytest.mark.cuda, pytest.mark.skipif(not _cuda_ok(), reason="needs CuPy and a GPU")]


def _decoder(m, prompts, n, device="cpu", **kw):
    return Decoder(m, prompts, n, fwd=cached_forward(m), device=device, **kw)


def _host_greedy(m, prompts, n, device="cpu"):
    """The reference: the whole window every step, float64 logits on the host, filter_logits' top-1."""
    V = m.config.vocab_size
    out = []
    with bt.no_grad():
        for p in prompts:
            toks = list(p)
            for _ in range(n):
                ctx = toks[-m.config.block_size:]
                logits, _ = m(bt.tensor([ctx], dtype=bt.int64, device=device))
                z = logits.to("cpu").numpy()[0, -1, :V].astype(np.float64)
                toks.append(int(np.argmax(filter_logits(z, 1, None))))
            out.append(toks)
    return out


def _host_sampled(m, prompts, n, temperature, top_k, top_p, seed):
    """The float64 host sampler over the uncached logits with the decode loop's uniforms (row t - t0 of
    ``bt.Generator(seed).uniform((W - t0, B))``): filter_logits, then the first token whose cumulative mass in
    vocabulary order reaches (1 - u) of the total."""
    V, block = m.config.vocab_size, m.config.block_size
    lens = [len(p) for p in prompts]
    t0, W = min(lens), max(lens) + n
    u = bt.Generator(seed).uniform((W - t0, len(prompts)), np, np.float64)
    rows = [list(p) for p in prompts]
    with bt.no_grad():
        for t in range(t0, W):
            for i, r in enumerate(rows):
                if t < lens[i] or t >= lens[i] + n:
                    continue
                logits, _ = m(bt.tensor([r[max(0, t - block):t]], dtype=bt.int64))
                z = logits.numpy()[0, -1, :V].astype(np.float64)
                f = filter_logits(z / temperature, top_k, top_p)
                cdf = np.cumsum(np.exp(f - f.max()))
                r.append(int((cdf < (1.0 - u[t - t0, i]) * cdf[-1]).sum()))
    return rows


# ---- the decode loop ----


def _check_twin(m, prompts, n, kw, device="cpu", make_capture=EagerCapture):
    """Captured (twin or real) == eager steps == uncached; the capture happened once, after the warm-up."""
    dec = _decoder(m, prompts, n, device=device, make_capture=make_capture, **kw)
    got = dec.run()
    assert dec.captured and dec.refusal is None and dec._cap.captures == 1
    assert dec.replays == dec.decode_steps - WARMUP_STEPS > 0
    eager = _decoder(m, prompts, n, device=device, cuda_graph=False, **kw)
    assert eager.run() == got and not eager.captured and eager.replays == 0
    assert generate_batch(m, prompts, n, use_cache=False, **kw) == got
    return got


@CFGS
@pytest.mark.parametrize("kw", [dict(top_k=1), dict(temperature=0.8, top_k=9, top_p=0.85, seed=7),
                                dict(temperature=1.3, seed=2)], ids=["greedy", "topk-topp", "plain"])
def test_captured_twin_equals_eager_and_uncached(cfg, kw):
    m = build_model(cfg, seed=3)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    got = _check_twin(m, prompts, 8, kw)  # 5 + 8 > 12: the longest row's window slides at its end
    assert [len(r) for r in got] == [11, 13, 9] and all(r[:len(p)] == p for r, p in zip(got, prompts))
    assert all(0 <= t < 70 for r in got for t in r)
    if kw.get("top_k") == 1:
        assert got == _host_greedy(m, prompts, 8)


@CFGS
@pytest.mark.parametrize("temperature, top_k, top_p", [(0.8, 9, 0.85), (1.2, None, 0.7), (1.0, 5, None)])
def test_device_sampler_equals_the_host_float64_sampler(cfg, temperature, top_k, top_p):
    m = build_model(cfg, seed=6)
    prompts = [[5, 1, 2], [7], [3, 3, 3, 3]]
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=9)
    assert generate_batch(m, prompts, 10, **kw) == _host_sampled(m, prompts, 10, **kw)


@CFGS
def test_window_slide_and_batched_prompts_greedy(cfg):
    m = build_model(cfg, seed=5)
    prompts = [[3, 1, 4, 1, 5, 9, 2], [2, 7], [6] * 13]  # the last one is longer than block_size already
    got = generate_batch(m, prompts, 10, top_k=1)
    assert got == _host_greedy(m, prompts, 10)
    assert got == [generate_batch(m, [p], 10, top_k=1)[0] for p in prompts]
    dec = _decoder(m, prompts[:2], 10, top_k=1)
    assert dec.run() == got[:2]
    assert dec.decode_steps == 12 - 2 and dec.captured  # positions 3..12 decoded; past 12 each step a prefill
    alone = _decoder(m, prompts[2:], 10, top_k=1)
    assert alone.run() == got[2:] and alone.decode_steps == 0  # the window slides from the first step


@CFGS
@pytest.mark.parametrize("check_every", [1, 3, 32])
def test_stop_token_cuts_rows_like_a_step_by_step_loop(cfg, check_every):
    m = build_model(cfg, seed=1)
    prompts = [[1, 2], [3, 4, 5, 6], [7]]
    kw = dict(temperature=1.5, seed=11)
    full = generate_batch(m, prompts, 9, **kw)
    stop = full[0][len(prompts[0]) + 2]  # drawn by row 0 at its 3rd new token (maybe earlier too)

    def cut(row, p):
        gen = row[len(p):]
        return p + (gen[:gen.index(stop) + 1] if stop in gen else gen)

    dec = _decoder(m, prompts, 9, stop_token=stop, check_every=check_every, **kw)
    got = dec.run()
    assert got == [cut(r, p) for r, p in zip(full, prompts)]
    assert len(got[0]) <= len(prompts[0]) + 3
    assert generate_batch(m, prompts, 9, stop_token=stop, use_cache=False, **kw) == got


def test_prompt_token_equal_to_stop_token_does_not_stop():
    m = build_model(GPT2, seed=0)
    full = generate_batch(m, [[5, 6, 7]], 4, top_k=1)[0]
    assert generate_batch(m, [[5, 6, 7]], 4, top_k=1, stop_token=5)[0] == \
        (full if 5 not in full[3:] else full[:3 + full[3:].index(5) + 1])


def test_replays_keep_static_buffers_and_read_nothing_on_the_host(monkeypatch):
    m = build_model(LLAMA, seed=2)
    caps = []

    class Watched(EagerCapture):
        def capture(self, body, pool=None):
            super().capture(body, pool)
            caps.append(self)

        def replay(self):
            dec = self.body.__self__
            before = (dec.tok_in._data, dec.toks._data, dec.cache.device_pos, [k._data for k in dec.cache.k])
            super().replay()
            after = (dec.tok_in._data, dec.toks._data, dec.cache.device_pos, [k._data for k in dec.cache.k])
            assert all(a is b for a, b in zip(before[:3], after[:3])) and all(
                a is b for a, b in zip(before[3], after[3]))

    reads = {"n": 0}
    real_replay = Watched.replay

    def counting_replay(self):
        for name in ("item", "numpy", "tolist", "__float__", "__bool__", "__int__", "__index__"):
            orig = getattr(bt.Tensor, name)

            def counting(t, *a, _orig=orig, **k):
                reads["n"] += 1
                return _orig(t, *a, **k)

            monkeypatch.setattr(bt.Tensor, name, counting)
        try:
            real_replay(self)
        finally:
            monkeypatch.undo()

    monkeypatch.setattr(Watched, "replay", counting_replay)
    dec = _decoder(m, [[1, 2, 3]], 7, top_k=3, seed=4, make_capture=Watched)
    dec.run()
    assert len(caps) == 1 and dec.replays == 7 - 1 - WARMUP_STEPS and reads["n"] == 0
    assert int(dec.cache.device_pos[0]) == 3 + 7 - 1 and int(dec.t_dev[0]) == 3 + 7


def test_failed_capture_is_logged_and_the_step_runs_eagerly(caplog):
    m = build_model(GPT2, seed=8)

    class Refusing(EagerCapture):
        def capture(self, body, pool=None):
            raise RuntimeError("operation not permitted when stream is capturing")

    want = generate_batch(m, [[1, 2], [3]], 7, top_k=4, seed=1, cuda_graph=False)
    dec = _decoder(m, [[1, 2], [3]], 7, top_k=4, seed=1, make_capture=Refusing)
    with caplog.at_level("WARNING", logger="blumodels.decode"):
        assert dec.run() == want
    assert not dec.captured and dec.replays == 0 and dec.decode_steps == 7  # positions 2..8 (t0 = 1)
    assert dec.refusal == "capturing the decode step failed: RuntimeError: operation not permitted when stream is " \
                          "capturing"
    assert any(dec.refusal in r.getMessage() and "runs eagerly" in r.getMessage() for r in caplog.records)


def test_family_reading_host_positions_decodes_eagerly():
    m = build_model(LLAMA, seed=4)
    want = generate_batch(m, [[1, 2], [3]], 6, temperature=0.7, seed=3)
    m.decode_on_device = False  # a family whose cached forward takes positions from the host
    dec = _decoder(m, [[1, 2], [3]], 6, temperature=0.7, seed=3)
    assert dec.run() == want and dec.decode_steps == 0 and not dec.captured


def test_cuda_graph_argument_errors():
    m = build_model(GPT2, seed=0)
    with pytest.raises(ValueError, match="cuda_graph=True cannot capture the decode step: the model is on 'cpu'"):
        generate_batch(m, [[1]], 3, cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph=True needs the key/value cache"):
        generate_batch(m, [[1]], 3, cuda_graph=True, use_cache=False)
    with pytest.raises(ValueError, match="cuda_graph must be True, False or 'auto'"):
        generate_batch(m, [[1]], 3, cuda_graph="yes")
    with pytest.raises(ValueError, match="vocab_size must be an integer in 1..128"):
        generate_batch(m, [[1]], 3, vocab_size=500)
    assert capture_refusal("cpu", m).startswith("the model is on 'cpu'")
    assert generate_batch(m, [[1, 2]], 0) == [[1, 2]]


# ---- the sampler ----


def test_order_keys_follow_the_float_order():
    v = np.array([-np.inf, -3e38, -1.5, -1e-40, -0.0, 0.0, 1e-40, 2.0, 3e38, np.inf], dtype=np.float32)
    k = order_keys(v[None, :])[0]
    assert (np.diff(k[[0, 1, 2, 3, 4, 6, 7, 8, 9]]) > 0).all() and k[4] == k[5]  # -0 and +0: one key
    assert k.min() >= 0 and k.max() < 2**32


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("k", [1, 2, 7, 40, 63])
def test_radix_top_k_cut_equals_sorting(k, bits):
    rng = np.random.default_rng(k)
    z = rng.standard_normal((6, 64)).astype(np.float32) * 4
    z[1] = np.round(z[1])  # many ties
    z[2, :10] = z[2].max()
    key = order_keys(z)
    kth = _largest_key_above(key, None, k - 1, bits)
    want = np.sort(z, axis=1)[:, -k]
    np.testing.assert_array_equal(order_keys(want[:, None])[:, 0], kth)


def test_large_batches_search_in_smaller_passes(monkeypatch):
    import blumodels.sampling as sm

    z = np.random.default_rng(3).standard_normal((16, 200)).astype(np.float32)
    u = bt.Generator(5).uniform((16,), np, np.float64)
    want = sample_next(z, u, 0.9, 30, 0.8)
    monkeypatch.setattr(sm, "SEARCH_TEMP_BYTES", 16 * 200 * 3)  # top-k: 2 bits a pass, top-p: 1 bit
    assert sm._search_bits(16, 200, 1, 4) == 2 and sm._search_bits(16, 200, 8, 2) == 1
    np.testing.assert_array_equal(sample_next(z, u, 0.9, 30, 0.8), want)


def _dist(z, temperature, top_k, top_p):
    f = filter_logits(z.astype(np.float64) / temperature, top_k, top_p)
    p = np.exp(f - f.max())
    return p / p.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.7, 10, None), (1.0, None, 0.8),
                                                       (1.3, 20, 0.6), (1.0, 5, 0.999)])
def test_device_sampler_matches_the_reference_distribution(temperature, top_k, top_p):
    V, N = 50, 20000
    z = (np.random.default_rng(0).standard_normal(V) * 1.5).astype(np.float32)
    u = bt.Generator(123).uniform((N,), np, np.float64)
    tok = sample_next(np.tile(z, (N, 1)), u, temperature, top_k, top_p)
    p = _dist(z, temperature, top_k, top_p)
    counts = np.bincount(tok, minlength=V)
    assert counts[p == 0].sum() == 0  # nothing outside the filter
    kept = p > 0
    exp = N * p[kept]
    chi2 = float(((counts[kept] - exp) ** 2 / exp).sum())
    dof = int(kept.sum()) - 1
    assert chi2 < dof + 6 * np.sqrt(2 * dof), (chi2, dof)


def test_top_p_keeps_ties_and_greedy_is_argmax():
    z = np.log(np.array([0.3, 0.3, 0.2, 0.1, 0.1], dtype=np.float32))
    assert np.isfinite(filter_logits(z.astype(np.float64), None, 0.5)).tolist() == [True, True, False, False, False]
    assert np.isfinite(filter_logits(z.astype(np.float64), None, 0.85)).tolist() == [True] * 5  # ties at the cut
    u = np.linspace(0, 1, 400, endpoint=False)
    draws = set(sample_next(np.tile(z, (400, 1)), u, top_p=0.85).tolist())
    assert draws == {0, 1, 2, 3, 4}
    assert set(sample_next(np.tile(z, (400, 1)), u, top_p=0.5).tolist()) == {0, 1}
    zz = np.random.default_rng(1).standard_normal((9, 33)).astype(np.float32)
    np.testing.assert_array_equal(sample_next(zz, np.zeros(9), top_k=1), zz.argmax(axis=1))
    with pytest.raises(ValueError, match="z must be a \\(batch, vocab\\) float array"):
        sample_next(zz[0], np.zeros(9))
    with pytest.raises(ValueError, match="u must hold one uniform per row, shape \\(9,\\)"):
        sample_next(zz, np.zeros(8))


# ---- the same on a GPU (a real CUDA graph) ----


@pytest.mark.parametrize("cfg", [GPT2, LLAMA], ids=["gpt2", "llama"])
@pytest.mark.parametrize("kw", [dict(top_k=1), dict(temperature=0.8, top_k=9, top_p=0.85, seed=7)],
                         ids=["greedy", "topk-topp"])
@pytest.mark.parametrize("_", [pytest.param(0, marks=cuda)])
def test_cuda_captured_decode_equals_eager_uncached_and_host(cfg, kw, _):
    from blumodels.decode import CudaDecodeCapture

    m = build_model(cfg, seed=3, device="cuda")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    got = _check_twin(m, prompts, 8, kw, device="cuda", make_capture=CudaDecodeCapture)
    if kw.get("top_k") == 1:
        assert got == _host_greedy(m, prompts, 8, device="cuda")
        cpu = build_model(cfg, seed=3, device="cpu")  # the same weights on the CPU twin
        assert generate_batch(cpu, prompts, 8, **kw) == got
    stop = got[0][4]
    dec = _decoder(m, prompts, 8, device="cuda", stop_token=stop, check_every=2, **kw)
    eager = _decoder(m, prompts, 8, device="cuda", stop_token=stop, check_every=2, cuda_graph=False, **kw)
    cut = [p + (r[len(p):][:r[len(p):].index(stop) + 1] if stop in r[len(p):] else r[len(p):])
           for r, p in zip(got, prompts)]
    assert dec.run() == eager.run() == cut and dec.captured and not eager.captured


@pytest.mark.parametrize("top_k, top_p", [(10, None), (None, 0.8), (20, 0.6)])
@pytest.mark.parametrize("_", [pytest.param(0, marks=cuda)])
def test_cuda_sampler_matches_the_reference_distribution(top_k, top_p, _):
    import cupy

    V, N = 50, 20000
    z = (np.random.default_rng(0).standard_normal(V) * 1.5).astype(np.float32)
    u = bt.Generator(123).uniform((N,), cupy, np.float64)
    tok = cupy.asnumpy(sample_next(cupy.asarray(np.tile(z, (N, 1))), u, 1.0, top_k, top_p))
    np.testing.assert_array_equal(tok, sample_next(np.tile(z, (N, 1)), cupy.asnumpy(u), 1.0, top_k, top_p))
    p = _dist(z, 1.0, top_k, top_p)
    counts = np.bincount(tok, minlength=V)
    assert counts[p == 0].sum() == 0
    kept = p > 0
    exp = N * p[kept]
    chi2 = float(((counts[kept] - exp) ** 2 / exp).sum())
    assert chi2 < kept.sum() - 1 + 6 * np.sqrt(2 * (kept.sum() - 1))
