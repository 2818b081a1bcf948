"""Optimizer slices: which parameters are sliced, each rank's rows, and moving between whole and slice.

A sliced parameter keeps rows ``[index * rows, (index + 1) * rows)`` of its first dimension (cut at
its end), with ``rows = ceil(dim0 / group_size)``: the last ranks of a group hold fewer rows, or
none, when dim0 is not a multiple of the group size (MindSpore slices only first dimensions that
divide). Between steps the parameter's ``data`` is its slice and its ``placement`` an
:class:`OptimizerSlice` (so ``shape`` stays the whole tensor's, as for tensor-parallel blocks);
optimizer state made whole is cut the same way at the first update (:func:`follow`).

Collectives run over the parameter's shard group: the ranks ``[g * size, (g + 1) * size)`` of
the world (every rank when ``optimizer_weight_shard_size`` is -1). Rows are padded to ``rows``
on the wire, so every rank sends the same count.
"""
import math
from dataclasses import dataclass, field

from minidl import backend

from ..tensor_parallel.counter import record
from ..tensor_parallel.plan import comm_bytes

__all__ = ["OptimizerSlice", "is_sliced", "slice_for", "whole", "block_of", "follow", "gather_into",
           "ShardGroups"]


@dataclass(frozen=True)
class OptimizerSlice:
    """The placement of a sliced tensor: the whole ``shape``, rows per rank, and this rank's index."""

    shape: tuple
    rows: int
    group_size: int
    index: int
    comm: object = field(default=None, compare=False, repr=False)  # the shard group's communicator

    def bounds(self, index=None):
        """(first row, end row) of rank ``index`` of the group (this rank's by default)."""
        index = self.index if index is None else index
        lo = min(index * self.rows, self.shape[0])
        return lo, min(lo + self.rows, self.shape[0])

    def __str__(self):
        lo, hi = self.bounds()
        return f"optimizer slice {self.index} of {self.group_size}: rows [{lo}:{hi}) of {self.shape}"


def is_sliced(tensor):
    return isinstance(getattr(tensor, "placement", None), OptimizerSlice)


def slice_for(shape, group_size, index, comm):
    return OptimizerSlice(tuple(shape), math.ceil(shape[0] / group_size), group_size, index, comm)


def cut(array, placement):
    """This rank's rows of a whole ``array``, as a contiguous copy (the whole array can be freed)."""
    lo, hi = placement.bounds()
    xp = backend.get_array_module(array)
    return xp.ascontiguousarray(array[lo:hi]).copy()


def _padded(array, rows):
    """``array`` (a slice) with zero rows appended up to ``rows``."""
    if array.shape[0] == rows:
        return array
    xp = backend.get_array_module(array)
    out = xp.zeros((rows,) + tuple(array.shape[1:]), dtype=array.dtype)
    out[:array.shape[0]] = array
    return out


def gather_into(tensors, placements, phase=None):
    """Every tensor's whole value from the slices of its group (one all-gather per dtype and group),
    each all-gather reported to the CommCounter in ``phase`` when one is given."""
    batches = {}
    for t, placement in zip(tensors, placements):
        batches.setdefault((id(placement.comm), t.data.dtype.str), []).append((t, placement))
    wholes = {}
    for batch in batches.values():
        comm = batch[0][1].comm
        xp = backend.get_array_module(batch[0][0].data)
        flat = xp.concatenate([_padded(t.data, p.rows).reshape(-1) for t, p in batch])
        if phase is not None:
            record("allgather", comm.size, comm_bytes("allgather", flat.nbytes, comm.size), phase=phase)
        gathered = comm.allgather(flat).reshape(comm.size, flat.size)
        off = 0
        for t, p in batch:
            n = p.rows * math.prod(p.shape[1:])
            blocks = gathered[:, off:off + n].reshape((comm.size * p.rows,) + tuple(p.shape[1:]))
            wholes[id(t)] = xp.ascontiguousarray(blocks[:p.shape[0]])
            off += n
    return [wholes[id(t)] for t in tensors]


def whole(tensor):
    """The whole value of a sliced tensor (a collective over its shard group)."""
    return gather_into([tensor], [tensor.placement])[0]


def block_of(tensor, value):
    """This rank's rows of ``value``, a whole array shaped like the tensor."""
    array = value.data if hasattr(value, "data") and not hasattr(value, "__array_interface__") else value
    if tuple(array.shape) != tuple(tensor.placement.shape):
        return value  # the caller reports the shape mismatch
    return cut(array, tensor.placement)


def follow(param, buffer):
    """``buffer`` (whole, shaped like ``param``) cut like ``param``'s slice, and marked so (saved whole)."""
    placement = param.placement
    if tuple(buffer.data.shape) != tuple(placement.shape):
        raise ValueError(f"optimizer state {buffer.name!r} has shape {tuple(buffer.data.shape)}, but its parameter "
                         f"{param.name!r} is {placement}")
    buffer.placement = placement
    return cut(buffer.data, placement)


class ShardGroups:
    """The shard group and replica communicators of one world communicator, made once (collective)."""

    def __init__(self, comm, shard_size, who):
        n = comm.size
        size = n if shard_size == -1 else shard_size
        if size > n or n % size:
            raise ValueError(f"{who}: parallel_optimizer_config['optimizer_weight_shard_size'] = {shard_size} must "
                             f"divide the data-parallel world size {n} (or be -1: every rank)")
        self.size = size
        rank = comm.rank
        self.index = rank % size
        first = rank - self.index
        if size == n:
            self.group, self.replicas = comm, None
        else:
            # Every rank makes its group, then the ranks holding the same rows across groups.
            self.group = comm.split(list(range(first, first + size)))
            self.replicas = comm.split(list(range(self.index, n, size)))
