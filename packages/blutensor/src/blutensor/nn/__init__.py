"""Neural-network modules: Module, Parameter, layers, init and functional."""

from blutensor.nn import functional, init
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
    SiLU,
)
from blutensor.nn.module import Module
from blutensor.nn.parameter import Parameter

__all__ = ["GELU", "Dropout", "Embedding", "LayerNorm", "Linear", "Module", "ModuleDict", "ModuleList",
           "Parameter", "RMSNorm", "ReLU", "Sequential", "SiLU", "functional", "init"]
