"""GPT-2's parallel plan: which modules tensor parallelism splits, which are FSDP units, which weight is
the positional embedding, and the sizes the mesh must divide. Kept beside the model it describes;
dtms applies it (``dtms.parallel.parallelize``) without knowing GPT-2.
"""

from __future__ import annotations

from typing import Any

#: tensor-parallel plan: module-name pattern -> (style, options) (Megatron-LM's split of a GPT block:
#: QKV and MLP-up column-parallel, the projections after them row-parallel, heads divided by tp, and the
#: tied token embedding / LM head split on the vocabulary)
TP_PLAN: dict[str, tuple[str, dict]] = {
    "blocks.*.attn.c_attn": ("colwise", {"chunks": 3}),
    "blocks.*.attn.c_proj": ("rowwise", {}),
    "blocks.*.mlp.c_fc": ("colwise", {}),
    "blocks.*.mlp.c_proj": ("rowwise", {}),
    "blocks.*.attn": ("heads", {}),
    "wte": ("vocab", {}),
}

#: the FSDP units: one per transformer block
FSDP_UNITS = "blocks.*"


def gpt2_plan(model: Any) -> Any:
    """The ``dtms.parallel.ParallelPlan`` of a built GPT2 (needs dtms: ``pip install 'blumodels[dist]'``)."""
    from dtms.parallel import ParallelPlan

    c = model.config
    return ParallelPlan(tp=dict(TP_PLAN), fsdp_units=FSDP_UNITS, position_weight=model.wpe.weight,
                        shape_checks={"n_head": c.n_head, "d_model": c.d_model,
                                      "vocab_size": c.padded_vocab_size})


def decay_key(p: Any) -> bool:
    """AdamW's split (as GPT2.param_groups): True for 2-D weights (decayed), False for biases/LayerNorms."""
    return p.ndim >= 2
