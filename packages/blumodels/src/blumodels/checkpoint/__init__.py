"""Checkpoints: one self-describing, SHA-256-verified safetensors file per rank and step."""

from .format import FORMAT_VERSION, CheckpointError, load_checkpoint, read_checkpoint_meta, save_checkpoint
from .manager import CheckpointManager, to_host

__all__ = ["FORMAT_VERSION", "CheckpointError", "CheckpointManager", "load_checkpoint",
           "read_checkpoint_meta", "save_checkpoint", "to_host"]
