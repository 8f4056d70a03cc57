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


def model_registry() -> Any:
    """The plugin host's registry of model families, blumodels' own (gpt2, llama) registered in it even when
    entry points are not loaded (``BLUTRAIN_DISABLE_PLUGIN_AUTOLOAD=1``); blocking ``blumodels`` still drops them."""
    from blutensor.ext import get_host

    host = get_host()
    if "gpt2" not in host.registry("model"):
        from blumodels import hooks

        host.register(hooks, name="blumodels")
    return host.registry("model")


def model_families() -> tuple[str, ...]:
    """Names of the installed model-family plugins (kind "model"): what ``model.family`` may name."""
    return tuple(model_registry().names())


def precisions() -> tuple[str, ...]:
    """What ``train.precision`` may be: the execution policy's one list (``bt.policy.PRECISIONS``)."""
    from blutensor import policy

    return policy.PRECISIONS


def fp32_gemms() -> tuple[str, ...]:
    """What ``train.fp32_gemm`` may be: the execution policy's one list (``bt.policy.FP32_GEMMS``)."""
    from blutensor import policy

    return policy.FP32_GEMMS


def __getattr__(name: str) -> Any:
    if name == "MODEL_FAMILIES":  # what the Trainer builds, read from the plugin registry when asked
        return model_families()
    if name == "PRECISIONS":  # train.precision's values: the execution policy's, read when asked
        return precisions()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


TOKENIZERS = ("auto", "gpt2", "bpe")  # data.tokenizer (blumodels.data.prepare.TOKENIZER_CHOICES)
BUILTIN_CORPORA = ("pydocs",)  # data.corpus (blumodels.data.corpus.BUILTIN_CORPORA; not imported: no NumPy here)
_CUDA_DEVICE = re.compile(r"cuda(:\d+)?")
MAX_PATH_CHARS = 4096  # PATH_MAX: a longer data.dir cannot be opened
MAX_TOML_BYTES = 16 << 20  # a config file larger than this is not a config

