"""Checkpoints (safetensors, written atomically)."""
from .checkpoint import (save_checkpoint, load_checkpoint, load_param_into_net, load_checkpoint_metadata,  # noqa: F401
                         CheckpointLoadWarning)
from .safetensors import remove_stale_temp_files  # noqa: F401
from . import safetensors  # noqa: F401

__all__ = ["save_checkpoint", "load_checkpoint", "load_param_into_net", "load_checkpoint_metadata",
           "CheckpointLoadWarning", "remove_stale_temp_files", "safetensors"]
