"""Gradient mode: ``no_grad``, ``enable_grad``, ``set_grad_enabled``, ``is_grad_enabled``."""

from __future__ import annotations

import functools
import threading


class _State(threading.local):
    enabled = True


STATE = _State()


def is_grad_enabled() -> bool:
    return STATE.enabled


class set_grad_enabled:  # noqa: N801 - PyTorch's name
    """Context manager (and decorator) that sets whether ops record the graph."""

    def __init__(self, mode: bool):
        self.prev = STATE.enabled
        self.mode = bool(mode)
        STATE.enabled = self.mode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        STATE.enabled = self.prev
        return False


class _GradCtx:
    mode = True

    def __enter__(self):
        self.prev = STATE.enabled
        STATE.enabled = self.mode
        return self

    def __exit__(self, *exc):
        STATE.enabled = self.prev
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self.__class__():
                return fn(*args, **kwargs)

        return wrapper


class no_grad(_GradCtx):  # noqa: N801
    """Ops inside record no graph (inference, optimizer updates)."""

    mode = False


class enable_grad(_GradCtx):  # noqa: N801
    """Ops inside record the graph even within ``no_grad``."""

    mode = True
