"""Checkpoints (safetensors, written atomically)."""
from .checkpoint import save_checkpoint, load_checkpoint, load_param_into_net, load_checkpoint_metadata  # noqa: F401
from . import safetensors  # noqa: F401

__all__ = ["save_checkpoint", "load_checkpoint", "load_param_into_net", "load_checkpoint_metadata", "safetensors"]
