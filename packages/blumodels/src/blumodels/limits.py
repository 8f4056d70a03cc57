"""Resource bounds checked before a run builds anything: a model (with its gradients, AdamW state and one
micro-batch of activations) that cannot fit in this host's memory is a ConfigError naming the sizes, not a NumPy
MemoryError (or the kernel's OOM killer) minutes later. CPU only: a GPU's memory is checked by its allocator."""

from __future__ import annotations

import os

from blumodels.config import ConfigError, RunConfig


def host_memory_bytes() -> int | None:
    """Physical memory of this host (None where unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def estimate_bytes(cfg: RunConfig) -> int:
    """A lower estimate of a training step's memory: fp32 weights, gradients and two AdamW moments (16 bytes per
    parameter) plus one micro-batch's activations (about 34 floats per token, layer and channel) and logits."""
    import dataclasses

    from blumodels.gpt2 import count_params

    m, t = cfg.model, cfg.train
    if not m.vocab_size:  # taken from the data later: the data config's vocabulary until then
        m = dataclasses.replace(m, vocab_size=cfg.data.vocab_size)
    params = count_params(m)
    tokens = t.micro_batch * t.seq_len
    acts = tokens * (m.n_layer * m.d_model * 34 + 2 * m.padded_vocab_size) * 4
    return 16 * params + acts


def check_fits(cfg: RunConfig, device: str) -> None:
    """ConfigError when the run cannot fit in this host's memory (CPU devices)."""
    if not device.startswith("cpu"):
        return
    have = host_memory_bytes()
    need = estimate_bytes(cfg)
    if have is not None and need > have:
        m, t = cfg.model, cfg.train
        raise ConfigError(f"this run needs at least {need / 2**30:.1f} GiB (model.n_layer={m.n_layer}, "
                          f"model.d_model={m.d_model}, model.block_size={m.block_size}, vocab {m.padded_vocab_size}, "
                          f"train.micro_batch={t.micro_batch}, train.seq_len={t.seq_len}) but this host has "
                          f"{have / 2**30:.1f} GiB: make the model or the micro-batch smaller")
