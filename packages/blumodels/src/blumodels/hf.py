"""Hugging Face ``transformers`` weights: export a BluTrain model to, and start one from, a local HF directory.

A directory holds ``config.json`` and ``model.safetensors`` (or shards listed in ``model.safetensors.index.json``),
the layout ``transformers``' ``from_pretrained`` reads and ``save_pretrained`` writes. Nothing is downloaded: the
directory must already be on this machine.

The mapping is a registry keyed by ``model.family`` so that each family plugs in with one function pair
(:func:`register_hf`): ``to_hf(model) -> (tensors, config)`` and ``from_hf(config, tensors) -> (ModelConfig,
params)``. GPT-2 is registered here: rename, transpose the four Conv1D weights, crop the padded vocabulary rows on
export (zero rows on import) and tie ``lm_head`` to ``wte``.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from blumodels.config import ConfigError, ModelConfig, RunConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class HFError(ValueError):
    """A Hugging Face directory is missing, malformed, or does not fit the model; names the file or key."""


@dataclass(frozen=True)
class HFMapping:
    """How one model family maps to a ``transformers`` architecture."""

    family: str
    model_types: tuple[str, ...]  # config.json "model_type" values this mapping reads
    to_hf: Callable[[Any], tuple[dict[str, np.ndarray], dict[str, Any]]]
    from_hf: Callable[[dict[str, Any], dict[str, np.ndarray]], tuple[ModelConfig, dict[str, np.ndarray]]]
    config_from_hf: Callable[[dict[str, Any]], ModelConfig]


_REGISTRY: dict[str, HFMapping] = {}


def register_hf(family: str, to_hf: Callable, from_hf: Callable, config_from_hf: Callable,
                model_types: tuple[str, ...] | None = None) -> None:
    """Register (or replace) the Hugging Face mapping of ``family`` (``model.family``).

    ``config_from_hf(hf_config) -> ModelConfig`` reads only config.json, so a mismatch is found before weights
    are read; ``from_hf(hf_config, tensors)`` returns the ModelConfig and BluTrain parameter arrays by name.
    """
    _REGISTRY[family] = HFMapping(family, tuple(model_types or (family,)), to_hf, from_hf, config_from_hf)


def hf_families() -> list[str]:
    """Families with a Hugging Face mapping."""
    return sorted(_REGISTRY)


def _mapping_for_family(family: str) -> HFMapping:
    if family not in _REGISTRY:
        raise HFError(f"model.family={family!r} has no Hugging Face mapping (known: {', '.join(hf_families())})")
    return _REGISTRY[family]


def _mapping_for_type(model_type: Any, where: Path) -> HFMapping:
    for m in _REGISTRY.values():
        if model_type in m.model_types:
            return m
    known = sorted(t for m in _REGISTRY.values() for t in m.model_types)
    raise HFError(f"{where}: model_type {model_type!r} has no BluTrain mapping (known: {', '.join(known)})")


# ---------------------------------------------------------------- directory I/O
def read_hf_config(directory: str | os.PathLike) -> dict[str, Any]:
    """config.json of a Hugging Face model directory (HFError naming the file when missing or malformed)."""
    d = Path(directory)
    if not d.is_dir():
        raise HFError(f"{d} is not a directory (a Hugging Face model directory holds {CONFIG_FILE} and "
                      f"{WEIGHTS_FILE}; nothing is downloaded)")
    p = d / CONFIG_FILE
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise HFError(f"{p} not found: {d} is not a Hugging Face model directory") from None
    except (ValueError, OSError) as e:
        raise HFError(f"{p} is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise HFError(f"{p} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": None}


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """float32 arrays of a safetensors file (F32, F16, F64 and BF16 read; other dtypes named as unsupported).

    The header is validated as strictly as the ``safetensors`` reader (blumodels.checkpoint.format.check_index:
    exact entries, known dtypes, sane shapes, contiguous in-bounds offsets, bounded depth and size) and the payload
    is read, never memory-mapped, so a file cut short while it loads is an HFError, not a SIGBUS."""
    from blumodels.checkpoint.format import MAX_HEADER_BYTES, MAX_HEADER_DEPTH, CheckpointError, _depth, check_index

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise HFError(f"{path}: not a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, MAX_HEADER_BYTES):
                raise HFError(f"{path}: not a safetensors file (header length {n} at offset 0 exceeds the file "
                              f"or {MAX_HEADER_BYTES} bytes)")
            try:
                index = json.loads(f.read(n))
                deep = _depth(index) > MAX_HEADER_DEPTH
            except (ValueError, RecursionError):
                raise HFError(f"{path}: safetensors header at offset 8 is not JSON of at most {MAX_HEADER_DEPTH} "
                              "levels") from None
            if not isinstance(index, dict) or deep:
                raise HFError(f"{path}: safetensors header at offset 8 is not a JSON object of at most "
                              f"{MAX_HEADER_DEPTH} levels")
            index.pop("__metadata__", None)
            payload = size - 8 - n
            try:
                entries = check_index(path, index, payload)
            except CheckpointError as e:
                raise HFError(str(e)) from None
            raw = np.empty(payload, np.uint8)
            if f.readinto(memoryview(raw)) != payload:
                raise HFError(f"{path}: changed while being read (fewer than {payload} payload bytes after offset "
                              f"{8 + n})")
    except FileNotFoundError:
        raise HFError(f"{path} not found") from None
    out = {}
    for name, dt, shape, a in entries:
        st = index[name]["dtype"]
        if st not in _ST_DTYPES:
            raise HFError(f"{path}: tensor {name!r} has dtype {st}; only floating-point weights are read")
        buf = raw[a:a + math.prod(shape) * dt.itemsize]
        if st == "BF16":
            arr = (buf.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = buf.view(_ST_DTYPES[st])
        out[name] = arr.reshape(shape).astype(np.float32)
    return out


def read_hf_weights(directory: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of ``model.safetensors`` (or of the shards its index lists) as float32 arrays."""
    d = Path(directory)
    if (d / WEIGHTS_FILE).is_file():
        return _read_safetensors(d / WEIGHTS_FILE)
    if (d / INDEX_FILE).is_file():
        try:
            files = sorted(set(json.loads((d / INDEX_FILE).read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise HFError(f"{d / INDEX_FILE}: no readable weight_map ({type(e).__name__}: {e})") from None
        out: dict[str, np.ndarray] = {}
        for f in files:
            out.update(_read_safetensors(d / f))
        return out
    found = sorted(p.name for p in d.iterdir()) if d.is_dir() else []
    hint = " (PyTorch .bin weights: re-save them with save_pretrained(dir, safe_serialization=True))" \
        if any(n.endswith(".bin") for n in found) else ""
    raise HFError(f"{d}: no {WEIGHTS_FILE} or {INDEX_FILE}{hint}")


def hf_model_config(directory: str | os.PathLike) -> ModelConfig:
    """The BluTrain ModelConfig a Hugging Face directory describes (config.json only: no weights read)."""
    d = Path(directory)
    hf_cfg = read_hf_config(d)
    return _mapping_for_type(hf_cfg.get("model_type"), d / CONFIG_FILE).config_from_hf(hf_cfg)


def load_hf(directory: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(ModelConfig, BluTrain parameter arrays by name) of a local Hugging Face model directory."""
    d = Path(directory)
    hf_cfg = read_hf_config(d)
    mapping = _mapping_for_type(hf_cfg.get("model_type"), d / CONFIG_FILE)
    mapping.config_from_hf(hf_cfg)  # config errors before the weights are read
    return mapping.from_hf(hf_cfg, read_hf_weights(d))


def export_hf(model: Any, directory: str | os.PathLike, tokenizer_dir: str | os.PathLike | None = None) -> Path:
    """Write ``model`` as a weights-only Hugging Face directory (model.safetensors + config.json).

    ``tokenizer_dir``: a prepared data directory; its tokenizer is copied in the files ``transformers``'
    tokenizers read (GPT-2's vocab.json + merges.txt, or a trained BPE's tokenizer.json).
    """
    from safetensors.numpy import save_file

    mapping = _mapping_for_family(model.config.family)
    tensors, hf_cfg = mapping.to_hf(model)
    eot = _tokenizer_eot(Path(tokenizer_dir)) if tokenizer_dir is not None else None
    if eot is not None and "eos_token_id" in hf_cfg:  # the data's end-of-text id (a trained BPE's is not V-1)
        hf_cfg["bos_token_id"] = hf_cfg["eos_token_id"] = eot
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{WEIGHTS_FILE}.tmp"
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}, str(tmp),
              metadata={"format": "pt"})
    os.replace(tmp, d / WEIGHTS_FILE)
    (d / CONFIG_FILE).write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
    if tokenizer_dir is not None:
        _copy_tokenizer(Path(tokenizer_dir), d, hf_cfg)
    return d


def _tokenizer_eot(src: Path) -> int | None:
    try:
        eot = json.loads((src / "tokenizer_meta.json").read_text()).get("eot_token")
    except (OSError, ValueError, AttributeError):
        return None
    return eot if isinstance(eot, int) and not isinstance(eot, bool) else None


def _copy_tokenizer(src: Path, dst: Path, hf_cfg: dict[str, Any]) -> None:
    import shutil

    if (src / "vocab.bpe").is_file() and (src / "encoder.json").is_file():
        shutil.copyfile(src / "encoder.json", dst / "vocab.json")
        shutil.copyfile(src / "vocab.bpe", dst / "merges.txt")
        tok_cfg = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": hf_cfg.get("n_positions", 1024),
                   "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
    elif (src / "tokenizer.json").is_file():
        shutil.copyfile(src / "tokenizer.json", dst / "tokenizer.json")
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                   "bos_token": "<|endoftext|>", "model_max_length": hf_cfg.get("n_positions", 1024)}
    else:
        return
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")


# ---------------------------------------------------------------- --init-from checks
def check_init_from(directory: str | os.PathLike, cfg: RunConfig) -> ModelConfig:
    """ConfigError naming every model.* key where ``directory``'s config differs from ``cfg`` (before any work).

    The keys are those that define the family's weights and numerics (:func:`blumodels.families.weight_keys`: the
    shared shape and, for llama, ``n_kv_heads``, ``ffn_hidden``, ``tie_embeddings``, ``rope_theta``,
    ``rope_scaling`` and its factors), compared at the values the model uses. ``model.vocab_size = 0`` (from the
    data) is checked later by :func:`check_init_vocab`.
    """
    from blumodels.families import weight_keys

    d = Path(directory)
    try:
        hf = hf_model_config(d)
    except HFError as e:
        raise ConfigError(f"train.init_from: {e}") from None
    m = cfg.model
    ours, theirs = weight_keys(m), weight_keys(hf)
    if not m.vocab_size:
        ours.pop("vocab_size")

    def shown(k: str) -> str:  # the config's own value, and what it resolves to when that differs (0 = derived)
        raw = getattr(m, k, ours[k])
        return f"{raw!r}" if raw == ours[k] else f"{raw!r} (= {ours[k]!r})"

    diff = [f"model.{k}={shown(k)} but {d} has {theirs[k]!r}" for k in ours if k in theirs and ours[k] != theirs[k]]
    if diff:
        raise ConfigError(f"train.init_from={str(d)!r} does not fit the model: {'; '.join(diff)} (set those "
                          "model.* keys to the directory's values)")
    return hf


def check_init_vocab(directory: str | os.PathLike, cfg: RunConfig, data_meta: dict[str, Any]) -> None:
    """ConfigError when the model's vocabulary (after it was taken from the data) is not the directory's."""
    hf = hf_model_config(directory)
    if cfg.model.vocab_size != hf.vocab_size:
        raise ConfigError(f"train.init_from={str(directory)!r} has a {hf.vocab_size}-token vocabulary but the model "
                          f"has {cfg.model.vocab_size} (data: {data_meta.get('vocab_size')} tokens, tokenizer "
                          f"{data_meta.get('tokenizer')!r}); prepare the data with that model's tokenizer "
                          "(e.g. --tokenizer gpt2) or set model.vocab_size")


def load_into(model: Any, directory: str | os.PathLike) -> None:
    """Copy a Hugging Face directory's weights into ``model`` (every parameter, shapes checked by name)."""
    import blutensor as bt

    _, params = load_hf(directory)
    own = dict(model.named_parameters())
    missing = sorted(set(own) - set(params))
    extra = sorted(set(params) - set(own))
    if missing or extra:
        raise HFError(f"{directory}: weights do not match the model (missing {missing[:4]}, unexpected {extra[:4]})")
    for name, p in own.items():
        arr = params[name]
        if tuple(arr.shape) != tuple(p.shape):
            raise HFError(f"{directory}: {name} has shape {tuple(arr.shape)}, the model's is {tuple(p.shape)}")
    with bt.no_grad():
        for name, p in own.items():
            p.copy_(bt.tensor(params[name], dtype=p.dtype, device=p.device))


# ---------------------------------------------------------------- GPT-2
_GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_GPT2_ACTS = ("gelu_new", "gelu_pytorch_tanh")


def _gpt2_config_from_hf(c: dict[str, Any]) -> ModelConfig:
    def need(key: str, default: Any = None) -> Any:
        v = c.get(key, default)
        if v is None:
            raise HFError(f"GPT-2 config.json lacks {key!r}")
        return v

    d = int(need("n_embd"))
    act = c.get("activation_function", "gelu_new")
    if act not in _GPT2_ACTS:
        raise HFError(f"GPT-2 config.json: activation_function {act!r} is not GPT-2's tanh GELU "
                      f"({', '.join(_GPT2_ACTS)})")
    if c.get("n_inner") not in (None, 4 * d):
        raise HFError(f"GPT-2 config.json: n_inner={c['n_inner']} (BluTrain's GPT-2 MLP is 4*n_embd = {4 * d})")
    for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if c.get(key):
            raise HFError(f"GPT-2 config.json: {key} = true is not supported")
    if c.get("scale_attn_weights", True) is False:
        raise HFError("GPT-2 config.json: scale_attn_weights = false is not supported")
    if c.get("tie_word_embeddings", True) is False:
        raise HFError("GPT-2 config.json: tie_word_embeddings = false (BluTrain's GPT-2 ties lm_head to wte)")
    drop = float(c.get("resid_pdrop", 0.0) or 0.0)
    try:
        return ModelConfig(family="gpt2", n_layer=int(need("n_layer")), n_head=int(need("n_head")), d_model=d,
                           block_size=int(need("n_positions")), vocab_size=int(need("vocab_size")),
                           dropout=drop, bias=True, init_std=float(c.get("initializer_range", 0.02)),
                           ln_eps=float(c.get("layer_norm_epsilon", 1e-5))).check()
    except ConfigError as e:
        raise HFError(f"GPT-2 config.json: {e}") from None


def _gpt2_to_hf(model: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    m: ModelConfig = model.config
    if not m.bias:
        raise HFError("export: model.bias = false has no transformers GPT-2 equivalent (GPT2LMHeadModel has biases)")
    out: dict[str, np.ndarray] = {}
    for name, p in model.named_parameters():
        arr = np.asarray(p.detach().to("cpu").numpy(), dtype=np.float32)
        if name == "wte.weight":
            arr = arr[:m.vocab_size]  # drop the padded rows
        if name.endswith(_GPT2_CONV1D):
            arr = arr.T  # Conv1D stores (in, out)
        out["transformer." + name.replace("blocks.", "h.")] = np.ascontiguousarray(arr)
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m.vocab_size,
           "n_positions": m.block_size, "n_ctx": m.block_size, "n_embd": m.d_model, "n_layer": m.n_layer,
           "n_head": m.n_head, "n_inner": None, "activation_function": "gelu_new",
           "layer_norm_epsilon": m.ln_eps, "resid_pdrop": m.dropout, "embd_pdrop": m.dropout,
           "attn_pdrop": 0.0, "initializer_range": m.init_std, "scale_attn_weights": True,
           "tie_word_embeddings": True, "bos_token_id": m.vocab_size - 1, "eos_token_id": m.vocab_size - 1,
           "torch_dtype": "float32"}
    return out, cfg


def _gpt2_from_hf(c: dict[str, Any], tensors: dict[str, np.ndarray]) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    m = _gpt2_config_from_hf(c)
    params: dict[str, np.ndarray] = {}
    for key, arr in tensors.items():
        name = key.removeprefix("transformer.")
        if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # tied to wte / causal-mask buffers of older transformers versions
        name = name.replace("h.", "blocks.", 1) if name.startswith("h.") else name
        if name.endswith(_GPT2_CONV1D):
            if arr.ndim != 2:
                raise HFError(f"GPT-2 weights: {key} must be 2-D, got shape {arr.shape}")
            arr = arr.T
        params[name] = np.ascontiguousarray(arr)
    wte = params.get("wte.weight")
    if wte is None:
        raise HFError("GPT-2 weights: no transformer.wte.weight")
    if wte.shape != (m.vocab_size, m.d_model):
        raise HFError(f"GPT-2 weights: transformer.wte.weight has shape {wte.shape}, config.json says "
                      f"({m.vocab_size}, {m.d_model})")
    padded = np.zeros((m.padded_vocab_size, m.d_model), np.float32)
    padded[:m.vocab_size] = wte  # padded rows are never targeted
    params["wte.weight"] = padded
    head = tensors.get("lm_head.weight")
    if head is not None and not np.array_equal(head, wte):
        raise HFError("GPT-2 weights: lm_head.weight differs from transformer.wte.weight (BluTrain ties them)")
    return m, params


register_hf("gpt2", _gpt2_to_hf, _gpt2_from_hf, _gpt2_config_from_hf, model_types=("gpt2",))


def _llama_from_hf(c: dict[str, Any], tensors: dict[str, np.ndarray]) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    from blumodels.llama.hf import from_hf

    model = from_hf(tensors, c)
    return model.config, {n: p.numpy() for n, p in model.named_parameters()}


def _llama_to_hf(model: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    from blumodels.llama.hf import to_hf

    return to_hf(model)


def _llama_config_from_hf(c: dict[str, Any]) -> ModelConfig:
    from blumodels.llama.hf import model_config

    return model_config(c)


register_hf("llama", _llama_to_hf, _llama_from_hf, _llama_config_from_hf, model_types=("llama",))