#: inclusive upper bound of every numeric key (lower bounds are checked below): a value past it is refused by name
#: instead of running out of memory (block_size, vocab, d_model) or never finishing (n_layer = 1e30, eval_steps)
UPPER_BOUNDS: dict[str, dict[str, float]] = {
    "model": {"n_layer": 4096, "n_head": 4096, "d_model": 1 << 17, "block_size": 1 << 21, "vocab_size": 1 << 24,
              "vocab_multiple": 1 << 16, "init_std": 1e3, "ln_eps": 1.0},
    "train": {"steps": 10**9, "batch_tokens": 1 << 40, "micro_batch": 1 << 20, "seq_len": 1 << 21, "lr": 1e3,
              "min_lr": 1e3, "warmup_steps": 10**9, "eps": 1.0, "weight_decay": 1e3, "grad_clip": 1e12,
              "seed": (1 << 63) - 1, "eval_interval": 10**9, "eval_steps": 100_000, "log_interval": 10**9,
              "checkpoint_interval": 10**9, "keep_checkpoints": 10_000, "sample_interval": 10**9,
              "sample_tokens": 100_000, "top_k": 1 << 24, "temperature": 1e6, "world_size": 1 << 20,
              "peak_flops": 1e21},
    "data": {"vocab_size": 1 << 24, "shard_tokens": 1 << 40, "seed": (1 << 63) - 1, "max_bytes": 1 << 50},
    "log": {"prometheus_port": 65535},
    "parallel": {"dp": 1 << 20, "fsdp": 1 << 20, "tp": 1 << 20, "cp": 1 << 20, "tp_async": 1 << 10},
}
MAX_STRING_CHARS = {"sample_prompt": 100_000, "dir": MAX_PATH_CHARS}


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
    ln_eps: float = 1e-5  # the norm's epsilon: LayerNorm (gpt2), RMSNorm (llama)
    # read by the llama family only (its check refuses them for gpt2 when changed from these defaults)
    n_kv_heads: int = 0  # key/value heads of grouped-query attention; 0 = n_head (multi-head attention)
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: str = "none"  # "none" | "llama3" (Llama 3.1's frequency-dependent scaling of long wavelengths)
    rope_factor: float = 8.0  # llama3 scaling: factor for the long wavelengths
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192  # the context length the scaled frequencies were trained at
    ffn_hidden: int = 0  # SwiGLU hidden size; 0 = 8/3 * d_model * ffn_dim_multiplier rounded up to ffn_dim_multiple
    ffn_dim_multiple: int = 256
    ffn_dim_multiplier: float = 1.0
    tie_embeddings: bool = True  # lm_head shares the token embedding (gpt2 always does)

    @property
    def padded_vocab_size(self) -> int:
        m = self.vocab_multiple
        return ((self.vocab_size + m - 1) // m) * m

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def check(self) -> ModelConfig:
        """Raise ConfigError naming the first model.* field out of range (shared by RunConfig and GPT2)."""
        families = model_families()
        if self.family not in families:
            raise ConfigError(f"model.family={self.family!r} is not a family blumodels trains "
                              f"({', '.join(families)}){_did_you_mean(self.family, families)}")
        for name in ("n_layer", "n_head", "d_model", "block_size", "vocab_multiple"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"model.{name} must be a positive integer, got {v!r}")
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 0:
            raise ConfigError(f"model.vocab_size must be a non-negative integer, got {self.vocab_size!r}")
        for name, hi in UPPER_BOUNDS["model"].items():
            v = getattr(self, name)
            if isinstance(v, int | float) and not isinstance(v, bool) and v > hi:
                raise ConfigError(f"model.{name}={_short(v)} is past its bound of {_short(hi)}")
        if self.d_model % self.n_head:
            raise ConfigError(f"model.n_head={self.n_head} does not divide model.d_model={self.d_model}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if not self.ln_eps > 0:  # LayerNorm of a constant row divides by sqrt(0 + ln_eps)
            raise ConfigError(f"model.ln_eps must be positive, got {self.ln_eps}")
        if not (math.isfinite(self.init_std) and self.init_std >= 0):
            raise ConfigError(f"model.init_std must be a finite non-negative number, got {self.init_std}")
        check = getattr(model_registry().get(self.family), "check_config", None)
        if check is not None:  # the family's own keys (llama: n_kv_heads, rope_*, ffn_*)
            check(self)
        return self


@dataclass
class TrainConfig:
    """Optimisation recipe (defaults: the GPT-2 recipe of docs/design.md, section 10) and run bookkeeping."""

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
    top_p: float = 1.0  # nucleus sampling: keep the most likely tokens holding this probability mass (1 = all)
    temperature: float = 1.0
    nan_policy: str = "stop"  # "stop" | "skip"
    precision: str = "fp32"  # "fp32" | "tf32" (CUDA matmuls) | "bf16" (bt.autocast: bf16 compute, fp32 masters)
    fp32_gemm: str = "strict"  # how fp32 CUDA GEMMs run: "strict" (FFMA) | "3xtf32" (fp32-accurate, tensor cores)
    gemm: str = "auto"  # CUDA GEMM provider: "auto" (BLUTRAIN_GEMM, else cublas > blublas > xp) | a registered one
    deterministic: bool = False  # bitwise-repeatable kernels only (bt.use_deterministic_algorithms), e.g. for
    # bit-exact resume in tf32; off: faster paths whose last bits vary (the fused attention backward's atomic dQ)
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    threads: int = 0  # CPU threads for GEMMs and kernels (bt.set_num_threads); 0 = usable cores / ranks per node
    world_size: int = 1
    fused_adamw: bool = True  # on CUDA: one multi-tensor AdamW launch per step (blutensor's fused path)
    activation_checkpointing: bool = False  # recompute each block in backward (keeps only block inputs)
    optimizer_in_backward: bool = False  # step each parameter and free its grad as soon as it is ready
    # CUDA: capture the whole optimisation step into CUDA graphs after warm-up (graph_step.py): "auto" = wherever
    # the step can be captured (a step that cannot runs eagerly and the log says why), true = required (what
    # cannot be captured is a ConfigError naming it), false = eager
    cuda_graph: bool | str = "auto"
    compile: bool = False  # run the step's forward + backward through the compiler plugin (bt.compile)
    allocator: str = "blu"  # CUDA: "blu" (bluallocator, flushed after step 0) | "cupy" (CuPy's pool) | a plugin
    peak_flops: float = 0.0  # per device; 0 = default table (CUDA) or none (CPU: MFU null)
    plot: bool = True
    init_from: str = ""  # a local Hugging Face model directory to start from (blumodels.hf); ignored on resume


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


CP_ROTATORS = ("p2p", "allgather", "alltoall")  # parallel.cp_rotator (dtms.parallel.ROTATORS)


@dataclass
class ParallelConfig:
    """How the ``train.world_size`` ranks split the work (dtms strategies, applied by the Trainer in
    torchtitan's order: TP, then CP, then FSDP or DDP). Sizes multiply to the world size."""

    dp: int = 0  # data-parallel replicas (DDP); 0 = what the other sizes leave of train.world_size
    fsdp: int = 1  # ranks that shard parameters, gradients and AdamW state (ZeRO-3) instead of replicating
    #   (dp > 1 with fsdp > 1: hybrid sharding, HSDP: dp replicas of fsdp-way shards)
    tp: int = 1  # tensor parallel (Megatron: heads, MLP and vocabulary split)
    cp: int = 1  # context parallel (ring attention over the load-balanced sequence shards)
    cp_rotator: str = "p2p"  # how K/V blocks travel: "p2p" ring (next block in flight), "allgather", "alltoall"
    tp_async: int = 0  # > 1: row-parallel GEMMs in this many token chunks, each all-reduce behind the next GEMM

    def sizes(self, world_size: int) -> dict[str, int]:
        """{"dp", "fsdp", "tp", "cp"} with ``dp = 0`` resolved (no check; see RunConfig.validate)."""
        rest = self.fsdp * self.tp * self.cp
        dp = self.dp or max(world_size // max(rest, 1), 1)
        return {"dp": dp, "fsdp": self.fsdp, "tp": self.tp, "cp": self.cp}

    @property
    def sharded(self) -> bool:
        """True when parameters or activations are split (FSDP, TP or CP), not only replicated."""
        return self.fsdp > 1 or self.tp > 1 or self.cp > 1


@dataclass
class LogConfig:
    """Where step metrics go besides log.jsonl: logger plugins on the step hook (see blumodels.loggers)."""

    tensorboard: bool = False  # TensorBoard event files (tensorboardX: pip install 'blumodels[tensorboard]')
    tensorboard_dir: str = ""  # "" = <out>/tensorboard
    prometheus: bool = False  # serve /metrics (prometheus_client: pip install 'blumodels[prometheus]')
    prometheus_host: str = "127.0.0.1"  # loopback unless asked otherwise
    prometheus_port: int = 9464  # 0 = a free port chosen by the system (printed)


@dataclass
class RunConfig:
    """The whole run: [model], [train], [data], [parallel] (and [log]) tables of a TOML file."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different rows of a batch (dp x fsdp): train.world_size / (tp x cp)."""
        p = self.parallel
        return max(self.train.world_size // max(p.tp * p.cp, 1), 1)

    @property
    def grad_accum(self) -> int:
        t = self.train
        return t.batch_tokens // (t.micro_batch * t.seq_len * self.data_parallel_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def _check_parallel(self) -> None:
        """The [parallel] table against train.world_size and the model's shape (before any work)."""
        p, t, m = self.parallel, self.train, self.model
        for name in ("fsdp", "tp", "cp"):
            if getattr(p, name) < 1:
                raise ConfigError(f"parallel.{name} must be a positive integer, got {getattr(p, name)}")
        if p.cp_rotator not in CP_ROTATORS:
            raise ConfigError(f"parallel.cp_rotator must be one of {', '.join(CP_ROTATORS)}, got {p.cp_rotator!r}"
                              f"{_did_you_mean(p.cp_rotator, CP_ROTATORS)}")
        fam = model_registry().get(m.family) if m.family in model_registry() else None
        if p.sharded and fam is not None and not hasattr(fam, "parallel_plan"):
            raise ConfigError(f"parallel.fsdp/tp/cp: model.family = {m.family!r} has no parallel plan (its family "
                              f"plugin defines no parallel_plan(model)); it trains data-parallel (parallel.dp)")
        sz = p.sizes(t.world_size)
        prod = sz["dp"] * sz["fsdp"] * sz["tp"] * sz["cp"]
        if prod != t.world_size:
            raise ConfigError(f"parallel sizes dp={sz['dp']}{' (from parallel.dp=0)' if not p.dp else ''} x "
                              f"fsdp={p.fsdp} x tp={p.tp} x cp={p.cp} = {prod} != train.world_size="
                              f"{t.world_size}")
        shapes = fam.parallel_shapes(m) if hasattr(fam, "parallel_shapes") else {"model.n_head": m.n_head}
        for what, size in shapes.items():
            if size % p.tp:
                raise ConfigError(f"parallel.tp={p.tp} does not divide {what}={size}")
        if m.vocab_size and m.padded_vocab_size % p.tp:
            raise ConfigError(f"parallel.tp={p.tp} does not divide the padded vocabulary {m.padded_vocab_size} "
                              f"(model.vocab_size rounded up to model.vocab_multiple={m.vocab_multiple})")
        if t.seq_len % (2 * p.cp):
            raise ConfigError(f"parallel.cp={p.cp}: train.seq_len={t.seq_len} is not divisible by 2*cp={2 * p.cp} "
                              f"(each rank holds two load-balanced chunks of the causal sequence)")
        if p.sharded:
            what = ", ".join(f"parallel.{k}={getattr(p, k)}" for k in ("fsdp", "tp", "cp") if getattr(p, k) > 1)
            if p.cp > 1 and m.dropout > 0:
                raise ConfigError(f"parallel.cp={p.cp} needs model.dropout = 0 (ring attention runs without "
                                  f"attention dropout), got {m.dropout}")
            if t.activation_checkpointing:
                raise ConfigError(f"train.activation_checkpointing cannot be combined with {what} (FSDP already "
                                  "recomputes each block in backward; TP/CP split the blocks it would wrap)")

    def validate(self) -> RunConfig:
        """Raise ConfigError naming the first field that is out of range."""
        m, t, d = self.model, self.train, self.data
        for sec, obj in (("model", m), ("train", t), ("data", d), ("log", self.log), ("parallel", self.parallel)):
            for f in fields(obj):
                v = getattr(obj, f.name)
                if isinstance(v, float) and not math.isfinite(v):  # NaN slips past every range check below
                    raise ConfigError(f"{sec}.{f.name} must be a finite number, got {v}")
                if isinstance(v, int | float) and not isinstance(v, bool) and v < 0:
                    raise ConfigError(f"{sec}.{f.name} must not be negative, got {v}")
                hi = UPPER_BOUNDS.get(sec, {}).get(f.name)
                if hi is not None and isinstance(v, int | float) and not isinstance(v, bool) and v > hi:
                    raise ConfigError(f"{sec}.{f.name}={_short(v)} is past its bound of {_short(hi)}")
                if isinstance(v, str) and len(v) > MAX_STRING_CHARS.get(f.name, 256):
                    raise ConfigError(f"{sec}.{f.name} is {len(v)} characters long, more than the "
                                      f"{MAX_STRING_CHARS.get(f.name, 256)} it may have")
        m.check()
        for name in ("steps", "batch_tokens", "micro_batch", "seq_len", "world_size"):
            if getattr(t, name) <= 0:
                raise ConfigError(f"train.{name} must be positive, got {getattr(t, name)}")
        if t.seq_len > m.block_size:
            raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.block_size={m.block_size}")
        self._check_parallel()
        per = t.micro_batch * t.seq_len * self.data_parallel_size
        if t.batch_tokens % per and self.parallel.sharded:
            raise ConfigError(f"train.batch_tokens={t.batch_tokens} is not divisible by micro_batch*seq_len*"
                              f"(world_size/(tp*cp)) = {t.micro_batch}*{t.seq_len}*{self.data_parallel_size} = "
                              f"{per}")
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
        if not 0.0 < t.top_p <= 1.0:
            raise ConfigError(f"train.top_p must be in (0, 1], got {t.top_p}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(t, name) < 1.0:
                raise ConfigError(f"train.{name} must be in [0, 1), got {getattr(t, name)}")
        if t.nan_policy not in ("stop", "skip"):
            raise ConfigError(f"train.nan_policy must be 'stop' or 'skip', got {t.nan_policy!r}"
                              f"{_did_you_mean(t.nan_policy, ('stop', 'skip'))}")
        precs, fp32_gemms_ = precisions(), fp32_gemms()
        if t.precision not in precs:
            raise ConfigError(f"train.precision must be {_one_of(precs)}, got {t.precision!r}"
                              f"{_did_you_mean(t.precision, precs)}")
        if t.fp32_gemm not in fp32_gemms_:
            raise ConfigError(f"train.fp32_gemm must be {_one_of(fp32_gemms_)} ('3xtf32': fp32-accurate "
                              f"split-TF32 GEMMs), got {t.fp32_gemm!r}{_did_you_mean(t.fp32_gemm, fp32_gemms_)}")
        from blumodels import gemm_choice

        gemm_choice.check(t)  # a registered provider that declares what precision / cuda_graph ask of it
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
        if t.cuda_graph not in (True, False, "auto"):
            raise ConfigError(f"train.cuda_graph must be true, false or \"auto\", got {t.cuda_graph!r}")
        if t.cuda_graph is True:
            from blumodels.graph_step import check_config

            check_config(self)
        if t.compile and t.world_size > 1:
            raise ConfigError("train.compile = true traces one process's step: DDP's gradient hooks (the bucket "
                              "all-reduces) would not run when the compiled step replays; use train.world_size = 1 "
                              "or train.compile = false")
        if t.compile and t.optimizer_in_backward:
            raise ConfigError("train.compile = true cannot trace train.optimizer_in_backward (its updates run in "
                              "gradient hooks inside backward); set one of them false")
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
        if self.log.prometheus_port > 65535:
            raise ConfigError(f"log.prometheus_port must be a TCP port (0..65535), got {self.log.prometheus_port}")
        if d.tokenizer in ("bpe", "auto") and d.vocab_size < 257:  # 256 bytes + the end-of-text token
            raise ConfigError(f"data.vocab_size={d.vocab_size} is too small for a byte-level BPE (at least 257)")
        return self


_SECTIONS = {"model": ModelConfig, "train": TrainConfig, "data": DataConfig, "log": LogConfig,
             "parallel": ParallelConfig}


#: names other trainers (nanoGPT, llm.c, PyTorch) use for our keys: an unknown key among them gets our name as hint
_ALIASES = {"learning_rate": "lr", "max_lr": "lr", "batch_size": "micro_batch", "block_size": "seq_len",
            "max_steps": "steps", "max_iters": "steps", "iters": "steps", "n_embd": "d_model", "n_heads": "n_head",
            "n_layers": "n_layer", "warmup_iters": "warmup_steps", "grad_accum": "batch_tokens",
            "gradient_accumulation_steps": "batch_tokens", "dtype": "precision", "eval_iters": "eval_steps"}


def _short(v: Any) -> str:
    """A number as text, cut short when it has hundreds of digits."""
    t = str(v)
    return t if len(t) <= 24 else f"{t[:8]}...({len(t)} digits)"


def _shown(v: Any) -> str:
    """repr() of a value for an error message, cut to 60 characters (a 5,000-character value is not echoed)."""
    r = repr(v)
    return r if len(r) <= 60 else f"{r[:40]}...({len(r)} characters)"


def _one_of(choices: Any) -> str:
    """"'a', 'b' or 'c'" for an error message."""
    q = [repr(str(c)) for c in choices]
    return q[0] if len(q) == 1 else f"{', '.join(q[:-1])} or {q[-1]}"


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
    if typ == bool | str:  # a switch with an "auto" setting (train.cuda_graph)
        if isinstance(value, str) and value.lower() == "auto":
            return "auto"
        try:
            return _coerce(section, name, bool, value)
        except ConfigError:
            raise ConfigError(f"{where} must be true, false or \"auto\", got {value!r}") from None
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where} must be a boolean, got {_shown(value)}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be an integer, got {_shown(value)}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip().replace("_", ""))  # exact: "18446744073709551617" stays itself
            except ValueError:
                pass
            try:
                return int(float(value)) if float(value).is_integer() else int(value)
            except (ValueError, OverflowError):
                pass
        raise ConfigError(f"{where} must be an integer, got {_shown(value)}")
    if typ is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an integer with hundreds of digits
                raise ConfigError(f"{where} must be a number a float can hold, got {_short(value)}") from None
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where} must be a number, got {_shown(value)}")
    if typ is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where} must be a string, got {_shown(value)}")
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
    if not str(path):
        raise ConfigError("--config: the config file name is empty")
    if len(str(path)) > MAX_PATH_CHARS:
        raise ConfigError(f"config file name is {len(str(path))} characters long, more than {MAX_PATH_CHARS}")
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_TOML_BYTES + 1)
        if len(raw) > MAX_TOML_BYTES:
            raise ConfigError(f"config file {p} is larger than {MAX_TOML_BYTES >> 20} MiB: not a config")
        data = tomllib.loads(raw.decode("utf-8"))
    except RecursionError:
        raise ConfigError(f"config file {p}: tables or arrays nested too deeply") from None
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


def preset_names(family: str | None = None) -> list[str]:
    """Names of the presets shipped with blumodels (presets/*.toml); ``family``: only those whose
    ``model.family`` is it."""
    root = resources.files("blumodels") / "presets"
    names = sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".toml"))
    if family is None:
        return names
    return [n for n in names if tomllib.loads((root / f"{n}.toml").read_text()).get("model", {}).get(
        "family", "gpt2") == family]


def preset_path(name: str) -> Path:
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name) or ".." in name:
        raise ConfigError(f"unknown preset {str(name)[:80]!r}; presets: {', '.join(preset_names())}")
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
                              data=dataclasses.replace(cfg.data), log=dataclasses.replace(cfg.log),
                              parallel=dataclasses.replace(cfg.parallel))
    _apply(new, parse_overrides(items), "override")
    return new.validate()
