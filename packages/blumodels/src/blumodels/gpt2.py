"""GPT-2: pre-LayerNorm decoder blocks, causal self-attention, tanh-GELU MLP, tied embeddings.

Initialisation follows GPT-2 / nanoGPT / llm.c: N(0, 0.02) for every weight and embedding, zero biases,
and N(0, 0.02/sqrt(2*n_layer)) for the two residual projections (attn.c_proj, mlp.c_proj). The logits are
computed over the vocabulary padded to a multiple of 64; padded rows are never targeted.
"""

from __future__ import annotations

import math

import blutensor as bt
import blutensor.nn.functional as F
from blutensor import ext, nn
from blutensor.autograd import Function
from blutensor.ext import sdpa_qkv

from blumodels.config import ModelConfig


class Linear(nn.Module):
    """y = x W^T + b with GPT-2's N(0, std) weight init (no wasted default init)."""

    def __init__(self, n_in: int, n_out: int, std: float, bias: bool = True, device=None):
        super().__init__()
        self.weight = nn.Parameter(bt.empty(n_out, n_in, device=device))
        nn.init.normal_(self.weight, 0.0, std)
        self.bias = nn.Parameter(bt.zeros(n_out, device=device)) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Lookup table initialised N(0, std)."""

    def __init__(self, n: int, dim: int, std: float, device=None):
        super().__init__()
        self.weight = nn.Parameter(bt.empty(n, dim, device=device))
        nn.init.normal_(self.weight, 0.0, std)

    def forward(self, idx):
        return F.embedding(idx, self.weight)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.n_head, self.d_model, self.dropout = cfg.n_head, cfg.d_model, cfg.dropout
        self.head_dim = cfg.d_model // cfg.n_head  # n_head may be cut by tensor parallelism; head_dim not
        resid_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
        self.c_attn = Linear(cfg.d_model, 3 * cfg.d_model, cfg.init_std, cfg.bias, device)
        self.c_proj = Linear(cfg.d_model, cfg.d_model, resid_std, cfg.bias, device)

    def forward(self, x):
        B, T, C = x.shape
        H = self.n_head
        p = self.dropout if self.training else 0.0
        # q, k, v read in place from the (B, T, 3, H, hd) projection and y written as (B, T, H*hd) on CUDA
        # (strided flash attention: no split or transpose copies); view/permute/contiguous + sdpa elsewhere
        y = sdpa_qkv(self.c_attn(x), H, is_causal=True, dropout_p=p)
        y = self.c_proj(y)
        return F.dropout(y, p, self.training) if p > 0 else y


class _GeluLinear(Function):
    """linear(gelu(u), w, b) saving only ``u`` for backward: the GELU output (4*d_model per token, the
    block's largest activation, which c_proj would save) is recomputed elementwise in backward. Gradients
    are bit-identical to gelu + linear: the same gelu kernel and the built-in linear backward formula (which
    adds the weight and bias gradients into their ``.grad`` buffers where the engine offers them)."""

    GRAD_INTO = True

    @staticmethod
    def forward(ctx, u, w, b):
        ctx.save_for_backward(u, w, b)
        return F.linear(F.gelu(u, approximate="tanh"), w, b)

    @staticmethod
    def backward(ctx, gy):
        from blutensor.ext import Ctx, linear_backward

        u, w, b = ctx.saved_tensors
        needs = ctx.needs_input_grad
        # the gelu kernel forward used, called directly: no nested autograd pass (its leaf-gradient copy of
        # an activation-sized buffer costs time in every block)
        # the CUDA kernel takes CuPy arrays only: a tracer's arrays (bt.compile) take the array-generic kernel,
        # whose array operations it records
        be = u.device.type if u.device.type != "cuda" or bt.ext.is_cuda_array(u._data) else "cpu"
        gelu = ext.kernel_for("gelu", be, u.dtype.name)
        gctx = Ctx()
        g = gelu.forward(gctx, u._data, approximate="tanh")  # the recompute: one elementwise kernel
        lin = Ctx()
        lin.saved = (g.reshape(-1, g.shape[-1]), w._data, tuple(g.shape))
        lin.needs = (bool(needs[0]), bool(needs[1]), b is not None and bool(needs[2]))
        into = getattr(ctx, "grad_into", None)
        if into is not None:
            lin.grad_into = (None, into[1], into[2])
        gx, gw, gb = linear_backward(lin, gy._data)
        del g, lin  # the recomputed activation is dead before the gelu backward allocates
        gu = gelu.backward(gctx, gx)[0] if gx is not None else None
        return gu, gw, gb


class _GeluMLP(Function):
    """c_proj(gelu_tanh(c_fc(x))) as one op whose GEMMs carry the GELU (``blutensor.ext.gelu_mlp_forward`` /
    ``gelu_mlp_backward``): c_fc is one GEMM whose epilogue adds the bias, applies GELU and writes the pre-activation;
    in backward c_proj's input-gradient GEMM multiplies by GELU's derivative in its epilogue and writes c_fc's bias
    gradient. No separate GELU kernel either way; a piece the GEMM provider does not fuse runs the kernels the
    unfused ops run. Like ``_GeluLinear``, float32 saves the pre-activation only (the GELU output is recomputed in
    backward); bf16 saves the GELU output too, as c_proj's input. Weight and bias gradients are added into the
    ``.grad`` buffers the engine offers, through autocast's weight casts too."""

    GRAD_INTO = True

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2):
        y = ext.gelu_mlp_forward(ctx, x._data, w1._data, None if b1 is None else b1._data, w2._data,
                                 None if b2 is None else b2._data)
        return bt.Tensor._from_data(y, x.dtype, x.device)

    @staticmethod
    def backward(ctx, gy):
        return ext.gelu_mlp_backward(ctx, gy._data)


