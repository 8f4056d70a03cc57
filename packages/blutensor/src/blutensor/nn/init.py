"""Parameter initialisers (in place, no graph): normal_, uniform_, zeros_, ones_, constant_,
xavier_uniform_, kaiming_uniform_ — drawn from the Philox default generator."""

from __future__ import annotations

import math

from blutensor.autograd.grad_mode import no_grad


def _fans(t) -> tuple[int, int]:
    if t.ndim < 2:
        raise ValueError(f"fan in/out need a tensor with >= 2 dims, got shape {tuple(t.shape)}")
    rf = math.prod(t.shape[2:]) if t.ndim > 2 else 1
    return t.shape[1] * rf, t.shape[0] * rf


def normal_(t, mean: float = 0.0, std: float = 1.0, generator=None):
    with no_grad():
        return t.normal_(mean, std, generator=generator)


def uniform_(t, a: float = 0.0, b: float = 1.0, generator=None):
    with no_grad():
        return t.uniform_(a, b, generator=generator)


def zeros_(t):
    with no_grad():
        return t.fill_(0)


def ones_(t):
    with no_grad():
        return t.fill_(1)


def constant_(t, value: float):
    with no_grad():
        return t.fill_(value)


def xavier_uniform_(t, gain: float = 1.0, generator=None):
    fan_in, fan_out = _fans(t)
    a = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(t, -a, a, generator)


def kaiming_uniform_(t, a: float = 0.0, generator=None):
    fan_in, _ = _fans(t)
    gain = math.sqrt(2.0 / (1 + a * a))
    bound = gain * math.sqrt(3.0 / fan_in)
    return uniform_(t, -bound, bound, generator)
