"""Hugging Face interop of the llama family: ``to_hf(model)`` and ``from_hf(state, config)``.

Parameter names are ``LlamaForCausalLM``'s: ours prefixed with ``model.`` (``lm_head.weight`` as it is; absent when
the embeddings are tied). The vocabulary is cut to ``model.vocab_size`` on export (the padded rows are never
targeted) and padded with zero rows on import. RoPE needs no permutation: both use the rotate-half layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import blutensor as bt
import numpy as np

from blumodels.config import ConfigError, ModelConfig

ARCHITECTURE = "LlamaForCausalLM"


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` of ``LlamaForCausalLM`` for a llama ModelConfig (transformers 4 and 5 read it)."""
    from blumodels.llama.model import ffn_hidden, kv_heads

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
                "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_len}
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": ffn_hidden(cfg), "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": kv_heads(cfg), "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.block_size, "rms_norm_eps": cfg.ln_eps, "hidden_act": "silu",
        "rope_theta": cfg.rope_theta, "rope_scaling": None if cfg.rope_scaling == "none" else
        {k: v for k, v in rope.items() if k != "rope_theta"}, "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.bias, "mlp_bias": cfg.bias,
        "initializer_range": cfg.init_std, "torch_dtype": "float32",
    }


def to_hf(model, padded_vocab: bool = False) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(state dict with LlamaForCausalLM names as float32 NumPy arrays, its config.json dict) of a Llama.

    The embedding (and an untied lm_head) are cut to ``model.vocab_size`` rows. ``padded_vocab=True`` keeps the
    rows up to the padded size (``model.vocab_multiple``) and says so in the config: a Hugging Face model whose
    softmax runs over the same columns as BluTrain's, for training the two side by side from the same weights.
    """
    cfg = model.config
    V = cfg.padded_vocab_size if padded_vocab else cfg.vocab_size
    state = {}
    for name, p in model.state_dict().items():
        a = p.detach().to("cpu").to(bt.float32).numpy()
        if name in ("embed_tokens.weight", "lm_head.weight"):
            a = a[:V]
        state[name if name.startswith("lm_head.") else f"model.{name}"] = np.ascontiguousarray(a)
    config = hf_config(cfg)
    config["vocab_size"] = V
    return state, config


def model_config(config: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """A llama ModelConfig from a Hugging Face Llama ``config.json`` dict (``overrides``: other model.* keys)."""
    arch = list(config.get("architectures") or [ARCHITECTURE])
    if config.get("model_type", "llama") != "llama" or ARCHITECTURE not in arch:
        raise ConfigError(f"from_hf: expected a {ARCHITECTURE} config (model_type 'llama'), got model_type "
                          f"{config.get('model_type')!r}, architectures {arch}")
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"from_hf: hidden_act={config['hidden_act']!r}; the llama family's MLP is SwiGLU (silu)")
    try:
        d, H = int(config["hidden_size"]), int(config["num_attention_heads"])
        kw: dict[str, Any] = dict(
            family="llama", n_layer=int(config["num_hidden_layers"]), n_head=H, d_model=d,
            n_kv_heads=int(config.get("num_key_value_heads") or H), vocab_size=int(config["vocab_size"]),
            block_size=int(config.get("max_position_embeddings", 2048)), ffn_hidden=int(config["intermediate_size"]),
            ln_eps=float(config.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(config.get("tie_word_embeddings")),
            bias=bool(config.get("attention_bias", False)), init_std=float(config.get("initializer_range", 0.02)))
    except KeyError as e:
        raise ConfigError(f"from_hf: the config has no {e.args[0]!r}") from None
    if config.get("head_dim") not in (None, d // H):
        raise ConfigError(f"from_hf: head_dim={config['head_dim']} != hidden_size/num_attention_heads = {d // H}")
    if bool(config.get("mlp_bias", kw["bias"])) != kw["bias"]:
        raise ConfigError("from_hf: attention_bias and mlp_bias differ; the llama family has one model.bias")
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    kw["rope_theta"] = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "llama3":
        kw.update(rope_scaling="llama3", rope_factor=float(rope["factor"]),
                  rope_low_freq_factor=float(rope["low_freq_factor"]),
                  rope_high_freq_factor=float(rope["high_freq_factor"]),
                  rope_original_max_len=int(rope["original_max_position_embeddings"]))
    elif kind != "default":
        raise ConfigError(f"from_hf: rope type {kind!r} is not supported (the llama family has 'default' and "
                          "'llama3')")
    kw.update(overrides)
    return ModelConfig(**kw).check()


def _array(a: Any) -> np.ndarray:
    """A float32 NumPy copy of a NumPy array, a blutensor Tensor or a torch tensor (any float dtype)."""
    if isinstance(a, bt.Tensor):
        return a.detach().to("cpu").to(bt.float32).numpy()
    if hasattr(a, "detach"):  # torch
        return a.detach().float().cpu().numpy()
    return np.asarray(a, dtype=np.float32)


def from_hf(state: Mapping[str, Any], config: Mapping[str, Any], device: Any = None, **overrides: Any):
    """A Llama holding the weights of a ``LlamaForCausalLM`` state dict (arrays or tensors, HF names)."""
    from blumodels.llama.model import Llama

    cfg = model_config(config, **overrides)
    model = Llama(cfg, device="cpu")
    own = model.state_dict()
    ours = {}
    for hf_name, a in state.items():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer older transformers saved: recomputed from the config here
        name = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
        if name == "lm_head.weight" and cfg.tie_embeddings:
            tied = state.get("model.embed_tokens.weight")
            if tied is not None and np.array_equal(_array(a), _array(tied)):
                continue  # a state dict of a tied model lists the shared matrix under both names
        if name not in own:
            raise ConfigError(f"from_hf: {hf_name!r} has no place in a llama of this config (tie_embeddings="
                              f"{cfg.tie_embeddings})")
        arr = _array(a)
        if name in ("embed_tokens.weight", "lm_head.weight") and arr.shape[0] < own[name].shape[0]:
            arr = np.concatenate([arr, np.zeros((own[name].shape[0] - arr.shape[0], arr.shape[1]), np.float32)])
        ours[name] = arr
    missing = [k for k in own if k not in ours]
    if missing:
        raise ConfigError(f"from_hf: the state dict lacks {len(missing)} weight(s) of this config, e.g. "
                          f"{', '.join('model.' + k if not k.startswith('lm_head') else k for k in missing[:3])}")
    model.load_state_dict(ours)
    return model.to(device) if device is not None and str(device) != "cpu" else model
