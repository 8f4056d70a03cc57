"""Generation with the key/value cache: equal to the uncached loop for both families, batched prompts of
different lengths equal to each prompt alone (greedy), top-p, errors, and the cache's logits vs a full forward."""

import blutensor as bt
import numpy as np
import pytest
from blumodels.config import ModelConfig
from blumodels.families import build_model
from blumodels.generate import KVCache, cached_forward, filter_logits, generate_batch

GPT2 = ModelConfig(n_layer=2, n_head=2, d_model=16, block_size=12, vocab_size=70)
LLAMA = ModelConfig(family="llama", n_layer=2, n_head=4, n_kv_heads=2, d_model=32, block_size=12, vocab_size=70,
                    bias=False, ffn_dim_multiple=16, tie_embeddings=False, rope_theta=500.0)


def _cuda_ok() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda,
                                              pytest.mark.skipif(not _cuda_ok(), reason="needs CuPy and a GPU")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_cached_equals_uncached(cfg, device):
    m = build_model(cfg, seed=3, device=device)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    kw = dict(temperature=0.9, top_k=20, top_p=0.9, seed=5, vocab_size=70)
    cached = generate_batch(m, prompts, 16, **kw)  # 8 + 16 > block_size 12: the window slides too
    assert cached == generate_batch(m, prompts, 16, use_cache=False, **kw)
    assert [len(r) for r in cached] == [19, 21, 17]
    assert all(r[:len(p)] == p for r, p in zip(cached, prompts))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_cache_logits_match_full_forward(cfg, device):
    m = build_model(cfg, seed=1, device=device)
    m.eval()
    ids = np.random.default_rng(0).integers(0, 70, (2, 9))
    fwd = cached_forward(m)
    cache = KVCache(cfg.n_layer, cfg.block_size)

    def run(f, a):
        return f(bt.tensor(a, dtype=bt.int64, device=device)).to("cpu").numpy()[:, 0]

    with bt.no_grad():
        got = [run(lambda x: fwd(x, cache), ids[:, :4])]  # prefill
        got.append(run(lambda x: fwd(x, cache), ids[:, 4:6]))  # a chunk after the cached positions
        for t in range(6, 9):  # one token per step
            got.append(run(lambda x: fwd(x, cache), ids[:, t:t + 1]))
        want = [run(lambda x: m(x)[0], ids[:, :t]) for t in (4, 6, 7, 8, 9)]
    assert cache.pos == 9
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_batched_greedy_equals_each_alone():
    m = build_model(LLAMA, seed=0)
    prompts = [[3, 1, 4, 1, 5], [2, 7]]
    batch = generate_batch(m, prompts, 6, top_k=1)
    assert batch == [generate_batch(m, [p], 6, top_k=1)[0] for p in prompts]


def test_stop_token_and_top_p_filter():
    z = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    kept = np.isfinite(filter_logits(z, None, 0.7))
    assert kept.tolist() == [True, True, False, False]  # 0.5 < 0.7, 0.5 + 0.3 covers it
    assert np.isfinite(filter_logits(z, None, 0.01)).sum() == 1
    assert np.isfinite(filter_logits(z, 3, None)).sum() == 3
    m = build_model(GPT2, seed=0)
    greedy = generate_batch(m, [[1]], 5, top_k=1)[0]
    stop = greedy[2]
    stopped = generate_batch(m, [[1]], 5, top_k=1, stop_token=stop)[0]
    assert stopped == greedy[:greedy.index(stop, 1) + 1]


@pytest.mark.parametrize("kw,msg", [({"temperature": 0.0}, "temperature must be positive"),
                                    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
                                    ({"top_k": -1}, "top_k must be a non-negative"),
                                    ({"prompts": [[1], []]}, "prompt 1 holds no token"),
                                    ({"prompts": [[500]]}, "outside the model's vocabulary")])
def test_bad_input(kw, msg):
    m = build_model(GPT2, seed=0)
    prompts = kw.pop("prompts", [[1]])
    with pytest.raises(ValueError, match=msg):
        generate_batch(m, prompts, 3, **kw)
