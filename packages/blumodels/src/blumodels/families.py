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