#: the dtypes whose MLP takes :class:`_GeluMLP` (given a provider that fuses): bf16 only. For float32 (fp32 and tf32
#: GEMMs) cuBLASLt 13 on the H200 runs one of the GELU epilogues as a separate epilogue kernel (0.38 ms a call at
#: GPT-2 124M's shape, slower than the elementwise GELU kernels it replaces: step_profile_fused_mlp_h200.json)
FUSED_MLP_DTYPES = (bt.bfloat16,)


def _plain_linear(m) -> bool:
    """``m`` is GPT-2's own ``Linear`` with its own forward (not a tensor-parallel or plugin replacement, not a
    wrapped forward): its computation may be fused with its neighbours'."""
    return type(m) is Linear and "forward" not in m.__dict__


def _fused_mlp_inputs(mlp, x):
    """(x, c_fc.weight, c_fc.bias, c_proj.weight, c_proj.bias) as :class:`_GeluMLP` takes them (under autocast the
    bf16 casts c_fc's linear would get), or None where the modules run as they are: a replaced module, arrays other
    than CuPy's (CPU, a tracer's under ``bt.compile``), mixed dtypes, a GEMM provider that does not fuse GELU."""
    fc, proj = mlp.c_fc, mlp.c_proj
    if not (_plain_linear(fc) and _plain_linear(proj)) or not ext.is_cuda_array(x._data):
        return None
    args = (x, fc.weight, fc.bias, proj.weight, proj.bias)
    if ext.autocast_active():
        args = ext.autocast_lower(*args)
    dtypes = {a.dtype for a in args if a is not None}
    if len(dtypes) != 1 or dtypes.pop() not in FUSED_MLP_DTYPES:
        return None
    return args if ext.gelu_gemm_provider(args[0]._data) is not None else None


def _lean_ok(u, proj) -> bool:
    """The fused GELU + c_proj path: fp32 outside autocast (bf16 paths keep the generic ops), and only while
    ``proj`` is GPT-2's own ``Linear``: a module that replaced it (tensor-parallel row-parallel linear, a
    plugin's layer) keeps its own forward (and its communication)."""
    return (type(proj) is Linear and u.dtype == bt.float32 and proj.weight.dtype == bt.float32
            and not ext.autocast_active())


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        resid_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
        self.dropout = cfg.dropout
        self.c_fc = Linear(cfg.d_model, 4 * cfg.d_model, cfg.init_std, cfg.bias, device)
        self.c_proj = Linear(4 * cfg.d_model, cfg.d_model, resid_std, cfg.bias, device)

    def forward(self, x):
        args = _fused_mlp_inputs(self, x)
        if args is not None:  # CUDA: the GELU in the GEMM epilogues, forward and backward
            y = _GeluMLP.apply(*args)
        else:
            u = self.c_fc(x)
            if _lean_ok(u, self.c_proj):  # saves u only, not gelu(u) too (4*d floats per token less)
                y = _GeluLinear.apply(u, self.c_proj.weight, self.c_proj.bias)
            else:
                y = self.c_proj(F.gelu(u, approximate="tanh"))
        return F.dropout(y, self.dropout, self.training) if self.dropout > 0 else y


