"""Errors raised by blutensor: each names the op and the shapes, dtypes or devices at fault."""


class BluTensorError(RuntimeError):
    """Base class of blutensor errors."""


class ShapeError(BluTensorError, ValueError):
    """Shapes do not fit an op (broadcasting, matmul inner dims, view sizes)."""


class DTypeError(BluTensorError, TypeError):
    """Operands of an op have unsupported or mismatched dtypes (or are not tensors where tensors are needed)."""


class DeviceError(BluTensorError):
    """Operands live on different devices, or a device is unavailable."""


class ArgumentError(BluTensorError, ValueError):
    """A non-tensor argument has a bad value: a negative size, a probability outside [0, 1], an unknown option."""


class AutogradError(BluTensorError):
    """Misuse of autograd: backward twice, no grad, modified saved tensors."""


def describe(t) -> str:
    """One-line description of a tensor or value for error messages."""
    shape = getattr(t, "shape", None)
    if shape is None:
        return repr(t)
    dt = getattr(t, "dtype", "?")
    dt = getattr(dt, "name", dt)
    dev = getattr(t, "device", "?")
    return f"Tensor(shape={tuple(shape)}, dtype={dt}, device={dev})"
