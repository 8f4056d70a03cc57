"""nanoGPT's and minGPT's ``generate()`` loops, verbatim, on blutensor: the same source runs with ``torch``,
``nn`` and ``F`` bound to blutensor or to PyTorch; greedy decoding gives the same tokens, top-k sampling draws only
top-k tokens and repeats from the seed."""

from __future__ import annotations

import blutensor as bt
import numpy as np
import torch as real_torch

SOURCE = '''
class Bigram(nn.Module):
    def __init__(self, vocab, block_size):
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab, vocab)

    def forward(self, idx):
        return self.tok(idx), None

    @torch.no_grad()
    def generate_nanogpt(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.block_size else idx[:, -self.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float('Inf')
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx

    @torch.no_grad()
    def generate_mingpt(self, idx, max_new_tokens, temperature=1.0, do_sample=False, top_k=None):
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.block_size else idx[:, -self.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, top_k)
                logits[logits < v[:, [-1]]] = -float('Inf')
            probs = F.softmax(logits, dim=-1)
            if do_sample:
                idx_next = torch.multinomial(probs, num_samples=1)
            else:
                _, idx_next = torch.topk(probs, k=1, dim=-1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
'''

V = 11


def _models():
    out = {}
    for name, mod in (("bt", bt), ("torch", real_torch)):
        ns = {"torch": mod, "nn": mod.nn, "F": mod.nn.functional}
        exec(SOURCE, ns)  # noqa: S102 - the same model source for both frameworks
        out[name] = ns["Bigram"](V, 4)
    w = np.random.default_rng(0).standard_normal((V, V)).astype(np.float32) * 3
    with real_torch.no_grad():
        out["torch"].tok.weight.copy_(real_torch.tensor(w))
    with bt.no_grad():
        out["bt"].tok.weight.copy_(bt.tensor(w))
    return out, w


def test_greedy_generate_matches_pytorch():
    m, _ = _models()
    start = np.array([[1, 2], [5, 0]])
    got = m["bt"].generate_mingpt(bt.tensor(start), 8).numpy()
    want = m["torch"].generate_mingpt(real_torch.tensor(start), 8).numpy()
    np.testing.assert_array_equal(got, want)
    # top_k=1 sampling is greedy too (nanoGPT's loop: topk mask, softmax, multinomial)
    np.testing.assert_array_equal(m["bt"].generate_nanogpt(bt.tensor(start), 8, top_k=1).numpy(), want)


def test_top_k_sampling_draws_only_top_k_and_repeats_from_the_seed():
    m, w = _models()
    start = bt.tensor(np.array([[3], [7], [0]]))
    bt.manual_seed(5)
    a = m["bt"].generate_nanogpt(start, 30, temperature=0.8, top_k=3).numpy()
    top3 = np.argsort(-w, axis=1)[:, :3]
    for row in a:
        for prev, nxt in zip(row[:-1], row[1:]):
            assert nxt in top3[prev], (prev, nxt)
    assert len(set(a[:, 1:].reshape(-1).tolist())) > 3  # it samples, not only the argmax
    bt.manual_seed(5)
    np.testing.assert_array_equal(m["bt"].generate_nanogpt(start, 30, temperature=0.8, top_k=3).numpy(), a)
    s = m["bt"].generate_mingpt(start, 5, do_sample=True, top_k=2).numpy()
    assert s.shape == (3, 6)
