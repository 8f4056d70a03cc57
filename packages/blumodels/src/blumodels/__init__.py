"""blumodels: GPT-2 on blutensor, typed configs, token-shard data, the Trainer and the `blutrain` CLI.

Imports are light: ``from blumodels.gpt2 import GPT2``, ``from blumodels.trainer import Trainer``.
"""

from blumodels.__about__ import __version__
from blumodels.config import (
           ConfigError,
           DataConfig,
           ModelConfig,
           RunConfig,
           TrainConfig,
           load_config,
           load_preset,
)

__all__ = ["ConfigError", "DataConfig", "ModelConfig", "RunConfig", "TrainConfig", "__version__",
           "load_config", "load_preset"]
