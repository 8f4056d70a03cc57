"""Deterministic algorithms on request, PyTorch's switch: ``bt.use_deterministic_algorithms(True)``.

Off by default, as in PyTorch: kernels may then take faster paths whose results vary in the last bits from run
to run (today: the fused flash-attention backward, which adds dQ with fp32 atomics). On, or with
``BLUTRAIN_DETERMINISTIC=1``, every kernel gives bitwise-repeatable results (bit-exact resume, fault-recovery
replays). The switch is the execution policy's ``deterministic`` field (:mod:`blutensor.policy`): the API call and
``bt.policy.scope(deterministic=...)`` win over the environment variable, which is read once.
"""

from __future__ import annotations

from blutensor import policy as _policy


def use_deterministic_algorithms(mode: bool) -> None:
    """Require bitwise-repeatable kernels (True) or allow faster nondeterministic ones (False, the default).
    Writes the execution policy's ``deterministic`` (the active scope's, else the process default)."""
    if not isinstance(mode, bool):
        raise TypeError(f"use_deterministic_algorithms expects a bool, got {type(mode).__name__}")
    _policy.update(deterministic=mode)


def are_deterministic_algorithms_enabled() -> bool:
    """True when deterministic kernels are required: the current execution policy's ``deterministic``
    (``use_deterministic_algorithms``, a policy scope, else ``BLUTRAIN_DETERMINISTIC`` read at first use)."""
    return _policy.current().deterministic
