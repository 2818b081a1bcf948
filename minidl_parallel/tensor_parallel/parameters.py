"""Sharded Parameters: cut at their first sharded use, whole again in checkpoints.

A Parameter is created whole on every rank (the same values as a single-device run, from the
same seed). The first sharded operator that uses it decides its layout: the parameter's
array becomes this rank's block, once, and from then on its gradient and its optimizer state
are blocks of the same layout. A second operator that needs another layout of the same
parameter is an error (MindSpore's rule for shared parameters), never a silent copy.

:class:`ShardedStateAdapter` is what minidl's core asks (minidl/common/sharded_state.py):
checkpoints save full tensors and load full tensors into blocks, and optimizer buffers made
while their parameter was whole are cut like it.
"""
import weakref

from minidl import backend

from .executor import gather_full, local_block
from .rules.base import StrategyError
from .tensors import get_layout, set_layout

__all__ = ["place_parameter", "ShardedStateAdapter"]

_first_user = {}  # id(param) -> who placed it (for the shared-parameter error)


def place_parameter(param, layout, shape, rank, who):
    """Makes ``param`` hold its block of ``layout`` (first use) or checks it already does."""
    entry = get_layout(param)
    if entry is None:
        if tuple(param.shape) != tuple(shape):
            raise ValueError(f"{who}: parameter {param.name!r} has shape {tuple(param.shape)}, expected the whole "
                             f"tensor {tuple(shape)} at its first sharded use")
        xp = backend.get_array_module(param.data)
        param.data = xp.ascontiguousarray(local_block(param.data, layout, rank)).copy()
        set_layout(param, layout, shape)
        _first_user[id(param)] = who
        weakref.finalize(param, _first_user.pop, id(param), None)  # an id may be reused after the parameter dies
        return
    if entry[0] != layout:
        first = _first_user.get(id(param), "an earlier operator")
        raise StrategyError(f"{who}: parameter {param.name!r} of shape {tuple(shape)} is needed as {layout}, but "
                            f"{first} already placed it as {entry[0]}; a parameter shared by two operators needs "
                            f"the same strategy (the same cuts of that parameter) in both")


class ShardedStateAdapter:
    """The core's view of sharded parameters (see minidl/common/sharded_state.py).

    Args:
        context: a callable returning ``(world_comm, groups)`` of the calling rank.
    """

    def __init__(self, context):
        self._context = context

    def describe(self, param):
        entry = get_layout(param)
        return None if entry is None else str(entry[0])

    def to_full(self, param):
        entry = get_layout(param)
        if entry is None:
            return param.data
        comm, groups = self._context()
        return gather_full(param.data, entry[0], entry[1], comm, groups)

    def to_local(self, param, value):
        entry = get_layout(param)
        if entry is None:
            return value
        layout, shape = entry
        array = value.data if hasattr(value, "data") and not hasattr(value, "__array_interface__") else value
        if tuple(array.shape) != tuple(shape):
            return value  # the caller reports the shape mismatch against the local shape
        comm, _ = self._context()
        return local_block(array, layout, comm.rank)

    def follow(self, param, buffer):
        entry = get_layout(param)
        if entry is None:
            raise ValueError(f"optimizer state {buffer.name!r} has shape {tuple(buffer.shape)} but its parameter "
                             f"{param.name!r} has shape {tuple(param.shape)} and is not sharded")
        layout, shape = entry
        if tuple(buffer.shape) != tuple(shape):
            raise ValueError(f"optimizer state {buffer.name!r} has shape {tuple(buffer.shape)}; expected the whole "
                             f"shape {tuple(shape)} of parameter {param.name!r} or its block {tuple(param.shape)}")
        comm, _ = self._context()
        xp = backend.get_array_module(buffer.data)
        block = xp.ascontiguousarray(local_block(buffer.data, layout, comm.rank)).copy()
        set_layout(buffer, layout, shape)
        return block
