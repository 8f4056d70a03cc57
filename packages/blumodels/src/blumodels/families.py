"""Model families by name (``model.family``): the plugins of kind "model" that blumodels and third-party packages
register, and the builders the Trainer and the CLI use, so no family is special-cased anywhere."""

from __future__ import annotations

from typing import Any

from blumodels.config import ConfigError, ModelConfig


def family(name: str) -> type:
    """The registered model-family class named ``name``; ConfigError listing the installed ones otherwise."""
    from blumodels.config import model_registry

    reg = model_registry()
    if name not in reg:
        raise ConfigError(f"model.family={name!r} is not an installed model family ({', '.join(reg.names())})")
    return reg.get(name)


def build_model(cfg: ModelConfig, device: Any = None, seed: int | None = None) -> Any:
    """A freshly initialised model of ``cfg.family`` on ``device`` (the family's ``build``)."""
    return family(cfg.family).build(cfg, device=device, seed=seed)


def count_params(cfg: ModelConfig) -> int:
    """Parameters of a model of this config without building it (the family's ``count_params``)."""
    fn = getattr(family(cfg.family), "count_params", None)
    if fn is None:
        raise ConfigError(f"model family {cfg.family!r} cannot count its parameters without building the model")
    return int(fn(cfg))


#: model.* keys every family's weights and numerics depend on (a family's ``weight_keys(cfg)`` adds its own)
SHARED_WEIGHT_KEYS = ("family", "n_layer", "n_head", "d_model", "block_size", "vocab_size", "bias", "ln_eps")


def weight_keys(cfg: ModelConfig) -> dict[str, Any]:
    """The model.* keys that define a model's weights and numerics, each with the value the model uses.

    The shared keys (:data:`SHARED_WEIGHT_KEYS`) and those the family declares through its optional
    ``weight_keys(cfg) -> dict`` (llama: ``n_kv_heads`` and ``ffn_hidden`` resolved from their 0 defaults,
    ``tie_embeddings``, the RoPE keys); two configs with equal values build interchangeable models.
    """
    out = {k: getattr(cfg, k) for k in SHARED_WEIGHT_KEYS}
    own = getattr(family(cfg.family), "weight_keys", None)
    if own is not None:
        out.update(own(cfg))
    return out
