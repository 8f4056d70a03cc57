"""``blutensor.utils.data``: datasets, samplers and the DataLoader, under PyTorch's names."""

from blutensor.utils.data.collate import default_collate, default_convert
from blutensor.utils.data.dataloader import DataLoader
from blutensor.utils.data.dataset import (
    ConcatDataset,
    Dataset,
    IterableDataset,
    Subset,
    TensorDataset,
    random_split,
)
from blutensor.utils.data.sampler import (
    BatchSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
)

__all__ = ["BatchSampler", "ConcatDataset", "DataLoader", "Dataset", "IterableDataset", "RandomSampler", "Sampler",
           "SequentialSampler", "Subset", "SubsetRandomSampler", "TensorDataset", "default_collate",
           "default_convert", "random_split"]
