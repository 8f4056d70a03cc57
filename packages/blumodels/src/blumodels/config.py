"""Typed run configuration: ModelConfig, TrainConfig, DataConfig loaded from TOML and validated.

Errors name the field at fault (``train.batch_tokens``, ``model.n_head`` ...) before any work starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import tomllib
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any, get_type_hints


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type or out of range; names the field."""


MODEL_FAMILIES = ("gpt2",)  # what the Trainer builds (blumodels.gpt2.build_model)
TOKENIZERS = ("auto", "gpt2", "bpe")  # data.tokenizer (blumodels.data.prepare.TOKENIZER_CHOICES)
BUILTIN_CORPORA = ("pydocs",)  # data.corpus (blumodels.data.corpus.BUILTIN_CORPORA; not imported: no NumPy here)
PRECISIONS = ("fp32", "tf32", "bf16")  # train.precision
_CUDA_DEVICE = re.compile(r"cuda(:\d+)?")


@dataclass
class ModelConfig:
    """GPT-2 shape. ``vocab_size = 0`` takes the vocabulary from the prepared data (meta.json)."""

    family: str = "gpt2"
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    block_size: int = 1024  # maximum context length (rows of wpe)
    vocab_size: int = 0  # real vocabulary; 0 = from the data
    vocab_multiple: int = 64  # logits are computed over vocab padded to this multiple
    dropout: float = 0.0
    bias: bool = True
    init_std: float = 0.02
    ln_eps: float = 1e-5

    @property
    def padded_vocab_size(self) -> int:
        m = self.vocab_multiple
        return ((self.vocab_size + m - 1) // m) * m

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def check(self) -> ModelConfig:
        """Raise ConfigError naming the first model.* field out of range (shared by RunConfig and GPT2)."""
        if self.family not in MODEL_FAMILIES:
            raise ConfigError(f"model.family={self.family!r} is not a family blumodels trains "
                              f"({', '.join(MODEL_FAMILIES)}){_did_you_mean(self.family, MODEL_FAMILIES)}")
        for name in ("n_layer", "n_head", "d_model", "block_size", "vocab_multiple"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"model.{name} must be a positive integer, got {v!r}")
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 0:
            raise ConfigError(f"model.vocab_size must be a non-negative integer, got {self.vocab_size!r}")
        if self.d_model % self.n_head:
            raise ConfigError(f"model.n_head={self.n_head} does not divide model.d_model={self.d_model}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if not self.ln_eps > 0:  # LayerNorm of a constant row divides by sqrt(0 + ln_eps)
            raise ConfigError(f"model.ln_eps must be positive, got {self.ln_eps}")
        if not (math.isfinite(self.init_std) and self.init_std >= 0):
            raise ConfigError(f"model.init_std must be a finite non-negative number, got {self.init_std}")
        return self


@dataclass
class TrainConfig:
    """Optimisation recipe (defaults = the paper's Table 1) and run bookkeeping."""

    steps: int = 19073
    batch_tokens: int = 524288  # global batch in tokens; = micro_batch * seq_len * world * grad_accum
    micro_batch: int = 16  # B per rank per micro step
    seq_len: int = 1024  # T
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 715
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # on 2-D weights only (matmul weights and embeddings)
    grad_clip: float = 1.0  # 0 disables clipping
    seed: int = 1337
    eval_interval: int = 250  # 0 disables periodic validation
    eval_steps: int = 20
    log_interval: int = 1
    checkpoint_interval: int = 1000  # 0 = only at the end
    keep_checkpoints: int = 3
    async_checkpoint: bool = False
    sample_interval: int = 0  # 0 = only at the end (when sample_tokens > 0)
    sample_tokens: int = 0
    sample_prompt: str = "\n"
    top_k: int = 40
    temperature: float = 1.0
    nan_policy: str = "stop"  # "stop" | "skip"
    precision: str = "fp32"  # "fp32" | "tf32" (CUDA matmuls) | "bf16" (bt.autocast: bf16 compute, fp32 masters)
    fp32_gemm: str = "strict"  # how fp32 CUDA GEMMs run: "strict" (FFMA) | "3xtf32" (fp32-accurate, tensor cores)
    deterministic: bool = False  # bitwise-repeatable kernels only (bt.use_deterministic_algorithms), e.g. for
    # bit-exact resume in tf32; off: faster paths whose last bits vary (the fused attention backward's atomic dQ)
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    threads: int = 0  # CPU threads for GEMMs and kernels (bt.set_num_threads); 0 = usable cores / ranks per node
    world_size: int = 1
    fused_adamw: bool = True  # on CUDA: one multi-tensor AdamW launch per step (blutensor's fused path)
    activation_checkpointing: bool = False  # recompute each block in backward (keeps only block inputs)
    optimizer_in_backward: bool = False  # step each parameter and free its grad as soon as it is ready
    cuda_graph: bool = False  # CUDA: capture the whole step in one CUDA graph after warm-up (graph_step.py)
    allocator: str = "blu"  # CUDA: "blu" (bluallocator, flushed after step 0) | "cupy" (CuPy's pool) | a plugin
    peak_flops: float = 0.0  # per device; 0 = default table (CUDA) or none (CPU: MFU null)
    plot: bool = True


@dataclass
class DataConfig:
    """Where token shards live and how to make them when missing (see blumodels.data.prepare)."""

    dir: str = ""  # "" = <out>/data, prepared automatically when missing
    corpus: str = "pydocs"
    tokenizer: str = "auto"
    vocab_size: int = 4096  # BPE vocabulary when the tokenizer is trained here
    val_fraction: float = 0.05
    shard_tokens: int = 10_000_000
    seed: int = 0
    max_bytes: int = 0  # cap on the built-in corpus (0 = all of it); for quick runs and tests


@dataclass
class RunConfig:
    """The whole run: [model], [train], [data] tables of a TOML file."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    @property
    def grad_accum(self) -> int:
        t = self.train
        return t.batch_tokens // (t.micro_batch * t.seq_len * t.world_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> RunConfig:
        """Raise ConfigError naming the first field that is out of range."""
        m, t, d = self.model, self.train, self.data
        for sec, obj in (("model", m), ("train", t), ("data", d)):
            for f in fields(obj):
                v = getattr(obj, f.name)
                if isinstance(v, float) and not math.isfinite(v):  # NaN slips past every range check below
                    raise ConfigError(f"{sec}.{f.name} must be a finite number, got {v}")
                if isinstance(v, int | float) and not isinstance(v, bool) and v < 0:
                    raise ConfigError(f"{sec}.{f.name} must not be negative, got {v}")
        m.check()
        for name in ("steps", "batch_tokens", "micro_batch", "seq_len", "world_size"):
            if getattr(t, name) <= 0:
                raise ConfigError(f"train.{name} must be positive, got {getattr(t, name)}")
        if t.seq_len > m.block_size:
            raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.block_size={m.block_size}")
        per = t.micro_batch * t.seq_len * t.world_size
        if t.batch_tokens % per:
            raise ConfigError(f"train.batch_tokens={t.batch_tokens} is not divisible by micro_batch*seq_len*"
                              f"world_size = {t.micro_batch}*{t.seq_len}*{t.world_size} = {per}")
        if t.lr <= 0:
            raise ConfigError(f"train.lr must be positive, got {t.lr} (a zero learning rate trains nothing)")
        if t.min_lr > t.lr:
            raise ConfigError(f"train.min_lr={t.min_lr} is larger than train.lr={t.lr}")
        if t.eps <= 0:  # AdamW divides by sqrt(v) + eps; v stays 0 for the padded vocabulary rows -> 0/0
            raise ConfigError(f"train.eps must be positive, got {t.eps}")
        if t.temperature <= 0:
            raise ConfigError(f"train.temperature must be positive, got {t.temperature}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(t, name) < 1.0:
                raise ConfigError(f"train.{name} must be in [0, 1), got {getattr(t, name)}")
        if t.nan_policy not in ("stop", "skip"):
            raise ConfigError(f"train.nan_policy must be 'stop' or 'skip', got {t.nan_policy!r}"
                              f"{_did_you_mean(t.nan_policy, ('stop', 'skip'))}")
        if t.precision not in PRECISIONS:
            raise ConfigError(f"train.precision must be 'fp32', 'tf32' or 'bf16', got {t.precision!r}"
                              f"{_did_you_mean(t.precision, PRECISIONS)}")
        if t.fp32_gemm not in ("strict", "3xtf32"):
            raise ConfigError(f"train.fp32_gemm must be 'strict' or '3xtf32' (fp32-accurate split-TF32 GEMMs), "
                              f"got {t.fp32_gemm!r}{_did_you_mean(t.fp32_gemm, ('strict', '3xtf32'))}")
        if t.allocator not in ("blu", "cupy"):
            from blumodels.memory import allocator_names

            names = allocator_names()
            if t.allocator not in names:
                raise ConfigError(f"train.allocator must be 'blu', 'cupy' or an installed allocator plugin "
                                  f"({', '.join(names)}), got {t.allocator!r}{_did_you_mean(t.allocator, names)}")
        if t.device not in ("auto", "cpu") and not _CUDA_DEVICE.fullmatch(t.device):
            raise ConfigError(f"train.device must be 'auto', 'cpu' or 'cuda[:N]', got {t.device!r}")
        if t.optimizer_in_backward:
            why = "the optimizer step happens inside every backward, as each gradient becomes ready"
            if self.grad_accum > 1:
                raise ConfigError(f"train.optimizer_in_backward is incompatible with gradient accumulation "
                                  f"(grad_accum = {self.grad_accum}): {why}; set train.batch_tokens to "
                                  f"micro_batch*seq_len*world_size = {per}")
            if t.grad_clip > 0:
                raise ConfigError(f"train.optimizer_in_backward is incompatible with gradient clipping "
                                  f"(train.grad_clip = {t.grad_clip}): the global norm needs every gradient "
                                  f"before any step; set train.grad_clip = 0")
            if t.world_size > 1:
                raise ConfigError("train.optimizer_in_backward is incompatible with train.world_size > 1: "
                                  "data-parallel gradients are averaged only after backward")
            if t.nan_policy == "skip":
                raise ConfigError("train.optimizer_in_backward cannot honour train.nan_policy = 'skip': "
                                  f"{why}, so a bad step cannot be dropped; use 'stop'")
        if t.cuda_graph:
            from blumodels.graph_step import check_config

            check_config(self)
        if t.sample_interval and not t.sample_tokens:
            raise ConfigError(f"train.sample_interval={t.sample_interval} samples nothing with train.sample_tokens = 0 "
                              "(set the number of tokens to sample)")
        if t.keep_checkpoints < 1:
            raise ConfigError(f"train.keep_checkpoints must be at least 1, got {t.keep_checkpoints}")
        if t.eval_interval and t.eval_steps <= 0:
            raise ConfigError("train.eval_steps must be positive when train.eval_interval is set")
        if t.log_interval <= 0:
            raise ConfigError(f"train.log_interval must be positive, got {t.log_interval}")
        if not 0.0 < d.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in (0, 1), got {d.val_fraction}")
        if d.tokenizer not in TOKENIZERS:
            raise ConfigError(f"data.tokenizer must be one of {', '.join(TOKENIZERS)}, got {d.tokenizer!r}"
                              f"{_did_you_mean(d.tokenizer, TOKENIZERS)}")
        if d.shard_tokens < 2:
            raise ConfigError(f"data.shard_tokens must be at least 2, got {d.shard_tokens}")
        if d.corpus not in BUILTIN_CORPORA:
            raise ConfigError(f"data.corpus must be a built-in corpus ({', '.join(BUILTIN_CORPORA)}), got "
                              f"{d.corpus!r}{_did_you_mean(d.corpus, BUILTIN_CORPORA)} (own text: `blutrain "
                              "prepare --source DIR --corpus none`, then data.dir)")
        if d.tokenizer in ("bpe", "auto") and d.vocab_size < 257:  # 256 bytes + the end-of-text token
            raise ConfigError(f"data.vocab_size={d.vocab_size} is too small for a byte-level BPE (at least 257)")
        return self


_SECTIONS = {"model": ModelConfig, "train": TrainConfig, "data": DataConfig}


#: names other trainers (nanoGPT, llm.c, PyTorch) use for our keys: an unknown key among them gets our name as hint
_ALIASES = {"learning_rate": "lr", "max_lr": "lr", "batch_size": "micro_batch", "block_size": "seq_len",
            "max_steps": "steps", "max_iters": "steps", "iters": "steps", "n_embd": "d_model", "n_heads": "n_head",
            "n_layers": "n_layer", "warmup_iters": "warmup_steps", "grad_accum": "batch_tokens",
            "gradient_accumulation_steps": "batch_tokens", "dtype": "precision", "eval_iters": "eval_steps"}


def _did_you_mean(word: str, choices: Any, prefix: str = "") -> str:
    """'; did you mean 'X'?' for the closest choice or known alias (``prefix`` put before it), or ''."""
    names = [str(c) for c in choices]
    alias = _ALIASES.get(str(word))
    lower = {n.lower(): n for n in names}  # 'BF16' -> 'bf16'
    close = [alias] if alias in names else \
        [lower[m] for m in difflib.get_close_matches(str(word).lower(), list(lower), n=1, cutoff=0.6)]
    return f"; did you mean '{prefix}{close[0]}'?" if close else ""


def _coerce(section: str, name: str, typ: Any, value: Any) -> Any:
    """Check/convert one value to the field's declared type (ints accepted for floats)."""
    where = f"{section}.{name}"
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where} must be a boolean, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(float(value)) if float(value).is_integer() else int(value)
            except ValueError:
                pass
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if typ is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if typ is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where} must be a string, got {value!r}")
    return value


