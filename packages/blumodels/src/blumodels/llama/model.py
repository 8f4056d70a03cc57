"""Llama-style decoder: RMSNorm pre-norm blocks, rotary position embedding (with Llama 3's frequency scaling),
grouped-query attention (``n_kv_heads``), SwiGLU MLP, no biases by default, tied or untied embeddings.

Module and parameter names are those of Hugging Face's ``LlamaForCausalLM`` without its ``model.`` prefix
(``layers.0.self_attn.q_proj.weight``, ``layers.0.mlp.gate_proj.weight``, ``norm.weight``, ``lm_head.weight``), so
checkpoints map one to one (``blumodels.llama.hf``). RoPE uses the rotate-half layout of those checkpoints.

Initialisation follows GPT-2/torchtitan practice: N(0, init_std) for every matrix and the embedding, RMSNorm
weights one, and N(0, init_std / sqrt(2 * n_layer)) for the two residual projections (o_proj, down_proj).
"""

from __future__ import annotations

import math

import blutensor as bt
import blutensor.nn.functional as F
import numpy as np
from blutensor import nn

from blumodels.config import ConfigError, ModelConfig
from blumodels.gpt2 import Embedding, Linear


def ffn_hidden(cfg: ModelConfig) -> int:
    """The SwiGLU hidden width: model.ffn_hidden, else Llama's int(8d/3 * multiplier) rounded up to the multiple."""
    if cfg.ffn_hidden:
        return cfg.ffn_hidden
    h = int(cfg.ffn_dim_multiplier * int(8 * cfg.d_model / 3))
    m = cfg.ffn_dim_multiple
    return m * ((h + m - 1) // m)


def kv_heads(cfg: ModelConfig) -> int:
    return cfg.n_kv_heads or cfg.n_head


def inv_frequencies(cfg: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies (head_dim/2,) in float32 as Llama's reference code and ``transformers`` compute them
    (1 / theta ** (2i / head_dim), each op rounded to float32), with Llama 3's scaling when rope_scaling='llama3':
    wavelengths longer than original_max_len/low_freq_factor are divided by rope_factor, shorter than
    original_max_len/high_freq_factor kept, and those between interpolated smoothly (Llama 3.1's recipe, in its
    float32 op order). The checkpoints of the family were trained with these rounded frequencies; the power itself
    is taken in float64 and rounded once (the value of PyTorch's float32 power)."""
    f32 = np.float32
    D = cfg.head_dim
    expo = np.arange(0, D, 2).astype(f32) / f32(D)
    inv = f32(1.0) / (float(cfg.rope_theta) ** expo.astype(np.float64)).astype(f32)
    if cfg.rope_scaling == "llama3":
        f, lo = f32(cfg.rope_factor), f32(cfg.rope_low_freq_factor)
        span = f32(cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        L = cfg.rope_original_max_len
        wavelen = (f32(1.0) / inv) * f32(2 * math.pi)  # scalar / tensor in PyTorch: reciprocal, then product
        scaled = np.where(wavelen > f32(L / cfg.rope_low_freq_factor), inv / f, inv)
        smooth = ((f32(1.0) / wavelen) * f32(L) - lo) / span
        smoothed = (f32(1.0) - smooth) * scaled / f + smooth * scaled
        medium = ~(wavelen < f32(L / cfg.rope_high_freq_factor)) & ~(wavelen > f32(L / cfg.rope_low_freq_factor))
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(f32)


def rope_tables(cfg: ModelConfig, n: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (n, head_dim/2) float32 of the angles position * inv_frequency, positions 0..n-1.

    The angles are float32 products, as in Llama's reference code and ``transformers`` (at position p the angle
    is p * inv rounded to float32: off the exact angle by up to half an ulp of p * inv, 3e-5 rad at p = 1024,
    2e-4 at 8192), so these tables equal theirs to one rounding of cos/sin; a pretrained checkpoint sees the
    rotations it was trained with, and a model trained here beside PyTorch runs the same function."""
    ang = (np.arange(n, dtype=np.float32)[:, None] * inv_frequencies(cfg)[None, :]).astype(np.float64)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def check_config(cfg: ModelConfig) -> None:
    """ConfigError naming the first llama key out of range (called by ModelConfig.check for family 'llama')."""
    for name in ("n_kv_heads", "ffn_hidden"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"model.{name} must be a non-negative integer (0 = derived), got {v!r}")
    for name in ("ffn_dim_multiple", "rope_original_max_len"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"model.{name} must be a positive integer, got {v!r}")
    if cfg.n_head % kv_heads(cfg):
        raise ConfigError(f"model.n_kv_heads={cfg.n_kv_heads} must divide model.n_head={cfg.n_head} (each key/value "
                          "head serves n_head/n_kv_heads query heads)")
    if cfg.d_model % cfg.n_head == 0 and cfg.head_dim % 2:
        raise ConfigError(f"model.d_model/model.n_head = {cfg.head_dim} must be even for rotary embedding")
    for name in ("rope_theta", "rope_factor", "ffn_dim_multiplier"):
        v = getattr(cfg, name)
        if not (math.isfinite(v) and v > 0):
            raise ConfigError(f"model.{name} must be a positive number, got {v}")
    if cfg.rope_scaling not in ("none", "llama3"):
        raise ConfigError(f"model.rope_scaling must be 'none' or 'llama3', got {cfg.rope_scaling!r}")
    if cfg.rope_scaling == "llama3" and not 0 < cfg.rope_low_freq_factor < cfg.rope_high_freq_factor:
        raise ConfigError(f"model.rope_low_freq_factor={cfg.rope_low_freq_factor} and model.rope_high_freq_factor="
                          f"{cfg.rope_high_freq_factor} must satisfy 0 < low < high")


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE on q and k; ``n_head``/``n_kv_heads`` are this rank's
    heads (tensor parallelism divides both), ``head_dim`` is fixed."""

    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.n_head, self.n_kv_heads, self.head_dim = cfg.n_head, kv_heads(cfg), cfg.head_dim
        self.d_model, self.dropout = cfg.d_model, cfg.dropout
        hd, std = cfg.head_dim, cfg.init_std
        self.q_proj = Linear(cfg.d_model, cfg.n_head * hd, std, cfg.bias, device)
        self.k_proj = Linear(cfg.d_model, self.n_kv_heads * hd, std, cfg.bias, device)
        self.v_proj = Linear(cfg.d_model, self.n_kv_heads * hd, std, cfg.bias, device)
        self.o_proj = Linear(cfg.n_head * hd, cfg.d_model, std / math.sqrt(2 * cfg.n_layer), cfg.bias, device)

    def forward(self, x, cos, sin, cache=None, layer: int = 0):
        B, T, _ = x.shape
        H, Hk, hd = self.n_head, self.n_kv_heads, self.head_dim
        # rotated and laid out (B, heads, T, hd) for attention in one pass each (no transpose copies)
        q = F.rope(self.q_proj(x).view(B, T, H, hd), cos, sin, transpose=True)
        k = F.rope(self.k_proj(x).view(B, T, Hk, hd), cos, sin, transpose=True)
        v = self.v_proj(x).view(B, T, Hk, hd).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=True)
        else:  # generation: keys/values of earlier positions come from the cache (host or device positions)
            y = cache.attend(layer, q, k, v)
        y = self.o_proj(y.transpose(1, 2).reshape(B, T, H * hd))
        return F.dropout(y, p, self.training) if p > 0 else y


class MLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)); the SwiGLU product is one op saving gate and up only."""

    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        h = ffn_hidden(cfg)
        self.dropout = cfg.dropout
        self.gate_proj = Linear(cfg.d_model, h, cfg.init_std, cfg.bias, device)
        self.up_proj = Linear(cfg.d_model, h, cfg.init_std, cfg.bias, device)
        self.down_proj = Linear(h, cfg.d_model, cfg.init_std / math.sqrt(2 * cfg.n_layer), cfg.bias, device)

    def forward(self, x):
        y = self.down_proj(F.swiglu(self.gate_proj(x), self.up_proj(x)))
        return F.dropout(y, self.dropout, self.training) if self.dropout > 0 else y


def _plain_norm(m) -> bool:
    """``m`` is blutensor's own RMSNorm with its own forward (not wrapped by a logger, not replaced by a plugin's
    layer): its add before it may be fused into ``F.add_rms_norm`` (same parameter, same values)."""
    return type(m) is nn.RMSNorm and "forward" not in m.__dict__


def _add_norm(a, x, norm):
    """(x + a, norm(x + a)): one fused op (``F.add_rms_norm``: under autocast the normalised output comes out in
    the GEMM dtype) when ``norm`` is a plain RMSNorm, else the add and the module's own call."""
    if _plain_norm(norm):
        return F.add_rms_norm(a, x, norm.normalized_shape, norm.weight, norm.eps)
    h = x + a
    return h, norm(h)


