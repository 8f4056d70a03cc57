"""The llama family's parallel plan (``llama_plan``, what the Trainer applies for a ``[parallel]`` layout through
the family plugin) and ``parallelize_llama``, which applies TP, then CP, then FSDP or DDP, from outside the
model through ``dtms.parallel``.

Tensor parallelism splits q/k/v, gate and up column-wise and o/down row-wise; each rank keeps n_head/tp query
heads and n_kv_heads/tp key/value heads (rank r's query heads use exactly rank r's key/value heads, so grouped
attention needs no communication). A tied token embedding is split over the vocabulary (vocab-parallel
embedding, logits and cross-entropy); an untied lm_head and the embedding stay replicated. Context parallelism
gives every ``rope`` op the rotary table rows of the local tokens' global positions (the load-balanced causal
chunks), from the model's full-length tables.
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
    "layers.*.self_attn": ("heads", {"attrs": ("n_head", "n_kv_heads")}),
}


def tp_plan(model) -> dict[str, tuple[str, dict]]:
    """LLAMA_PLAN, plus the vocabulary split of the embedding when lm_head is tied to it."""
    plan = dict(LLAMA_PLAN)
    if model.lm_head is None:
        plan["embed_tokens"] = ("vocab", {})
    return plan


def llama_plan(model) -> Any:
    """The ``dtms.parallel.ParallelPlan`` of a built Llama: TP styles (heads and key/value heads divided by tp),
    the FSDP units (one per decoder layer) and the full-length rotary tables context parallelism re-indexes."""
    from dtms.parallel import ParallelPlan

    from blumodels.llama.model import ffn_hidden, kv_heads

    c = model.config
    return ParallelPlan(tp=tp_plan(model), fsdp_units="layers.*",
                        rotary=lambda device: model.rope(0, c.block_size, device),
                        shape_checks={"n_head": c.n_head, "vocab_size": c.padded_vocab_size, "n_kv_heads": kv_heads(c),
                                      "ffn_hidden": ffn_hidden(c)})


def parallelize_llama(model, dims, **kwargs: Any):
    """``dtms.parallel.parallelize`` with :func:`llama_plan` (TP, then CP, then FSDP or DDP)."""
    from dtms.parallel import parallelize

    return parallelize(model, dims, plan=llama_plan(model), **kwargs)
