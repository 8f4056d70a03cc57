"""dtms plugins for the ``blutrain`` host. Parallel strategies (DDP, FSDP, TP, CP) will register here."""

from __future__ import annotations

import pluggy

hookimpl = pluggy.HookimplMarker("blutrain")


@hookimpl
def blutrain_register_parallel_strategies() -> list[type]:
    """No strategies yet: the communication substrate registers none of its own."""
    return []
