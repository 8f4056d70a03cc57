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
        """A GPT2 from a ModelConfig (or a RunConfig, whose .model is used)."""
        from blumodels.gpt2 import build_model

        return build_model(getattr(config, "model", config), device=device, seed=seed)


@hookimpl
def blutrain_register_model_families():
    return [GPT2Family]
