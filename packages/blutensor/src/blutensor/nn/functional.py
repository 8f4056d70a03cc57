"""``blutensor.nn.functional``: the NN ops under PyTorch's names."""

from blutensor.functional import (  # noqa: F401
    cross_entropy,
    dropout,
    embedding,
    gelu,
    layer_norm,
    linear,
    log_softmax,
    relu,
    rms_norm,
    rope,
    scaled_dot_product_attention,
    sigmoid,
    silu,
    softmax,
    swiglu,
    tanh,
)