def _apply(cfg: RunConfig, data: dict[str, Any], origin: str) -> None:
    for section, table in data.items():
        if section not in _SECTIONS and not isinstance(table, dict):  # `lr = 1e-3` above every [table]
            homes = [sec for sec, typ in _SECTIONS.items() if section in {f.name for f in fields(typ)}]
            where = f"; put it under [{homes[0]}]" if homes else ""
            raise ConfigError(f"{origin}: key {section!r} = {table!r} is outside any table{where} (tables: "
                              f"{', '.join(_SECTIONS)})")
        if section not in _SECTIONS:
            raise ConfigError(f"{origin}: unknown section [{section}]{_did_you_mean(section, _SECTIONS)} "
                              f"(sections: {', '.join(_SECTIONS)})")
        if not isinstance(table, dict):
            raise ConfigError(f"{origin}: [{section}] must be a table")
        obj = getattr(cfg, section)
        hints = get_type_hints(type(obj))
        for key, value in table.items():
            if key not in hints:
                names = [f.name for f in fields(obj)]
                hint = _did_you_mean(key, names, prefix=f"{section}.")
                raise ConfigError(f"{origin}: unknown key {section}.{key}{hint} (known keys of [{section}]: "
                                  f"{', '.join(names)})")
            setattr(obj, key, _coerce(section, key, hints[key], value))


