"""Text sampling from a trained model (any family) with its own Philox generator so training's RNG stream is
untouched; the token loop with its key/value cache is ``blumodels.generate``.

:func:`sample_next` is the sampler of that loop: it runs on the logits' own device (NumPy or CuPy arrays) with
array operations only (compare, reduce, cumsum, where): no sort, no host read, so it sits inside a captured decode
step. Top-k and top-p find their cut as a threshold on an order-preserving integer key of each float32 logit,
digit by digit (a radix search: a few passes over the row, each counting or weighing the tokens at or above 16
or 4 candidate thresholds), instead of sorting the vocabulary.
"""

from __future__ import annotations

import blutensor as bt
import numpy as np

#: bits decided per pass of the threshold searches (top-k: counts, 15 candidates a pass; top-p: probability
#: masses in float64, 3 candidates a pass), fewer where the (candidates, rows, vocab) temporary of a pass would
#: exceed SEARCH_TEMP_BYTES (large batches: more, smaller passes)
TOP_K_BITS = 4
TOP_P_BITS = 2
SEARCH_TEMP_BYTES = 64 << 20


def _search_bits(rows: int, vocab: int, itemsize: int, bits: int) -> int:
    while bits > 1 and ((1 << bits) - 1) * rows * vocab * itemsize > SEARCH_TEMP_BYTES:
        bits //= 2
    return bits


def order_keys(z):
    """int64 keys in [0, 2^32) ordered as the float32 values of ``z`` (-0.0 counted as +0.0): x < y iff
    key(x) < key(y), equal values equal keys."""
    xp = bt.ext.array_module(z)
    bits = xp.ascontiguousarray(z.astype(np.float32) + np.float32(0.0)).view(np.int32).astype(np.int64)
    bits = bits & 0xFFFFFFFF
    return xp.where(bits >= 2**31, 2**32 - 1 - bits, bits + 2**31)


def _largest_key_above(key, weight, target, bits: int):
    """Per row, the largest t in [0, 2^32) with S(t) = sum of ``weight`` over the tokens with key >= t greater
    than ``target`` (``weight`` None: S counts the tokens). S falls as t grows, so t is built from the top digit
    down: each pass keeps the largest digit whose candidate threshold still has S > target. Returns int64 (B,)."""
    xp = bt.ext.array_module(key)
    B = key.shape[0]
    n = (1 << bits) - 1
    digits = xp.arange(1, n + 1, dtype=np.int64)
    t = xp.zeros(B, dtype=np.int64)
    for shift in range(32 - bits, -1, -bits):
        cand = t[None, :] | (digits[:, None] << shift)  # (n, B): the next digit 1..n under the fixed prefix
        above = key[None, :, :] >= cand[:, :, None]  # (n, B, V): the sums run over the contiguous last axis
        if weight is None:
            s = above.sum(axis=2)
        else:
            s = xp.where(above, weight[None, :, :], 0.0).sum(axis=2)
        d = (s > target).sum(axis=0)  # S falls with the digit: the ones that pass are 1..d
        t = t | (d.astype(np.int64) << shift)
    return t


def sample_next(z, u, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None):
    """Next tokens (B,) int64 drawn from logits ``z`` (B, V) with uniforms ``u`` (B,) float64 in [0, 1): arrays
    of one device (NumPy or CuPy), no host read.

    logits / temperature, then top-k (the tokens at or above the k-th largest logit: ties with it stay), then top-p
    (the tokens whose more likely tokens hold at most ``top_p`` of the mass: the nucleus; tokens tied with its
    last one stay), then one draw by the inverse of the cumulative distribution (float64) in vocabulary order.
    ``top_k=1`` is the argmax (the first of equal maxima), no draw. :func:`blumodels.generate.filter_logits` is
    the float64 NumPy statement of the same filter."""
    if getattr(z, "ndim", None) != 2 or getattr(z, "dtype", np.dtype(object)).kind != "f":
        raise ValueError(f"sample_next: z must be a (batch, vocab) float array, got "
                         f"{getattr(z, 'shape', type(z).__name__)} {getattr(z, 'dtype', '')}")
    if tuple(getattr(u, "shape", ())) != (z.shape[0],):
        raise ValueError(f"sample_next: u must hold one uniform per row, shape ({z.shape[0]},), got "
                         f"{getattr(u, 'shape', type(u).__name__)}")
    xp = bt.ext.array_module(z)
    B, V = z.shape
    if top_k == 1:
        return xp.argmax(z, axis=1).astype(np.int64)
    zz = z.astype(np.float64) / temperature
    key = None
    if top_k is not None and 0 < top_k < V:
        key = order_keys(z)
        kth = _largest_key_above(key, None, top_k - 1, _search_bits(B, V, 1, TOP_K_BITS))  # the k-th largest
        zz = xp.where(key >= kth[:, None], zz, -np.inf)
    e = xp.exp(zz - zz.max(axis=1, keepdims=True))  # the filtered-out tokens: 0
    if top_p is not None and top_p < 1.0:
        key = order_keys(z) if key is None else key
        p = e / e.sum(axis=1, keepdims=True)
        last = _largest_key_above(key, p, top_p, _search_bits(B, V, 8, TOP_P_BITS))  # the nucleus's last key
        e = xp.where(key >= last[:, None], e, 0.0)
    cdf = xp.cumsum(e, axis=1)
    x = (1.0 - u) * cdf[:, -1]  # in (0, total]: the first token whose cumulative mass reaches x has mass > 0
    return (cdf < x[:, None]).sum(axis=1).astype(np.int64)


def generate(model, idx: list[int] | np.ndarray, max_new_tokens: int, top_k: int | None = 40,
             temperature: float = 1.0, seed: int = 0, vocab_size: int | None = None,
             device: str | bt.device | None = None, stop_token: int | None = None, top_p: float | None = None,
             use_cache: bool = True, cuda_graph: bool | str = "auto") -> list[int]:
    """Append ``max_new_tokens`` tokens to the prompt ``idx`` (top-k, then top-p, sampling); returns all tokens.

    Runs with the key/value cache of ``blumodels.generate`` (``use_cache=False``: the whole context every step).
    Padded vocabulary rows (>= ``vocab_size``) are never sampled. The context is cropped to the model's block
    size. Sampling draws from ``bt.Generator(seed)``: reproducible, and it leaves the default generator
    (dropout, init) as it was. ``cuda_graph``: the decode step in a CUDA graph (see ``generate_batch``).
    Batched prompts: ``blumodels.generate.generate_batch``.
    """
    from blumodels.generate import generate_batch

    return generate_batch(model, [idx], max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                          seed=seed, vocab_size=vocab_size, stop_token=stop_token, use_cache=use_cache,
                          device=device, cuda_graph=cuda_graph)[0]


def sample_text(model, tokenizer, prompt: str = "\n", max_new_tokens: int = 200, top_k: int | None = 40,
                temperature: float = 1.0, seed: int = 0, top_p: float | None = None,
                cuda_graph: bool | str = "auto") -> str:
    """Encode ``prompt``, sample, and decode the continuation (prompt included)."""
    ids = tokenizer.encode(prompt) or [tokenizer.eot_token]
    out = generate(model, ids, max_new_tokens, top_k=top_k, temperature=temperature, seed=seed,
                   vocab_size=tokenizer.vocab_size, top_p=top_p, cuda_graph=cuda_graph)
    return tokenizer.decode(out)
