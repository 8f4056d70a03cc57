"""A CPU relu kernel registered through the `blutrain` entry point; counts calls so tests can see it."""

import numpy as np
import pluggy

hookimpl = pluggy.HookimplMarker("blutrain")
CALLS = {"forward": 0, "backward": 0}


class ExampleRelu:
    """relu = max(x, 0) on NumPy arrays, with the same signature as blutensor's built-in."""

    PLUGIN_NAME = "example.relu"
    OP = "relu"
    BACKEND = "cpu"
    DTYPES = ("float32", "float64")
    PRIORITY = 0  # never chosen unless configured
    SAVES = ()
    SAVES_OUTPUT = False
    SAME_DTYPE = ()
    DTYPE_ARG = 0
    VIEW = False
    DIFFERENTIABLE = True
    BF16_NATIVE = False

    @staticmethod
    def forward(ctx, a):
        CALLS["forward"] += 1
        ctx.saved = a > 0
        return np.maximum(a, 0).astype(a.dtype)

    @staticmethod
    def backward(ctx, g):
        CALLS["backward"] += 1
        return (g * ctx.saved,)


@hookimpl
def blutrain_register_kernels():
    return [ExampleRelu]
