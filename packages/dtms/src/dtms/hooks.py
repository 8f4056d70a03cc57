"""dtms plugins for the ``blutrain`` host: the parallel strategies, registered like any third party's."""

from __future__ import annotations

import pluggy

hookimpl = pluggy.HookimplMarker("blutrain")


class _Strategy:
    """A parallel strategy: ``apply(model, **options)`` returns the wrapped/sharded model."""

    PLUGIN_NAME = ""

    @classmethod
    def is_available(cls) -> bool:
        return True


class DDPStrategy(_Strategy):
    """Data parallel (bucketed, overlapped, no sync during accumulation)."""

    PLUGIN_NAME = "ddp"

    @staticmethod
    def apply(model, **options):
        from dtms.parallel import DDP

        return DDP(model, **options)


class FSDPStrategy(_Strategy):
    """ZeRO-3: parameters, gradients and optimizer state sharded over the data-parallel group."""

    PLUGIN_NAME = "fsdp"

    @staticmethod
    def apply(model, **options):
        from dtms.parallel import FSDP

        return FSDP(model, **options)


class TensorParallelStrategy(_Strategy):
    """Megatron-style tensor parallelism (GPT-2 plan by default), optionally async-chunked."""

    PLUGIN_NAME = "tp"

    @staticmethod
    def apply(model, group, **options):
        from dtms.parallel import apply_tensor_parallel

        apply_tensor_parallel(model, group, **options)
        return model


class ContextParallelStrategy(_Strategy):
    """Ring attention over the sequence with a p2p, all-gather or all-to-all rotator."""

    PLUGIN_NAME = "cp"

    @staticmethod
    def apply(model, group, rotator: str = "p2p", **options):
        from dtms.parallel import apply_context_parallel

        pos = getattr(getattr(model, "wpe", None), "weight", None)
        apply_context_parallel(group, rotator, pos)
        return model


class MeshStrategy(_Strategy):
    """dp x cp x tp (optionally FSDP) from a ``ParallelDims``: ``dtms.parallel.parallelize``."""

    PLUGIN_NAME = "mesh"

    @staticmethod
    def apply(model, dims, **options):
        from dtms.parallel import parallelize

        return parallelize(model, dims, **options)


@hookimpl
def blutrain_register_parallel_strategies() -> list[type]:
    return [DDPStrategy, FSDPStrategy, TensorParallelStrategy, ContextParallelStrategy, MeshStrategy]


# --- orchestration (dtms.orchestrator): trainers that call the step/checkpoint hooks report progress
@hookimpl
def blutrain_on_step_end(step: int, metrics: dict) -> None:
    """Under ``dtms.orchestrate``: heartbeat progress (step, loss, tokens/s) of any trainer calling this hook."""
    from dtms.orchestrator.worker import current_agent

    agent = current_agent()
    if agent is not None:
        agent.step_done(step + 1, **{k: v for k, v in metrics.items()
                                     if k in ("loss", "tokens_per_s") and isinstance(v, int | float)})


@hookimpl
def blutrain_on_checkpoint_saved(path: str, step: int) -> None:
    """Under ``dtms.orchestrate``: the checkpoint of ``step`` is durable on this rank."""
    from dtms.orchestrator.worker import current_agent

    agent = current_agent()
    if agent is not None:
        agent.checkpoint_committed(step)
