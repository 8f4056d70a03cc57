"""Autoregressive generation with a key/value cache, for every model family (GPT-2, Llama).

The prompt is run once (prefill) and its keys/values kept per layer in a ``KVCache``; each further step feeds
only the new token (one position per step), so the cost of a step grows with the context instead of its square.
Prompts of different lengths are batched: all rows advance together from the shortest prompt's end, and a row
still inside its prompt takes its own prompt token instead of the sampled one (no padding, no masks, the same
positions as a row generated alone). Sampling (temperature, top-k, top-p) runs on the host in float64 from a
private ``bt.Generator``, so training's random stream is untouched.

When a context outgrows ``model.config.block_size`` the window slides like the uncached reference: the last
``block_size`` tokens are run again from position 0 (a fresh prefill) for each token past the limit.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np


class KVCache:
    """Per-layer key/value buffers (B, kv_heads, max_len, head_dim), allocated on the first write with the
    dtype and device of the keys; ``pos`` is the number of positions already held."""

    def __init__(self, n_layer: int, max_len: int):
        if n_layer <= 0 or max_len <= 0:
            raise ValueError(f"KVCache: n_layer and max_len must be positive, got {n_layer}, {max_len}")
        self.max_len = max_len
        self.k: list[bt.Tensor | None] = [None] * n_layer
        self.v: list[bt.Tensor | None] = [None] * n_layer
        self.pos = 0
        self._masks: dict[tuple[int, int, str], bt.Tensor] = {}

    def reset(self) -> None:
        self.pos = 0

    def update(self, layer: int, k: bt.Tensor, v: bt.Tensor):
        """Store ``k``/``v`` (B, H, T, hd) at positions pos..pos+T-1 of ``layer``; returns the keys and values of
        positions 0..pos+T-1 and the attention mask those T queries need (None: causal prefill or one query)."""
        B, H, T, hd = k.shape
        s = self.pos
        if s + T > self.max_len:
            raise ValueError(f"KVCache: {s + T} positions exceed its max_len={self.max_len}")
        if self.k[layer] is None or tuple(self.k[layer].shape) != (B, H, self.max_len, hd):
            self.k[layer] = bt.zeros(B, H, self.max_len, hd, dtype=k.dtype, device=k.device)
            self.v[layer] = bt.zeros(B, H, self.max_len, hd, dtype=v.dtype, device=v.device)
        self.k[layer][:, :, s:s + T] = k
        self.v[layer][:, :, s:s + T] = v
        mask = None
        if s > 0 and T > 1:  # a chunk after cached positions: query i sees keys 0..s+i
            key = (s, T, str(k.device))
            mask = self._masks.get(key)
            if mask is None:
                m = np.arange(s + T)[None, :] <= (s + np.arange(T))[:, None]
                mask = self._masks[key] = bt.tensor(m, dtype=bt.bool, device=k.device)
        return self.k[layer][:, :, :s + T], self.v[layer][:, :, :s + T], mask

    def advance(self, T: int) -> None:
        self.pos += T


def _gpt2_forward(model, idx: bt.Tensor, cache: KVCache) -> bt.Tensor:
    """GPT-2's forward over ``idx`` as the positions after the cached ones; last position's logits (B, 1, Vp)."""
    B, T = idx.shape
    s = cache.pos
    pos = bt.arange(s, s + T, dtype=bt.int64, device=idx.device)
    x = model.wte(idx) + model.wpe(pos)
    for i, blk in enumerate(model.blocks):
        a = blk.attn
        H, hd = a.n_head, a.head_dim
        qkv = a.c_attn(blk.ln_1(x)).view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4)
        k, v, mask = cache.update(i, qkv[1], qkv[2])
        y = F.scaled_dot_product_attention(qkv[0], k, v, attn_mask=mask, is_causal=mask is None and T > 1)
        x = x + a.c_proj(y.transpose(1, 2).reshape(B, T, H * hd))
        x = x + blk.mlp(blk.ln_2(x))
    cache.advance(T)
    return F.linear(model.ln_f(x)[:, -1:, :], model.wte.weight)


def cached_forward(model):
    """``fn(idx, cache) -> last-position logits`` for ``model``, or None when its family has no cached path."""
    from blumodels.gpt2 import GPT2

    if isinstance(model, GPT2):
        return lambda idx, cache: _gpt2_forward(model, idx, cache)
    try:
        takes_cache = "cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes_cache = False
    if takes_cache:
        return lambda idx, cache: model(idx, cache=cache)[0]
    return None


def filter_logits(z: np.ndarray, top_k: int | None, top_p: float | None) -> np.ndarray:
    """``z`` (V,) float64 with the tokens outside the top-k and outside the top-p nucleus set to -inf (the most
    likely token always stays)."""
    V = z.shape[0]
    if top_k is not None and 0 < top_k < V:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-z, kind="stable")
        p = np.exp(z[order] - z[order[0]])
        p /= p.sum()
        before = np.cumsum(p) - p  # probability mass of the more likely tokens
        drop = order[before > top_p]
        z = z.copy()
        z[drop] = -np.inf
    return z


def _check(prompts, max_new_tokens, temperature, top_k, top_p) -> list[list[int]]:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if not temperature > 0:
        raise ValueError(f"generate: temperature must be positive, got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"generate: top_k must be a non-negative integer or None, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"generate: top_p must be in (0, 1], got {top_p}")
    rows = [[int(t) for t in np.asarray(p).reshape(-1)] for p in prompts]
    if not rows:
        raise ValueError("generate: no prompts given")
    for i, r in enumerate(rows):
        if not r:
            raise ValueError(f"generate: prompt {i} holds no token (give at least one, e.g. the end-of-text token)")
    return rows


def generate_batch(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 1.0,
                   top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                   vocab_size: int | None = None, stop_token: int | None = None, use_cache: bool = True,
                   device: str | bt.device | None = None) -> list[list[int]]:
    """Continue each prompt by ``max_new_tokens`` sampled tokens (fewer when ``stop_token`` is drawn; it is kept);
    returns every row's prompt + continuation.

    Sampling: logits / temperature, then top-k, then top-p (nucleus), over the real vocabulary (rows >=
    ``vocab_size`` of a padded vocabulary are never drawn); ``top_k=1`` is greedy. ``use_cache=False`` recomputes
    the whole context every step (the reference the cached path is checked against).
    """
    rows = _check(prompts, max_new_tokens, temperature, top_k, top_p)
    cfg = model.config
    V = vocab_size or cfg.vocab_size
    for i, r in enumerate(rows):
        bad = [t for t in r if not 0 <= t < cfg.padded_vocab_size]
        if bad:
            raise ValueError(f"generate: prompt {i} holds token {bad[0]}, outside the model's vocabulary "
                             f"(0..{cfg.padded_vocab_size - 1})")
    if device is None:
        device = next(iter(model.parameters())).device
    fwd = cached_forward(model) if use_cache else None
    if use_cache and fwd is None:
        raise ValueError(f"generate: {type(model).__name__} has no cached forward (use_cache=False recomputes)")
    B = len(rows)
    lens = [len(r) for r in rows]
    end = [n + max_new_tokens for n in lens]
    toks = np.zeros((B, max(end)), dtype=np.int64)
    for i, r in enumerate(rows):
        toks[i, :len(r)] = r
    done = [False] * B
    out_len = list(end)
    gen = bt.Generator(seed)
    block = cfg.block_size
    cache = KVCache(cfg.n_layer, block) if use_cache else None
    start = 0  # first position the cache holds (the window start)
    was_training = model.training
    model.eval()
    try:
        with bt.no_grad():
            for t in range(min(lens), max(end)):
                if all(done):
                    break
                lo = max(0, t - block)
                if cache is not None:
                    if lo != start:  # the window slid: run the last block_size tokens again from position 0
                        cache.reset()
                        start = lo
                    new = toks[:, start + cache.pos:t]
                    logits = fwd(bt.tensor(new, dtype=bt.int64, device=device), cache)
                else:
                    logits, _ = model(bt.tensor(toks[:, lo:t], dtype=bt.int64, device=device))
                z_all = logits.detach().to("cpu").to(bt.float32).numpy()[:, -1, :V].astype(np.float64)
                u = gen.uniform((B,), np, np.float64)
                for i in range(B):
                    if t < lens[i]:
                        continue  # still inside this row's prompt: its own token stays
                    if done[i] or t >= end[i]:
                        toks[i, t] = toks[i, t - 1]  # keeps the batch rectangular; cut from the result
                        continue
                    z = filter_logits(z_all[i] / temperature, top_k, top_p)
                    p = np.exp(z - z.max())
                    p /= p.sum()
                    toks[i, t] = nxt = int(min(np.searchsorted(np.cumsum(p), u[i], side="right"), V - 1))
                    if stop_token is not None and nxt == stop_token:
                        done[i] = True
                        out_len[i] = t + 1
                    elif t + 1 >= end[i]:
                        done[i] = True
    finally:
        model.train(was_training)
    return [toks[i, :out_len[i]].tolist() for i in range(B)]