def _plain_norm(m) -> bool:
    """``m`` is blutensor's own LayerNorm with its own forward (not wrapped by a logger, not replaced by a plugin's
    layer): its add before it may be fused into ``F.add_layer_norm`` (same parameters, same values)."""
    return type(m) is nn.LayerNorm and "forward" not in m.__dict__


def _add_norm(a, x, norm):
    """(x + a, norm(x + a)): one fused op (``F.add_layer_norm``: under autocast the normalised output comes out
    in the GEMM dtype) when ``norm`` is a plain LayerNorm, else the add and the module's own call."""
    if _plain_norm(norm):
        return F.add_layer_norm(a, x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
    h = x + a
    return h, norm(h)


class Block(nn.Module):
    """x + attn(ln_1(x)), then + mlp(ln_2(.)) (pre-LayerNorm).

    The attention's residual add and ln_2 are one fused op (``F.add_layer_norm``: one pass over the rows each
    way, the new residual stream and ln_2's output, bf16 under autocast, written together). :meth:`sublayers`
    stops before the MLP's residual add, so that :class:`GPT2` fuses that add with the next block's ln_1 (or
    ln_f); ``forward`` (one tensor in, one out: what activation checkpointing, FSDP units and module wrappers
    call) adds it itself. Both give the same values, bit for bit."""

    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, bias=cfg.bias, device=device)
        self.attn = CausalSelfAttention(cfg, device)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, bias=cfg.bias, device=device)
        self.mlp = MLP(cfg, device)

    def forward(self, x):
        h, m = self.sublayers(x, self.ln_1(x))
        return h + m

    def sublayers(self, x, y):
        """(h, m) for the residual stream ``x`` and ``y = ln_1(x)``: h = x + attn(y), m = mlp(ln_2(h)); the
        block's output is h + m (left to the caller, to fuse with the norm that follows)."""
        h, z = _add_norm(self.attn(y), x, self.ln_2)
        return h, self.mlp(z)


def _fusable(blk) -> bool:
    """The block may hand its MLP output on un-added (:meth:`Block.sublayers`): GPT-2's own Block, not wrapped
    (activation checkpointing, FSDP units, loggers replace ``forward`` or the module and take one tensor)."""
    return type(blk) is Block and "forward" not in blk.__dict__