class Block(nn.Module):
    """h = x + attn(input_layernorm(x)); h + mlp(post_attention_layernorm(h)).

    The residual add after attention and the post-attention RMSNorm are one fused op (``F.add_rms_norm``: one
    pass over the rows each way; under autocast the normalised output comes out bf16 for the MLP's GEMMs).
    :meth:`sublayers` stops before the MLP's residual add, so that :class:`Llama` fuses that add with the next
    block's input_layernorm (or the final norm); ``forward`` (the residual stream in, the block's output out: what
    activation checkpointing, FSDP units and module wrappers call) adds it itself. Both give the same values."""

    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.d_model, eps=cfg.ln_eps, device=device)
        self.self_attn = Attention(cfg, device)
        self.post_attention_layernorm = nn.RMSNorm(cfg.d_model, eps=cfg.ln_eps, device=device)
        self.mlp = MLP(cfg, device)

    def forward(self, x, cos, sin, cache=None, layer: int = 0):
        h, m = self.sublayers(x, self.input_layernorm(x), cos, sin, cache, layer)
        return h + m

    def sublayers(self, x, y, cos, sin, cache=None, layer: int = 0):
        """(h, m) for the residual stream ``x`` and ``y = input_layernorm(x)``: h = x + attn(y),
        m = mlp(post_attention_layernorm(h)); the block's output is h + m (left to the caller, to fuse with the norm
        that follows)."""
        h, z = _add_norm(self.self_attn(y, cos, sin, cache, layer), x, self.post_attention_layernorm)
        return h, self.mlp(z)


