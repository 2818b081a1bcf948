"""Sharded Parameters: cut at their first sharded use, whole again in checkpoints.

A Parameter is created whole on every rank (the same values as a single-device run, from the
same seed). The first sharded operator that uses it decides its layout: the parameter's
array becomes this rank's block, once, and its placement says so (tensors.py); from then on
its gradient and its optimizer state are blocks of the same layout. A second operator that
needs another layout of the same parameter is an error (MindSpore's rule for shared
parameters), never a silent copy.

The parallel runtime answers the core's questions about such tensors with the functions
below: checkpoints save whole tensors (:func:`whole`) and load whole tensors into blocks
(:func:`block_of`), and optimizer buffers made while their parameter was whole are cut like
it, once (:func:`follow`).
"""
from minidl import backend

from .executor import gather_full, local_block
from .rules.base import StrategyError
from .tensors import get_layout, set_layout

__all__ = ["place_parameter", "same_blocks", "whole", "block_of", "follow"]


def place_parameter(param, layout, shape, rank, who):
    """Makes ``param`` hold its block of ``layout`` (first use) or checks it already does."""
    placement = param.placement
    if placement is None:
        if tuple(param.shape) != tuple(shape):
            raise ValueError(f"{who}: parameter {param.name!r} has shape {tuple(param.shape)}, expected the whole "
                             f"tensor {tuple(shape)} at its first sharded use")
        xp = backend.get_array_module(param.data)
        param.data = xp.ascontiguousarray(local_block(param.data, layout, rank)).copy()
        set_layout(param, layout, shape, placed_by=who)
        return
    if placement.layout != layout and not same_blocks(placement.layout, layout, shape):
        first = placement.placed_by or "an earlier operator"
        raise StrategyError(f"{who}: parameter {param.name!r} of shape {tuple(shape)} is needed as {layout}, but "
                            f"{first} already placed it as {placement.layout}; a parameter shared by two operators "
                            f"needs the same strategy (the same cuts of that parameter) in both")


def same_blocks(a, b, shape):
    """Whether layouts ``a`` and ``b`` give every rank the same block of a tensor of ``shape``.

    Two operators may describe one cut on different device matrices: a vocabulary-parallel
    Gather cuts a tied embedding's rows along axis a of [2, 1, 1, 1], the head's MatMul along
    axis c of [1, 1, 2]. Each rank holds rows r*V/2:(r+1)*V/2 in both, so the parameter is shared
    as it is. Partial values are never the same blocks (a parameter is never partial).
    """
    if a.device_num != b.device_num or a.partial or b.partial:
        return False
    return all(a.local_slices(r, shape) == b.local_slices(r, shape) for r in range(a.device_num))


def whole(tensor, comm, groups):
    """The whole value of ``tensor`` as an array (a collective over the ranks holding its blocks)."""
    entry = get_layout(tensor)
    if entry is None:
        return tensor.data
    return gather_full(tensor.data, entry[0], entry[1], comm, groups)


def block_of(tensor, value, rank):
    """This rank's block of ``value``, a whole array shaped like ``tensor``'s global shape."""
    entry = get_layout(tensor)
    if entry is None:
        return value
    layout, shape = entry
    array = value.data if hasattr(value, "data") and not hasattr(value, "__array_interface__") else value
    if tuple(array.shape) != tuple(shape):
        return value  # the caller reports the shape mismatch against the local shape
    return local_block(array, layout, rank)


def follow(param, buffer, rank):
    """The block of ``buffer`` (whole, shaped like ``param``'s global shape) matching ``param``'s block.

    ``buffer`` is marked with the same placement, so it is cut once and saved whole.
    """
    entry = get_layout(param)
    if entry is None:
        raise ValueError(f"optimizer state {buffer.name!r} has shape {tuple(buffer.shape)} but its parameter "
                         f"{param.name!r} has shape {tuple(param.shape)} and is not sharded")
    layout, shape = entry
    if tuple(buffer.data.shape) != tuple(shape):
        raise ValueError(f"optimizer state {buffer.name!r} has shape {tuple(buffer.data.shape)}; expected the whole "
                         f"shape {tuple(shape)} of parameter {param.name!r} or its block {tuple(param.data.shape)}")
    xp = backend.get_array_module(buffer.data)
    block = xp.ascontiguousarray(local_block(buffer.data, layout, rank)).copy()
    set_layout(buffer, layout, shape)
    return block