class GPT2(nn.Module):
    """GPT-2 language model; ``forward(idx, targets=None) -> (logits, loss)``.

    ``lm_head`` is ``F.linear(x, wte.weight)``: the tied matrix is one Parameter, listed once.
    """

    #: training with targets on CUDA: let the loss overwrite the logits with their gradient (returns None
    #: for the logits); set by the Trainer and the memory benchmark, off by default
    lean_logits = False

    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        cfg.check()  # a ModelConfig built by hand gets the same checks as a loaded one
        if cfg.vocab_size <= 0:
            raise ValueError("GPT2: model.vocab_size must be set (> 0) before building the model")
        self.config = cfg
        Vp = cfg.padded_vocab_size
        self.wte = Embedding(Vp, cfg.d_model, cfg.init_std, device)
        self.wpe = Embedding(cfg.block_size, cfg.d_model, cfg.init_std, device)
        self.blocks = nn.ModuleList([Block(cfg, device) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, bias=cfg.bias, device=device)

    def forward(self, idx, targets=None):
        if idx.ndim != 2:
            raise ValueError(f"GPT2: idx must be (batch, seq) token ids, got shape {tuple(idx.shape)}")
        B, T = idx.shape
        if targets is not None and tuple(targets.shape) != (B, T):
            raise ValueError(f"GPT2: targets shape {tuple(targets.shape)} != idx shape {(B, T)}")
        if T > self.config.block_size:
            raise ValueError(f"GPT2: sequence length {T} exceeds model.block_size={self.config.block_size}")
        pos = self._positions(T, idx.device)
        x = self.wte(idx) + self.wpe(pos)
        if self.config.dropout > 0:
            x = F.dropout(x, self.config.dropout, self.training)
        x = self._blocks_and_ln_f(x)
        if targets is None:
            x = x[:, -1:, :]  # generation needs only the last position
        logits = F.linear(x, self.wte.weight)  # (B, T, Vp): tied lm_head
        loss = None
        if targets is not None:
            if self.lean_logits and logits.device.type == "cuda" and logits.requires_grad:
                # the fused CUDA loss writes d(loss)/d(logits) over the logits: no second (B*T, Vp) buffer;
                # the logits are then gone, so None is returned for them
                loss = ext.apply("cross_entropy", logits.view(B * T, -1), targets.view(B * T), inplace_grad=True)
                return None, loss
            loss = F.cross_entropy(logits.view(B * T, -1), targets.view(B * T))
        return logits, loss

    def _blocks_and_ln_f(self, x):
        """ln_f(the blocks applied to x). Between two blocks the MLP's residual add and the next block's ln_1 run
        as one ``F.add_layer_norm`` (and the last block's with ln_f); the first block's ln_1 is a plain LayerNorm
        (no add before it). A wrapped block (checkpointing, FSDP) takes the residual stream as one tensor."""
        m = None  # the previous block's MLP output, not yet added into the residual stream x
        for blk in self.blocks:
            if not _fusable(blk):
                if m is not None:
                    x, m = x + m, None
                x = blk(x)
                continue
            if m is None:
                y = blk.ln_1(x)
            else:
                x, y = _add_norm(m, x, blk.ln_1)
            x, m = blk.sublayers(x, y)
        if m is None:
            return self.ln_f(x)
        return _add_norm(m, x, self.ln_f)[1]

    def _positions(self, T: int, device):
        """0..T-1 on ``device``, made once per (T, device): no host-to-device copy in the step (a copy from a
        host staging buffer inside a captured CUDA graph would replay stale memory)."""
        cache = self.__dict__.setdefault("_pos_cache", {})
        key = (T, str(device))
        pos = cache.get(key)
        if pos is None:
            pos = cache[key] = bt.arange(T, dtype=bt.int64, device=device)
        return pos

    def num_params(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups: decay on 2-D weights (matmuls, embeddings), none on biases and LayerNorm."""
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6*N (matmuls fwd+bwd) + 12*L*d*T (attention scores and values)."""
        c = self.config
        n = self.num_params() - self.wpe.weight.numel()
        return 6.0 * n + 12.0 * c.n_layer * c.d_model * seq_len


def count_params(cfg: ModelConfig) -> int:
    """Parameters of a GPT2 of this shape (tied embedding counted once), without building it."""
    d, L = cfg.d_model, cfg.n_layer
    per_block = 12 * d * d + (13 * d if cfg.bias else 2 * d)
    return cfg.padded_vocab_size * d + cfg.block_size * d + L * per_block + (2 * d if cfg.bias else d)


def build_model(cfg: ModelConfig, device: str | bt.device | None = None, seed: int | None = None) -> GPT2:
    """A freshly initialised GPT2 on ``device``; ``seed`` seeds the default Philox generator first."""
    if seed is not None:
        bt.manual_seed(seed)
    return GPT2(cfg, device=device)


def from_hf(directory: str, device: str | bt.device | None = None) -> GPT2:
    """A GPT2 holding the weights of a local Hugging Face GPT-2 directory (config.json + model.safetensors, as
    ``GPT2LMHeadModel.save_pretrained`` writes); nothing is downloaded. See :mod:`blumodels.hf`."""
    from blumodels.hf import hf_model_config, load_into

    model = GPT2(hf_model_config(directory), device=device)
    load_into(model, directory)
    return model
