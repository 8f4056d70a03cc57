"""``ParallelPlan``: what a model tells the parallel strategies about itself.

dtms knows no model: the tensor-parallel plan (module-name pattern -> style), the FSDP unit pattern,
the positional embedding that context parallelism re-indexes, and the shapes the mesh is checked
against come from the model's package (blumodels keeps GPT-2's in ``blumodels.gpt2_parallelize``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: tensor-parallel styles a plan may name
TP_STYLES = ("colwise", "rowwise", "heads", "vocab")


@dataclass
class ParallelPlan:
    """How to shard one model.

    ``tp``: module-name pattern (fnmatch) -> (style, options); styles: ``colwise`` (output features split;
    ``chunks`` for a fused weight of stacked parts, e.g. QKV), ``rowwise`` (input features split, outputs
    all-reduced), ``heads`` (an attention module's head counts divided by tp; option ``attrs``: which, default
    ``("n_head",)``, ``("n_head", "n_kv_heads")`` for grouped-query attention), ``vocab`` (an embedding tied
    to the LM head, split on the vocabulary). ``fsdp_units``: submodules that become FSDP units.
    ``position_weight``: the positional embedding's weight (context parallelism gives it the global
    positions of the local tokens). ``rotary``: for rotary position embeddings, a function of a device
    returning the full-length (cos, sin) tables (positions 0..N-1, N >= the sequence length); context
    parallelism gives each ``rope`` op the table rows of the local tokens' global positions.
    ``shape_checks``: sizes the mesh must divide (``n_head``, ``n_kv_heads``, ``d_model`` (a 4*d_model MLP),
    ``ffn_hidden``, ``vocab_size``), checked before any communication.
    """

    tp: dict[str, tuple[str, dict]] = field(default_factory=dict)
    fsdp_units: str = "blocks.*"
    position_weight: Any = None
    rotary: Any = None
    shape_checks: dict[str, int] = field(default_factory=dict)

    def check(self) -> ParallelPlan:
        for pat, entry in self.tp.items():
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], dict)):
                raise ValueError(f"parallel plan: tp[{pat!r}] must be (style, options), got {entry!r}")
            if entry[0] not in TP_STYLES:
                raise ValueError(f"parallel plan: unknown tensor-parallel style {entry[0]!r} for {pat!r} "
                                 f"(styles: {', '.join(TP_STYLES)})")
        return self