def _fusable(blk) -> bool:
    """The block may hand its MLP output on un-added (:meth:`Block.sublayers`): the family's own Block, not wrapped
    (activation checkpointing, FSDP units, loggers replace ``forward`` or the module and return the sum)."""
    return type(blk) is Block and "forward" not in blk.__dict__


class Llama(nn.Module):
    """Llama language model; ``forward(idx, targets=None, cache=None) -> (logits, loss)``.

    Without targets only the last position's logits are computed (generation). ``cache`` (a
    ``blumodels.generate.KVCache``) makes the call process ``idx`` as the positions after the cached ones; at the
    cache's device positions (one token per call) the RoPE angles are read at the device position, so the decode
    step holds no host value (``decode_on_device``: what ``blumodels.decode`` captures into a CUDA graph).
    """

    decode_on_device = True  # the cached forward reads positions through KVCache.rows / attend

    block_pattern = "layers.*"  # the repeated blocks (what train.activation_checkpointing recomputes)
    lean_logits = False  # CUDA training: the loss writes the logits' gradient over them (set by the Trainer)

    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        cfg.check()
        if cfg.family != "llama":
            raise ConfigError(f"Llama: model.family must be 'llama', got {cfg.family!r}")
        if cfg.vocab_size <= 0:
            raise ValueError("Llama: model.vocab_size must be set (> 0) before building the model")
        self.config = cfg
        self.embed_tokens = Embedding(cfg.padded_vocab_size, cfg.d_model, cfg.init_std, device)
        self.layers = nn.ModuleList([Block(cfg, device) for _ in range(cfg.n_layer)])
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.ln_eps, device=device)
        self.lm_head = None if cfg.tie_embeddings else \
            Linear(cfg.d_model, cfg.padded_vocab_size, cfg.init_std, False, device)

    @property
    def output_weight(self):
        """The (padded vocab, d_model) matrix of the logits: lm_head's, or the token embedding when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def rope(self, start: int, T: int, device):
        """cos/sin (T, head_dim/2) for positions start..start+T-1: views of a table built once per device (no
        host-to-device copy inside a step, which a captured CUDA graph would replay stale)."""
        cache = self.__dict__.setdefault("_rope_cache", {})
        key = str(device)
        tab = cache.get(key)
        if tab is None:
            c, s = rope_tables(self.config, self.config.block_size)
            tab = cache[key] = (bt.tensor(c, device=device), bt.tensor(s, device=device), {})
        if start == 0 and T == self.config.block_size:
            return tab[0], tab[1]
        views = tab[2]
        got = views.get((start, T))
        if got is None:
            got = views[(start, T)] = (tab[0][start:start + T], tab[1][start:start + T])
        return got

    def forward(self, idx, targets=None, cache=None):
        if idx.ndim != 2:
            raise ValueError(f"Llama: idx must be (batch, seq) token ids, got shape {tuple(idx.shape)}")
        B, T = idx.shape
        if targets is not None and tuple(targets.shape) != (B, T):
            raise ValueError(f"Llama: targets shape {tuple(targets.shape)} != idx shape {(B, T)}")
        if cache is not None and cache.on_device:  # one position, read on the device
            cos, sin = self.rope(0, self.config.block_size, idx.device)
            cos, sin = cache.rows(cos, T), cache.rows(sin, T)
        else:
            start = cache.pos if cache is not None else 0
            if start + T > self.config.block_size:
                raise ValueError(f"Llama: positions up to {start + T} exceed model.block_size="
                                 f"{self.config.block_size}")
            cos, sin = self.rope(start, T, idx.device)
        x = self.embed_tokens(idx)
        if self.config.dropout > 0:
            x = F.dropout(x, self.config.dropout, self.training)
        x = self._layers_and_norm(x, cos, sin, cache)
        if cache is not None:
            cache.advance(T)
        if targets is None:
            x = x[:, -1:, :]
        logits = F.linear(x, self.output_weight)
        loss = None
        if targets is not None:
            from blutensor import ext

            if self.lean_logits and logits.device.type == "cuda" and logits.requires_grad:
                loss = ext.apply("cross_entropy", logits.view(B * T, -1), targets.view(B * T), inplace_grad=True)
                return None, loss
            loss = F.cross_entropy(logits.view(B * T, -1), targets.view(B * T))
        return logits, loss

    def _layers_and_norm(self, x, cos, sin, cache):
        """norm(the blocks applied to x). Between two blocks the MLP's residual add and the next block's
        input_layernorm run as one ``F.add_rms_norm`` (and the last block's with the final norm); the first block's
        input_layernorm is a plain RMSNorm (no add before it). A wrapped block (checkpointing, FSDP) takes the
        residual stream and returns its output whole."""
        m = None  # the previous block's MLP output, not yet added into the residual stream x
        for i, blk in enumerate(self.layers):
            if not _fusable(blk):
                if m is not None:
                    x, m = x + m, None
                x = blk(x, cos, sin, cache, i)
                continue
            if m is None:
                y = blk.input_layernorm(x)
            else:
                x, y = _add_norm(m, x, blk.input_layernorm)
            x, m = blk.sublayers(x, y, cos, sin, cache, i)
        if m is None:
            return self.norm(x)
        return _add_norm(m, x, self.norm)[1]

    def num_params(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed_tokens.weight.numel() if non_embedding and self.lm_head is not None else n

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups: decay on 2-D weights (matmuls, embeddings), none on RMSNorm weights and biases."""
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 * (matmul parameters) + 12 * L * (n_head * head_dim) * T (attention)."""
        c = self.config
        n = self.num_params() - (self.embed_tokens.weight.numel() if self.lm_head is not None else 0)
        return 6.0 * n + 12.0 * c.n_layer * c.n_head * c.head_dim * seq_len


def count_params(cfg: ModelConfig) -> int:
    """Parameters of a Llama of this shape, without building it."""
    d, L, hd, Hk, h = cfg.d_model, cfg.n_layer, cfg.head_dim, kv_heads(cfg), ffn_hidden(cfg)
    attn = d * cfg.n_head * hd * 2 + d * Hk * hd * 2
    mlp = 3 * d * h
    bias = (cfg.n_head * hd + 2 * Hk * hd + d + 2 * h + d) if cfg.bias else 0
    emb = cfg.padded_vocab_size * d * (1 if cfg.tie_embeddings else 2)
    return emb + L * (attn + mlp + bias + 2 * d) + d


def build_model(cfg: ModelConfig, device: str | bt.device | None = None, seed: int | None = None) -> Llama:
    """A freshly initialised Llama on ``device``; ``seed`` seeds the default Philox generator first."""
    if seed is not None:
        bt.manual_seed(seed)
    return Llama(cfg, device=device)
