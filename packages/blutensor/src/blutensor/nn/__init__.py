"""Neural-network modules: Module, Parameter, layers, activations, losses, conv/pool, init, utils and
functional."""

from blutensor.nn import functional, init, utils
from blutensor.nn.activation import (
    CELU,
    ELU,
    GLU,
    SELU,
    Hardsigmoid,
    Hardswish,
    Hardtanh,
    LeakyReLU,
    LogSigmoid,
    LogSoftmax,
    Mish,
    ReLU6,
    Sigmoid,
    SiLU,
    Softmax,
    Softmin,
    Softplus,
    Softsign,
    Tanh,
    Tanhshrink,
)
from blutensor.nn.basic import Flatten, Identity, ParameterDict, ParameterList, Unflatten
from blutensor.nn.conv import AvgPool1d, AvgPool2d, Conv1d, Conv2d, MaxPool1d, MaxPool2d
from blutensor.nn.layers import (
    GELU,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    ModuleDict,
    ModuleList,
    ReLU,
    RMSNorm,
    Sequential,
)
from blutensor.nn.loss import (
    BCELoss,
    BCEWithLogitsLoss,
    CrossEntropyLoss,
    HuberLoss,
    KLDivLoss,
    L1Loss,
    MSELoss,
    NLLLoss,
    SmoothL1Loss,
)
from blutensor.nn.module import Module
from blutensor.nn.parameter import Parameter

__all__ = ["CELU", "ELU", "GELU", "GLU", "SELU", "AvgPool1d", "AvgPool2d", "BCELoss", "BCEWithLogitsLoss", "Conv1d",
           "Conv2d", "CrossEntropyLoss", "Dropout", "Embedding", "Flatten", "Hardsigmoid", "Hardswish", "Hardtanh",
           "HuberLoss", "Identity", "KLDivLoss", "L1Loss", "LayerNorm", "LeakyReLU", "Linear", "LogSigmoid",
           "LogSoftmax", "MSELoss", "MaxPool1d", "MaxPool2d", "Mish", "Module", "ModuleDict", "ModuleList",
           "NLLLoss", "Parameter", "ParameterDict", "ParameterList", "RMSNorm", "ReLU", "ReLU6", "SiLU", "Sequential",
           "Sigmoid", "SmoothL1Loss", "Softmax", "Softmin", "Softplus", "Softsign", "Tanh", "Tanhshrink",
           "Unflatten", "functional", "init", "utils"]
