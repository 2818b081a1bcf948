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
from minidl.tensor import Tensor

from ..tensor_parallel.counter import record
from ..tensor_parallel.executor import local_block
from ..tensor_parallel.plan import comm_bytes

__all__ = ["OptimizerSlice", "is_sliced", "slice_for", "whole", "block_of", "follow", "gather_into",
           "ShardGroups"]


@dataclass(frozen=True)
class OptimizerSlice:
    """The placement of a sliced tensor: the whole ``shape``, rows per rank, and this rank's index.

    Under tensor parallelism the rows are those of the rank's tensor-parallel block: ``inner`` is
    the block's placement (restored when the slices are gathered) and ``block`` its shape;
    otherwise ``inner`` is None and ``block`` the whole shape.
    """

    shape: tuple
    rows: int
    group_size: int
    index: int
    comm: object = field(default=None, compare=False, repr=False)  # the shard group's communicator
    inner: object = None
    block: tuple = None
    ranks: tuple = field(default=None, compare=False, repr=False)  # the group's world ranks, when known

    def __post_init__(self):
        if self.block is None:
            object.__setattr__(self, "block", tuple(self.shape))

    def bounds(self, index=None):
        """(first row, end row) of rank ``index`` of the group (this rank's by default)."""
        index = self.index if index is None else index
        lo = min(index * self.rows, self.block[0])
        return lo, min(lo + self.rows, self.block[0])

    def __str__(self):
        lo, hi = self.bounds()
        of = f"block {self.block} ({self.inner}) of {self.shape}" if self.inner is not None else f"{self.shape}"
        return f"optimizer slice {self.index} of {self.group_size}: rows [{lo}:{hi}) of {of}"


def is_sliced(tensor):
    return isinstance(getattr(tensor, "placement", None), OptimizerSlice)


def slice_for(shape, group_size, index, comm, inner=None, block=None, ranks=None):
    """The slice of rank ``index`` of a group of ``group_size`` (rows of ``block``, the whole shape by default)."""
    block = tuple(shape) if block is None else tuple(block)
    return OptimizerSlice(tuple(shape), math.ceil(block[0] / group_size), group_size, index, comm, inner, block,
                          None if ranks is None else tuple(ranks))


def cut(array, placement):
    """This rank's rows of ``array`` (whole, or the tensor-parallel block), as a contiguous copy
    (the whole array can be freed)."""
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
            n = p.rows * math.prod(p.block[1:])
            blocks = gathered[:, off:off + n].reshape((comm.size * p.rows,) + tuple(p.block[1:]))
            wholes[id(t)] = xp.ascontiguousarray(blocks[:p.block[0]])
            off += n
    return [wholes[id(t)] for t in tensors]


def whole(tensor):
    """The value of a sliced tensor before slicing: whole, or its tensor-parallel block (a collective
    over its shard group)."""
    return gather_into([tensor], [tensor.placement])[0]


def block_of(tensor, value):
    """This rank's rows of ``value``, an array shaped like the sliced block (the whole tensor, or its
    tensor-parallel block)."""
    array = value.data if isinstance(value, Tensor) else value  # (a CuPy array's .data is its memory pointer)
    if tuple(array.shape) != tuple(tensor.placement.block):
        return value  # the caller reports the shape mismatch
    return cut(array, tensor.placement)


def follow(param, buffer, rank):
    """``buffer`` (whole, or the tensor-parallel block of ``param``) cut like ``param``'s slice, and
    marked so (saved whole)."""
    placement = param.placement
    data = buffer.data
    if placement.inner is not None and tuple(data.shape) == tuple(placement.shape) != tuple(placement.block):
        data = local_block(data, placement.inner.layout, rank)  # whole: first this rank's block
    if tuple(data.shape) != tuple(placement.block):
        raise ValueError(f"optimizer state {buffer.name!r} has shape {tuple(buffer.data.shape)}, but its parameter "
                         f"{param.name!r} is {placement}")
    buffer.placement = placement
    return cut(data, placement)


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
