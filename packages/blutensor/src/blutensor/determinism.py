"""Deterministic algorithms on request, PyTorch's switch: ``bt.use_deterministic_algorithms(True)``.

Off by default, as in PyTorch: kernels may then take faster paths whose results vary in the last bits from run
to run (today: the fused flash-attention backward, which adds dQ with fp32 atomics). On, or with
``BLUTRAIN_DETERMINISTIC=1``, every kernel gives bitwise-repeatable results (bit-exact resume, fault-recovery
replays). The API call wins over the environment variable.
"""

from __future__ import annotations

import os

_STATE: dict[str, bool | None] = {"on": None}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def use_deterministic_algorithms(mode: bool) -> None:
    """Require bitwise-repeatable kernels (True) or allow faster nondeterministic ones (False, the default)."""
    if not isinstance(mode, bool):
        raise TypeError(f"use_deterministic_algorithms expects a bool, got {type(mode).__name__}")
    _STATE["on"] = mode


def are_deterministic_algorithms_enabled() -> bool:
    """True when deterministic kernels are required (API call, else BLUTRAIN_DETERMINISTIC)."""
    if _STATE["on"] is not None:
        return bool(_STATE["on"])
    env = os.environ.get("BLUTRAIN_DETERMINISTIC", "").strip().lower()
    if env in _TRUE:
        return True
    if env in _FALSE:
        return False
    raise ValueError(f"BLUTRAIN_DETERMINISTIC must be 0 or 1, got {env!r}")


def _reset() -> None:
    """Forget the API setting (tests): the environment variable decides again."""
    _STATE["on"] = None
