"""The llama family's parallel plan: tensor-parallel styles per module-name pattern (dtms' plan format) and
``parallelize_llama``, which applies TP, then FSDP or DDP, from outside the model through ``dtms.parallel``.

Tensor parallelism splits q/k/v, gate and up column-wise and o/down row-wise; each rank keeps n_head/tp query
heads and n_kv_heads/tp key/value heads (rank r's query heads use exactly rank r's key/value heads, so grouped
attention needs no communication). A tied token embedding is split over the vocabulary (vocab-parallel
embedding, logits and cross-entropy); an untied lm_head and the embedding stay replicated.
"""

from __future__ import annotations

from typing import Any

#: Llama's tensor-parallel plan: module-name pattern -> (style, options)
LLAMA_PLAN = {
    "layers.*.self_attn.q_proj": ("colwise", {}),
    "layers.*.self_attn.k_proj": ("colwise", {}),
    "layers.*.self_attn.v_proj": ("colwise", {}),
    "layers.*.self_attn.o_proj": ("rowwise", {}),
    "layers.*.mlp.gate_proj": ("colwise", {}),
    "layers.*.mlp.up_proj": ("colwise", {}),
    "layers.*.mlp.down_proj": ("rowwise", {}),
}


def tp_plan(model) -> dict[str, tuple[str, dict]]:
    """LLAMA_PLAN, plus the vocabulary split of the embedding when lm_head is tied to it."""
    plan = dict(LLAMA_PLAN)
    if model.lm_head is None:
        plan["embed_tokens"] = ("vocab", {})
    return plan


def llama_plan(model) -> Any:
    """The ``dtms.parallel.ParallelPlan`` of a built Llama (heads are divided by :func:`parallelize_llama`, which
    also cuts the key/value heads of grouped attention)."""
    from dtms.parallel import ParallelPlan

    c = model.config
    return ParallelPlan(tp=tp_plan(model), fsdp_units="layers.*",
                        shape_checks={"n_head": c.n_head, "d_model": c.d_model, "vocab_size": c.padded_vocab_size})


def parallelize_llama(model, dims, **kwargs: Any):
    """``dtms.parallel.parallelize`` with the llama plan; the heads of every attention are cut for TP.

    Context parallelism is refused: its sequence shards would need their own rotary positions.
    """
    from dtms.parallel import parallelize
    from dtms.parallel.mesh import MeshError

    from blumodels.llama.model import Attention, ffn_hidden

    cfg = model.config
    if dims.cp > 1:
        raise MeshError(f"llama: context parallelism (cp={dims.cp}) is not supported: each sequence shard would need "
                        "its own rotary positions; use tp, fsdp or dp")
    kv = cfg.n_kv_heads or cfg.n_head
    if dims.tp > 1 and (cfg.n_head % dims.tp or kv % dims.tp or ffn_hidden(cfg) % dims.tp):
        raise MeshError(f"llama: tp={dims.tp} must divide model.n_head={cfg.n_head}, the key/value heads ({kv}) and "
                        f"the SwiGLU width ({ffn_hidden(cfg)})")
    plan = llama_plan(model)
    par = parallelize(model, dims, plan=plan, **kwargs)
    if dims.tp > 1:
        for m in model.modules():
            if isinstance(m, Attention):
                m.n_head //= dims.tp
                m.n_kv_heads //= dims.tp
    return par
