"""Checkpoints: one self-describing, SHA-256-verified safetensors file per rank and step."""

from .format import (
    FORMAT_VERSION,
    CheckpointError,
    header_sha256,
    load_checkpoint,
    read_checkpoint_meta,
    save_checkpoint,
    verify_checkpoint,
)
from .manager import CheckpointManager, to_host

__all__ = ["FORMAT_VERSION", "CheckpointError", "CheckpointManager", "header_sha256", "load_checkpoint",
           "read_checkpoint_meta", "save_checkpoint", "to_host", "verify_checkpoint"]
