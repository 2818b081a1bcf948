"""Checkpoints (safetensors, written atomically)."""
from .checkpoint import save_checkpoint, load_checkpoint, load_param_into_net  # noqa: F401
