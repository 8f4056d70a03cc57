"""The run's execution policy: ONE ``bt.ExecutionPolicy`` built from the ``[train]`` table.

``train.precision`` (CUDA GEMM precision; 'bf16' also means bf16 autocast around forward + loss),
``train.fp32_gemm``, ``train.gemm`` (resolved to one registered provider on CUDA devices, checked against what it
declares) and ``train.deterministic`` become the policy's fields; every other field (attention and embedding
variants, index validation, ...) keeps what the surrounding policy says (the environment variables of
``docs/environment.md``, or a ``bt.policy.scope`` around the Trainer). The Trainer builds it once and runs its
work (set-up, steps, evaluation, sampling, checkpoints) inside ``policy.use()``: nothing is left changed in the
process after a method returns.
"""

from __future__ import annotations

from typing import Any

import blutensor as bt

from blumodels import gemm_choice


def policy_from_config(train: Any, device: str = "cpu") -> bt.ExecutionPolicy:
    """The execution policy of a run with train config ``train`` on ``device`` (based on ``bt.policy.current()``).

    On a CUDA device ``train.gemm`` ("auto" included: ``BLUTRAIN_GEMM``, else the documented order) is resolved to
    a provider now, so a missing, unavailable or
    misfitting one is a ConfigError naming ``train.gemm`` before any work; elsewhere a named provider is kept as
    named (host GEMMs use none)."""
    changes: dict[str, Any] = {"precision": train.precision, "fp32_gemm": train.fp32_gemm,
                               "deterministic": bool(train.deterministic)}
    prov = gemm_choice.resolve(train, device)
    if prov is not None:
        changes["gemm"] = prov.PLUGIN_NAME
    elif train.gemm != "auto":
        changes["gemm"] = gemm_choice.ALIASES.get(train.gemm, train.gemm)
    return bt.policy.current().replace(**changes)
