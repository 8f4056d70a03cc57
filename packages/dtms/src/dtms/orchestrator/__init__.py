"""Orchestration and fault recovery: heartbeats, fault taxonomy, a persisted restart state machine,
Prometheus metrics, NVML telemetry and stack dumps (see the package README)."""

from .faults import (
    EXIT_BUDGET,
    EXIT_FATAL,
    EXIT_NO_PROGRESS,
    EXIT_OK,
    EXIT_PREEMPT_UNSAVED,
    EXIT_REQUEUE,
    CheckpointLoadError,
    FaultClass,
    Incident,
    NonFiniteError,
    classify_exception,
)
from .metrics import Metrics, MetricsServer
from .orchestrator import Orchestrator, OrchestratorConfig
from .state import RunState
from .telemetry import gpu_telemetry
from .worker import WorkerAgent

__all__ = [
    "EXIT_BUDGET", "EXIT_FATAL", "EXIT_NO_PROGRESS", "EXIT_OK", "EXIT_PREEMPT_UNSAVED", "EXIT_REQUEUE",
    "CheckpointLoadError",
    "FaultClass", "Incident", "NonFiniteError", "classify_exception", "Metrics", "MetricsServer",
    "Orchestrator", "OrchestratorConfig", "RunState", "gpu_telemetry", "WorkerAgent",
]