def from_dict(data: dict[str, Any], origin: str = "config") -> RunConfig:
    """A validated RunConfig from nested {section: {key: value}}."""
    cfg = RunConfig()
    _apply(cfg, data, origin)
    return cfg.validate()


def model_config(data: dict[str, Any], origin: str = "model config") -> ModelConfig:
    """A checked ModelConfig from a dict of model.* keys (unknown keys and wrong types name the key)."""
    cfg = RunConfig()
    _apply(cfg, {"model": data}, origin)
    return cfg.model.check()


def load_config(path: str | Path) -> RunConfig:
    """Load and validate a TOML file; errors name the file and the field."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {p}: invalid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {p}: not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} at offset "
                          f"{e.start})") from None
    except OSError as e:
        raise ConfigError(f"config file {p} cannot be read: {e.strerror or e}") from None
    return from_dict(data, origin=str(p))


def preset_names() -> list[str]:
    """Names of the presets shipped with blumodels (presets/*.toml)."""
    root = resources.files("blumodels") / "presets"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".toml"))


def preset_path(name: str) -> Path:
    p = resources.files("blumodels") / "presets" / f"{name}.toml"
    if not p.is_file():
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(preset_names())}")
    return Path(str(p))


def load_preset(name: str) -> RunConfig:
    return load_config(preset_path(name))


def parse_overrides(items: list[str]) -> dict[str, dict[str, str]]:
    """``["train.lr=3e-4", "model.n_layer=2"]`` -> {"train": {"lr": "3e-4"}, "model": {"n_layer": "2"}}."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.lr=3e-4)")
        out.setdefault(section, {})[name] = value.strip()
    return out


def apply_overrides(cfg: RunConfig, items: list[str]) -> RunConfig:
    """A copy of ``cfg`` with ``section.key=value`` overrides applied and validated."""
    new = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model), train=dataclasses.replace(cfg.train),
                              data=dataclasses.replace(cfg.data))
    _apply(new, parse_overrides(items), "override")
    return new.validate()
