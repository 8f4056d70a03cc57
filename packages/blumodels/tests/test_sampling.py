"""Top-k sampling: only the k most likely tokens, never padded rows, reproducible, RNG untouched."""

import blutensor as bt
import numpy as np
from blumodels.config import ModelConfig
from blumodels.gpt2 import build_model
from blumodels.sampling import generate

CFG = ModelConfig(n_layer=1, n_head=2, d_model=16, block_size=8, vocab_size=70)  # padded to 128


def test_top_k_and_padding():
    m = build_model(CFG, seed=0)
    with bt.no_grad():  # make the padded rows the most likely: they must still never be drawn
        m.wte.weight._data[70:] *= 50
    prompt = [1, 2, 3]
    out = generate(m, prompt, 20, top_k=3, seed=1)
    assert out[:3] == prompt and len(out) == 23
    assert all(0 <= t < 70 for t in out)
    # each drawn token is among the 3 most likely given its context (block_size crops the context)
    for i in range(3, len(out)):
        ctx = out[max(0, i - CFG.block_size):i]
        logits, _ = m(bt.tensor([ctx], dtype=bt.int64))
        top = np.argsort(logits.numpy()[0, -1, :70])[-3:]
        assert out[i] in top


def test_reproducible_and_rng_untouched():
    m = build_model(CFG, seed=0)
    bt.manual_seed(123)
    state = bt.get_rng_state()
    a = generate(m, [5], 10, top_k=10, seed=4)
    assert bt.get_rng_state() == state
    assert a == generate(m, [5], 10, top_k=10, seed=4)
    assert a != generate(m, [5], 10, top_k=10, seed=5)


def test_top_1_is_greedy():
    m = build_model(CFG, seed=2)
    out = generate(m, [7], 4, top_k=1, seed=9)
    for i in range(1, len(out)):
        logits, _ = m(bt.tensor([out[:i]], dtype=bt.int64))
        assert out[i] == int(np.argmax(logits.numpy()[0, -1, :70]))
