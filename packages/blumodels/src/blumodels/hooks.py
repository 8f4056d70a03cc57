"""blumodels' plugin registrations: the GPT-2 and llama model families (kind "model")."""

from __future__ import annotations

from typing import Any

import pluggy

hookimpl = pluggy.HookimplMarker("blutrain")


#: ModelConfig keys only the llama family reads
LLAMA_KEYS = ("n_kv_heads", "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor",
              "rope_high_freq_factor", "rope_original_max_len", "ffn_hidden", "ffn_dim_multiple", "ffn_dim_multiplier")


class GPT2Family:
    """The GPT-2 family: its presets (shipped TOML files) and a builder from a ModelConfig."""

    PLUGIN_NAME = "gpt2"

    @staticmethod
    def presets() -> list[str]:
        from blumodels.config import preset_names

        return preset_names(family="gpt2")

    @staticmethod
    def check_config(cfg: Any) -> None:
        """GPT-2 reads none of the llama keys: one changed from its default is refused by name, not ignored."""
        from dataclasses import fields

        from blumodels.config import ConfigError, ModelConfig

        if not cfg.tie_embeddings:
            raise ConfigError("model.tie_embeddings = false: GPT-2 always ties lm_head to the token embedding")
        base = ModelConfig()
        for f in fields(ModelConfig):
            if f.name in LLAMA_KEYS and getattr(cfg, f.name) != getattr(base, f.name):
                raise ConfigError(f"model.{f.name} is read by the llama family only (model.family = 'gpt2'); "
                                  f"remove it or set model.family = 'llama'")

    @staticmethod
    def count_params(cfg: Any) -> int:
        from blumodels.gpt2 import count_params

        return count_params(cfg)

    @staticmethod
    def parallel_plan(model: Any) -> Any:
        """The ``dtms.parallel.ParallelPlan`` the Trainer applies for a ``[parallel]`` layout (FSDP, TP, CP)."""
        from blumodels.gpt2_parallelize import gpt2_plan

        return gpt2_plan(model)

    @staticmethod
    def parallel_shapes(cfg: Any) -> dict[str, int]:
        """Sizes tensor parallelism divides, by the words a config error names them with."""
        return {"model.n_head": cfg.n_head, "the MLP width 4*model.d_model": 4 * cfg.d_model}

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
    from blumodels.llama.family import LlamaFamily

    return [GPT2Family, LlamaFamily]
