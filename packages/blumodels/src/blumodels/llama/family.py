"""The llama model family's plugin class (kind "model"): registered by blumodels' ``blutrain`` entry point
(``blumodels.hooks``) through the same hook a third-party family implements; nothing in the Trainer or the CLI
names it."""

from __future__ import annotations

from typing import Any


class LlamaFamily:
    """Llama-style decoders: presets llama-tiny, llama-125m, llama-1b, llama3-8b and a builder."""

    PLUGIN_NAME = "llama"

    @staticmethod
    def presets() -> list[str]:
        from blumodels.config import preset_names

        return preset_names(family="llama")

    @staticmethod
    def check_config(cfg: Any) -> None:
        from blumodels.llama.model import check_config

        check_config(cfg)

    @staticmethod
    def count_params(cfg: Any) -> int:
        from blumodels.llama.model import count_params

        return count_params(cfg)

    @staticmethod
    def parallel_plan(model: Any) -> Any:
        """The ``dtms.parallel.ParallelPlan`` the Trainer applies for a ``[parallel]`` layout (FSDP, TP, CP)."""
        from blumodels.llama.parallelize import llama_plan

        return llama_plan(model)

    @staticmethod
    def parallel_shapes(cfg: Any) -> dict[str, int]:
        """Sizes tensor parallelism divides, by the words a config error names them with."""
        from blumodels.llama.model import ffn_hidden, kv_heads

        return {"model.n_head": cfg.n_head, "the key/value heads (model.n_kv_heads)": kv_heads(cfg),
                "the SwiGLU width (model.ffn_hidden)": ffn_hidden(cfg)}

    @staticmethod
    def weight_keys(cfg: Any) -> dict[str, Any]:
        """The llama keys that define its weights and numerics, with the values the model uses (n_kv_heads = 0 and
        ffn_hidden = 0 resolved; the llama3 RoPE factors only where model.rope_scaling = "llama3" reads them)."""
        from blumodels.llama.model import ffn_hidden, kv_heads

        keys = {"n_kv_heads": kv_heads(cfg), "ffn_hidden": ffn_hidden(cfg), "tie_embeddings": cfg.tie_embeddings,
                "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling}
        if cfg.rope_scaling == "llama3":
            keys.update({k: getattr(cfg, k) for k in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                                                      "rope_original_max_len")})
        return keys

    @staticmethod
    def build(config: Any, device: Any = None, seed: int | None = None) -> Any:
        """A Llama from a ModelConfig (or a RunConfig, whose .model is used, or a dict of model.* keys)."""
        from blumodels.config import ConfigError, ModelConfig, model_config
        from blumodels.llama.model import build_model

        cfg = getattr(config, "model", config)
        if isinstance(cfg, dict):
            cfg = model_config({"family": "llama", **cfg}, origin="LlamaFamily.build")
        if not isinstance(cfg, ModelConfig):
            raise ConfigError(f"LlamaFamily.build: expected a ModelConfig, RunConfig or dict of model keys, got "
                              f"{type(config).__name__}")
        return build_model(cfg, device=device, seed=seed)
