"""Overwriting tensors with one rank's values, in fused buffers: ``broadcast_tensors``.

``DistributedGradReducer.broadcast_parameters`` and Horovod's ``broadcast_parameters`` /
``broadcast_optimizer_state`` (minidl_parallel/distributed_optimizer.py) call it. ``Model``
does at the start of training when ``parameter_broadcast`` is True (set from
``set_auto_parallel_context(parameter_broadcast=True)``), with the network's parameters and the
optimizer's state, so every rank starts from rank 0's model even after a resume.

Tensors are packed into per-dtype buffers of at most ``fusion_bytes`` (one broadcast per
buffer), and every call first checks that the ranks pass the same tensors
(minidl_parallel/agreement.py).

Example:
    >>> broadcast_tensors(net.trainable_params(), root=0)   # a world of one sends nothing
    0
"""
from minidl.backend import get_array_module
from minidl.tensor import Tensor

from .agreement import require_same_tensors
from .buckets import DEFAULT_FUSION_BYTES
from .collectives import resolve_communicator

__all__ = ["broadcast_tensors"]


def broadcast_tensors(tensors, root=0, comm=None, fusion_bytes=DEFAULT_FUSION_BYTES, who="broadcast_parameters"):
    """Overwrites every tensor's data with ``root``'s, in fused buffers; returns the count of broadcasts.

    Every rank passes the same tensors (order, shapes, dtypes), checked on every call.
    """
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"{who}: tensors[{i}] must be a Tensor, got {type(t).__name__}")
    comm = resolve_communicator(who, comm)
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < comm.size:
        raise ValueError(f"{who}: root must be a rank in [0, {comm.size - 1}], got {root!r}")
    if comm.size == 1:
        return 0
    # Checked on every call (once per training run): the tensors, optimizer state included,
    # may be another set each time, and a broadcast of mismatched buffers corrupts memory.
    require_same_tensors(comm, who, tensors, root=root)
    if not tensors:
        return 0
    # Host tensors (the optimizer's global_step, SGD's stat flags: NumPy even on a GPU) get
    # buffers of their own, never packed with device ones: the communicator sends each
    # where it lives (nccl: NumPy buffers over its inner MPI communicator), so the few bytes
    # of host state cost no device round trip and no synchronisation.
    groups = {}
    for t in tensors:
        groups.setdefault((str(t.data.dtype), type(t.data).__module__), []).append(t)
    count = 0
    for members in groups.values():
        chunk, nbytes = [], 0
        for t in members + [None]:
            if t is None or (chunk and nbytes + t.data.nbytes > fusion_bytes):
                _broadcast_chunk(comm, chunk, root)
                count += 1
                chunk, nbytes = [], 0
            if t is not None:
                chunk.append(t)
                nbytes += t.data.nbytes
    return count


def _broadcast_chunk(comm, chunk, root):
    xp = get_array_module(chunk[0].data)
    buf = xp.concatenate([xp.ravel(t.data) for t in chunk])
    buf = comm.broadcast(buf, root=root)
    off = 0
    for t in chunk:
        n = t.data.size
        # In place, so views held elsewhere (optimizer state, the net's layers) see rank 0's values.
        t.data[...] = buf[off:off + n].reshape(t.data.shape)
        off += n
