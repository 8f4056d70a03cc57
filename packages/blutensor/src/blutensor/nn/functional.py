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
    scaled_dot_product_attention,
    sigmoid,
    softmax,
    tanh,
)
from blutensor.nn.loss_functions import (  # noqa: E402,F401
    binary_cross_entropy,
    binary_cross_entropy_with_logits,
    huber_loss,
    kl_div,
    l1_loss,
    mse_loss,
    nll_loss,
    smooth_l1_loss,
)
