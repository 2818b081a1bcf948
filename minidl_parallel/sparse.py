"""Sparse all-reduce for SINGA's ``backward_and_sparse_update``: each rank sends only the
selected entries of its gradient, as (indices, values), and every rank adds them up.

Selection (SINGA's ``spars``): with ``topk`` the ceil(spars * n) entries of largest magnitude
(spars in (0, 1]); else every entry with |g| >= spars (spars > 0, an absolute threshold).

On the wire: the ranks first gather their counts (one small all-gather), then the indices
(int64) and values, padded to the largest count, in two all-gathers; a rank adds every rank's
values at their indices. Where that would move more bytes than a dense all-reduce of the
(mostly zero) vector, the dense all-reduce runs instead: the sum is the same either way.
Top-K at 1% sends 1% of the entries with their indices per rank, and an all-gather hands
every rank all n ranks' sets: n * 1% * (8 + itemsize) bytes per entry received.
"""
import math

import numpy

from minidl.backend import get_array_module

from .tensor_parallel.counter import record
from .tensor_parallel.plan import comm_bytes

__all__ = ["check_spars", "select", "sparse_allreduce"]


def check_spars(spars, topk, who):
    """Raises unless spars suits the selection: (0, 1] with topK, > 0 (finite) without."""
    if isinstance(spars, bool) or not isinstance(spars, (int, float)) or not math.isfinite(spars):
        raise ValueError(f"{who}: spars must be a finite number, got {spars!r}")
    if topk and not 0 < spars <= 1:
        raise ValueError(f"{who}: with topK=True spars is the fraction of entries sent, in (0, 1]; got {spars}")
    if not topk and not spars > 0:
        raise ValueError(f"{who}: with topK=False spars is the threshold |g| >= spars, > 0; got {spars}")


def select(flat, spars, topk):
    """The indices (int64, ascending) of the entries this rank sends."""
    xp = get_array_module(flat)
    magnitude = xp.abs(flat)
    if topk:
        k = min(flat.size, max(1, math.ceil(spars * flat.size)))
        # a stable sort (not argpartition): ties pick the same entries on every run and device
        idx = xp.argsort(-magnitude, kind="stable")[:k]
        return xp.sort(idx).astype(numpy.int64)
    return xp.nonzero(magnitude >= spars)[0].astype(numpy.int64)


def sparse_allreduce(comm, flat, idx):
    """The sum over ranks of each rank's ``flat`` restricted to its ``idx`` (a dense vector)."""
    xp = get_array_module(flat)
    size = comm.size
    counts = comm.allgather(numpy.array([idx.size], dtype=numpy.int64))  # host: no device sync
    widest = int(counts.max())
    sparse_bytes = widest * (8 + flat.itemsize)
    if size == 1 or sparse_bytes * size >= comm_bytes("allreduce", flat.nbytes, size):
        sent = xp.zeros_like(flat)
        sent[idx] = flat[idx]
        record("allreduce", size, comm_bytes("allreduce", sent.nbytes, size), phase="gradients")
        return comm.allreduce(sent, "sum")
    padded_idx = xp.zeros(widest, dtype=numpy.int64)
    padded_val = xp.zeros(widest, dtype=flat.dtype)
    padded_idx[:idx.size] = idx
    padded_val[:idx.size] = flat[idx]
    record("allgather", size, comm_bytes("allgather", sparse_bytes, size), phase="gradients")
    all_idx = comm.allgather(padded_idx).reshape(size, widest)
    all_val = comm.allgather(padded_val).reshape(size, widest)
    total = xp.zeros_like(flat)
    for r in range(size):
        c = int(counts[r])
        total[all_idx[r, :c]] += all_val[r, :c]  # one rank's indices are distinct: no add.at needed
    return total
