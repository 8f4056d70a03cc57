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
    """Megatron-style tensor parallelism following ``plan`` (module pattern -> style), optionally async-chunked."""

    PLUGIN_NAME = "tp"

    @staticmethod
    def apply(model, group, plan, **options):
        from dtms.parallel import apply_tensor_parallel

        apply_tensor_parallel(model, group, getattr(plan, "tp", plan), **options)
        return model


class ContextParallelStrategy(_Strategy):
    """Ring attention over the sequence with a p2p, all-gather or all-to-all rotator."""

    PLUGIN_NAME = "cp"

    @staticmethod
    def apply(model, group, rotator: str = "p2p", position_weight=None, **options):
        from dtms.parallel import apply_context_parallel

        apply_context_parallel(group, rotator, position_weight)
        return model


class MeshStrategy(_Strategy):
    """dp x cp x tp (FSDP or DDP over dp x cp) from a ``ParallelDims`` and the model's ``ParallelPlan``, in
    torchtitan's order (TP, CP, then FSDP/DDP): ``dtms.parallel.parallelize``. What the Trainer applies."""

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


@hookimpl
def blutrain_on_train_end(status: str, step: int, error: BaseException | None) -> None:
    """Under ``dtms.orchestrate``: a failed run reports its classified fault (a NaN under nan_policy 'stop', bad
    data or config is fatal; MemoryError is OOM), a finished or preempted one its clean end ('ok'/'preempted')."""
    from dtms.orchestrator.faults import exception_incident
    from dtms.orchestrator.worker import current_agent

    agent = current_agent()
    if agent is None:
        return
    if error is not None:
        if isinstance(error, SystemExit | KeyboardInterrupt):
            return
        agent.fault(exception_incident(error, agent.rank, agent.attempt, step))
        agent.stop_heartbeat()
    else:
        agent.finish(status, step)
