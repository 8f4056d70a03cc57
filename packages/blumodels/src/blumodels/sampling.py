"""Top-k sampling from a GPT-2, with its own Philox generator so training's RNG stream is untouched."""

from __future__ import annotations

import blutensor as bt
import numpy as np


def _to_numpy(t: bt.Tensor) -> np.ndarray:
    return t.detach().to("cpu").numpy()


def generate(model, idx: list[int] | np.ndarray, max_new_tokens: int, top_k: int | None = 40,
             temperature: float = 1.0, seed: int = 0, vocab_size: int | None = None,
             device: str | bt.device | None = None, stop_token: int | None = None) -> list[int]:
    """Append ``max_new_tokens`` tokens to the prompt ``idx`` by top-k sampling; returns all tokens.

    Padded vocabulary rows (>= ``vocab_size``) are never sampled. The context is cropped to the
    model's block size. Sampling draws from ``bt.Generator(seed)``: reproducible, and it leaves the
    default generator (dropout, init) as it was.
    """
    if temperature <= 0:
        raise ValueError(f"generate: temperature must be positive, got {temperature}")
    cfg = model.config
    V = vocab_size or cfg.vocab_size
    tokens = [int(t) for t in np.asarray(idx).reshape(-1)]
    if not tokens:
        raise ValueError("generate: the prompt must hold at least one token")
    if device is None:
        device = next(iter(model.parameters())).device
    gen = bt.Generator(seed)
    was_training = model.training
    model.eval()
    try:
        with bt.no_grad():
            for _ in range(max_new_tokens):
                ctx = tokens[-cfg.block_size:]
                x = bt.tensor(np.asarray([ctx], dtype=np.int64), dtype=bt.int64, device=device)
                logits, _ = model(x)
                z = _to_numpy(logits)[0, -1, :V].astype(np.float64) / temperature
                if top_k is not None and 0 < top_k < V:
                    kth = np.partition(z, -top_k)[-top_k]
                    z = np.where(z < kth, -np.inf, z)
                p = np.exp(z - z.max())
                p /= p.sum()
                u = float(gen.uniform((1,), np, np.float64)[0])
                nxt = int(min(np.searchsorted(np.cumsum(p), u, side="right"), V - 1))
                tokens.append(nxt)
                if stop_token is not None and nxt == stop_token:
                    break
    finally:
        model.train(was_training)
    return tokens


def sample_text(model, tokenizer, prompt: str = "\n", max_new_tokens: int = 200, top_k: int | None = 40,
                temperature: float = 1.0, seed: int = 0) -> str:
    """Encode ``prompt``, sample, and decode the continuation (prompt included)."""
    ids = tokenizer.encode(prompt) or [tokenizer.eot_token]
    out = generate(model, ids, max_new_tokens, top_k=top_k, temperature=temperature, seed=seed,
                   vocab_size=tokenizer.vocab_size)
    return tokenizer.decode(out)
