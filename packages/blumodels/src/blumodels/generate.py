"""Autoregressive generation with a key/value cache, for every model family (GPT-2, Llama).

The prompt is run once (prefill) and its keys/values kept per layer in a static ``KVCache`` (buffers allocated
once); each further step feeds only the new token at a position held in device memory, so a step has no host value
in it: on CUDA it is captured into a CUDA graph and replayed once per token (``blumodels.decode``). Prompts of
different lengths are batched: all rows advance together from the shortest prompt's end, and a row still inside
its prompt takes its own prompt token instead of the sampled one (no padding, the same positions as a row
generated alone). Sampling (temperature, top-k, top-p) runs on the device (``blumodels.sampling.sample_next``)
from uniforms of a private ``bt.Generator(seed)``, so training's random stream is untouched.

When a context outgrows ``model.config.block_size`` the window slides like the uncached reference: the last
``block_size`` tokens are run again from position 0 (a fresh prefill) for each token past the limit.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Sequence

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np

from blumodels.decode import Decoder
from blumodels.kv_cache import KVCache

__all__ = ["KVCache", "cached_forward", "filter_logits", "generate_batch"]


def _gpt2_forward(model, idx: bt.Tensor, cache: KVCache) -> bt.Tensor:
    """GPT-2's forward over ``idx`` as the positions after the cached ones (host or device positions, see
    ``KVCache``); last position's logits (B, 1, Vp)."""
    B, T = idx.shape
    if not cache.on_device and cache.pos + T > model.config.block_size:
        raise ValueError(f"GPT2: positions up to {cache.pos + T} exceed model.block_size={model.config.block_size}")
    x = model.wte(idx) + cache.rows(model.wpe.weight, T)
    for i, blk in enumerate(model.blocks):
        a = blk.attn
        H, hd = a.n_head, a.head_dim
        qkv = a.c_attn(blk.ln_1(x)).view(B, T, 3, H, hd).permute(2, 0, 3, 1, 4)
        y = cache.attend(i, qkv[0], qkv[1], qkv[2])
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
    likely token always stays): the float64 NumPy reference of the device sampler's filter.

    Top-k keeps the tokens at or above the k-th largest value (ties with it stay); top-p then keeps the tokens
    whose strictly more likely tokens hold at most ``top_p`` of the probability mass (so tokens tied with the
    nucleus's last one stay: the cut does not depend on token order)."""
    V = z.shape[0]
    if top_k is not None and 0 < top_k < V:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-z, kind="stable")
        zs = z[order]
        p = np.exp(zs - zs[0])
        p /= p.sum()
        before = np.cumsum(p) - p  # probability mass of the tokens earlier in the order
        first = np.r_[True, zs[1:] != zs[:-1]]  # the first token of each run of equal values
        before = np.maximum.accumulate(np.where(first, before, 0.0))  # ... whose mass is the strictly larger one
        z = z.copy()
        z[order[before > top_p]] = -np.inf
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
                   device: str | bt.device | None = None, cuda_graph: bool | str = "auto") -> list[list[int]]:
    """Continue each prompt by ``max_new_tokens`` sampled tokens (fewer when ``stop_token`` is drawn; it is kept);
    returns every row's prompt + continuation.

    Sampling: logits / temperature, then top-k, then top-p (nucleus), over the real vocabulary (rows >=
    ``vocab_size`` of a padded vocabulary are never drawn); ``top_k=1`` is greedy (the argmax). It runs on the
    model's device from uniforms of ``bt.Generator(seed)``: the same tokens for the same seed on every device up to
    the logits' own rounding. ``use_cache=False`` recomputes the whole context every step (the reference the
    cached path is checked against; same sampler, same draws).

    ``cuda_graph`` (as ``train.cuda_graph``): ``"auto"`` captures the decode step into a CUDA graph wherever it can
    (on CUDA with a capture-safe GEMM provider; otherwise one logged line says why and the step runs eagerly; on
    the CPU the same step runs through its eager twin), ``True`` requires the capture (a ValueError naming what
    prevents it, before any work), ``False`` runs every step eagerly.
    """
    rows = _check(prompts, max_new_tokens, temperature, top_k, top_p)
    cfg = model.config
    for i, r in enumerate(rows):
        bad = [t for t in r if not 0 <= t < cfg.padded_vocab_size]
        if bad:
            raise ValueError(f"generate: prompt {i} holds token {bad[0]}, outside the model's vocabulary "
                             f"(0..{cfg.padded_vocab_size - 1})")
    if vocab_size is not None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral) \
                or not 0 < vocab_size <= cfg.padded_vocab_size:
            raise ValueError(f"generate: vocab_size must be an integer in 1..{cfg.padded_vocab_size} (the model's "
                             f"padded vocabulary), got {vocab_size!r}")
        vocab_size = int(vocab_size)
    if stop_token is not None:
        if isinstance(stop_token, bool) or not isinstance(stop_token, numbers.Integral):
            raise ValueError(f"generate: stop_token must be an integer token id or None, got {stop_token!r}")
        stop_token = int(stop_token)
    if device is None:
        device = next(iter(model.parameters())).device
    fwd = cached_forward(model) if use_cache else None
    if use_cache and fwd is None:
        raise ValueError(f"generate: {type(model).__name__} has no cached forward (use_cache=False recomputes)")
    dec = Decoder(model, rows, max_new_tokens, fwd=fwd, device=device, temperature=temperature, top_k=top_k,
                  top_p=top_p, seed=seed, vocab_size=vocab_size, stop_token=stop_token, cuda_graph=cuda_graph)
    return dec.run()
