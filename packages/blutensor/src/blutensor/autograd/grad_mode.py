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
        if mode is None or isinstance(mode, str | bytes):
            from blutensor.errors import DTypeError

            raise DTypeError(f"set_grad_enabled: mode must be a bool, got {type(mode).__name__} {mode!r}")
        self.prev = STATE.enabled
        self.mode = bool(mode)
        STATE.enabled = self.mode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        STATE.enabled = self.prev
        return False


class _GradCtxType(type):
    """``with no_grad:`` (the class, not an instance) fails with a message that says what to write."""

    def __enter__(cls):
        from blutensor.errors import AutogradError

        raise AutogradError(f"'with {cls.__name__}:' needs parentheses: write 'with {cls.__name__}():'")

    def __exit__(cls, *exc):
        return False


class _GradCtx(metaclass=_GradCtxType):
    mode = True

    def __new__(cls, orig_func=None):
        """``@no_grad`` without parentheses decorates ``orig_func`` directly (as PyTorch allows)."""
        self = super().__new__(cls)
        if orig_func is None:
            return self
        if not callable(orig_func):
            from blutensor.errors import DTypeError

            raise DTypeError(f"{cls.__name__}() takes no arguments (or a function to decorate), got "
                             f"{type(orig_func).__name__}")
        return self(orig_func)

    def __init__(self, orig_func=None):
        pass

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


class _InferenceState(threading.local):
    enabled = False


_INFERENCE = _InferenceState()


class inference_mode:  # noqa: N801 - PyTorch's name
    """``with inference_mode():`` / ``@inference_mode()`` / ``@inference_mode``: ops record no graph, as in
    ``no_grad`` (blutensor has no separate inference tensors, so the two differ only in name);
    ``inference_mode(False)`` leaves the grad mode as it is, as PyTorch's does."""

    def __new__(cls, mode=True):
        self = super().__new__(cls)
        if callable(mode) and not isinstance(mode, bool):  # @inference_mode without parentheses
            self.mode = True
            return self(mode)
        return self

    def __init__(self, mode: bool = True):
        if callable(mode) and not isinstance(mode, bool):
            return
        if not isinstance(mode, bool):
            from blutensor.errors import DTypeError

            raise DTypeError(f"inference_mode: mode must be a bool, got {type(mode).__name__} {mode!r:.40}")
        self.mode = mode

    def __enter__(self):
        self.prev = STATE.enabled, _INFERENCE.enabled
        if self.mode:
            STATE.enabled, _INFERENCE.enabled = False, True
        return self

    def __exit__(self, *exc):
        STATE.enabled, _INFERENCE.enabled = self.prev
        return False

    def __call__(self, fn):
        mode = self.mode

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with inference_mode(mode):
                return fn(*args, **kwargs)

        return wrapper


def is_inference_mode_enabled() -> bool:
    """True inside an active ``inference_mode()`` region."""
    return _INFERENCE.enabled
