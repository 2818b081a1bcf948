"""The seam through which a parallel package says that Parameters hold blocks of larger tensors.

The core keeps every Parameter as the array its process holds. Under operator-level tensor
parallelism (minidl_parallel) that array is one rank's block of the logical tensor, and three
places of the core need the logical view; they ask the adapter registered here:

- ``save_checkpoint`` writes full tensors: ``adapter.to_full(param)`` (a collective over the
  ranks holding blocks, so every rank calls save_checkpoint), plus ``adapter.describe(param)``
  (the layout, as text) in the file's metadata;
- ``load_param_into_net`` takes full tensors and keeps this rank's block:
  ``adapter.to_local(param, full_array)``, so a checkpoint loads into any strategy or world size;
- optimizers keep state shaped like each parameter: a buffer made while its parameter was
  whole is cut like it before the next update: ``buffer.data = adapter.follow(param, buffer)``.

Without an adapter (the default) every array is whole and nothing changes.
"""

_adapter = {"current": None}

__all__ = ["set_sharded_state_adapter", "get_sharded_state_adapter"]


def set_sharded_state_adapter(adapter):
    """Registers the adapter (an object with to_full, to_local, follow, describe), or None."""
    for method in ("to_full", "to_local", "follow", "describe"):
        if adapter is not None and not callable(getattr(adapter, method, None)):
            raise TypeError(f"set_sharded_state_adapter: the adapter needs a callable {method}()")
    _adapter["current"] = adapter


def get_sharded_state_adapter():
    """The registered adapter, or None."""
    return _adapter["current"]
