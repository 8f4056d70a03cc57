"""Text sampling from a trained model (any family) with its own Philox generator so training's RNG stream is
untouched; the token loop with its key/value cache is ``blumodels.generate``."""

from __future__ import annotations

import blutensor as bt
import numpy as np


def generate(model, idx: list[int] | np.ndarray, max_new_tokens: int, top_k: int | None = 40,
             temperature: float = 1.0, seed: int = 0, vocab_size: int | None = None,
             device: str | bt.device | None = None, stop_token: int | None = None, top_p: float | None = None,
             use_cache: bool = True) -> list[int]:
    """Append ``max_new_tokens`` tokens to the prompt ``idx`` (top-k, then top-p, sampling); returns all tokens.

    Runs with the key/value cache of ``blumodels.generate`` (``use_cache=False``: the whole context every step).
    Padded vocabulary rows (>= ``vocab_size``) are never sampled. The context is cropped to the model's block
    size. Sampling draws from ``bt.Generator(seed)``: reproducible, and it leaves the default generator
    (dropout, init) as it was. Batched prompts: ``blumodels.generate.generate_batch``.
    """
    from blumodels.generate import generate_batch

    return generate_batch(model, [idx], max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                          seed=seed, vocab_size=vocab_size, stop_token=stop_token, use_cache=use_cache,
                          device=device)[0]


def sample_text(model, tokenizer, prompt: str = "\n", max_new_tokens: int = 200, top_k: int | None = 40,
                temperature: float = 1.0, seed: int = 0, top_p: float | None = None) -> str:
    """Encode ``prompt``, sample, and decode the continuation (prompt included)."""
    ids = tokenizer.encode(prompt) or [tokenizer.eot_token]
    out = generate(model, ids, max_new_tokens, top_k=top_k, temperature=temperature, seed=seed,
                   vocab_size=tokenizer.vocab_size, top_p=top_p)
    return tokenizer.decode(out)
