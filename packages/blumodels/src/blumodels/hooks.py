"""blumodels' plugin registrations: the GPT-2 model family (kind "model")."""

from __future__ import annotations

from typing import Any

import pluggy

hookimpl = pluggy.HookimplMarker("blutrain")


class GPT2Family:
    """The GPT-2 family: its presets (shipped TOML files) and a builder from a ModelConfig."""

    PLUGIN_NAME = "gpt2"

    @staticmethod
    def presets() -> list[str]:
        from blumodels.config import preset_names

        return preset_names()

    @staticmethod
    def build(config: Any, device: Any = None, seed: int | None = None) -> Any:
        """A GPT2 from a ModelConfig (or a RunConfig, whose .model is used, or a dict of model.* keys)."""
        from blumodels.config import ConfigError, ModelConfig, model_config
        from blumodels.gpt2 import build_model

        cfg = getattr(config, "model", config)
        if isinstance(cfg, dict):  # checked like a [model] table: unknown keys and wrong types name the key
            cfg = model_config(cfg, origin="GPT2Family.build")
        if not isinstance(cfg, ModelConfig):
            raise ConfigError(f"GPT2Family.build: expected a ModelConfig, RunConfig or dict of model keys, got "
                              f"{type(config).__name__}")
        return build_model(cfg, device=device, seed=seed)


@hookimpl
def blutrain_register_model_families():
    return [GPT2Family]
