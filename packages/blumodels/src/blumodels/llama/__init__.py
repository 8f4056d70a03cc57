"""The Llama family: model (``blumodels.llama.model``), Hugging Face mapping (``.hf``), tensor-parallel plan
(``.parallelize``) and its model-family plugin class (``.family``, registered by ``blumodels.hooks``)."""

from blumodels.llama.model import Llama, build_model, count_params

__all__ = ["Llama", "build_model", "count_params"]
