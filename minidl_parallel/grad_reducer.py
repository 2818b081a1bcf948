"""DistributedGradReducer: sums (or averages) gradients over ranks in fused buckets.

Gradients are packed into flat per-dtype buffers ("buckets") of at most ``fusion_bytes``,
filled with the parameters in REVERSE order, as PyTorch DDP does: backward produces the last
layers' gradients first, so the first bucket is the first one complete. One collective runs
per bucket, never one per parameter: small tensors cost one latency per bucket, not each.

Three ways to run it:

    grads = reducer(grads)              blocking: start(grads) then finish()
    reducer.start(grads); ...; grads = reducer.finish()
        every bucket's non-blocking all-reduce (``iallreduce_``) is in flight between the
        calls, so work placed there (logging, data loading, the next batch's host work)
        overlaps the communication.
    reducer.ready(i, grad) for each parameter as its gradient appears; grads = reducer.finish()
        a bucket starts as soon as all its gradients are ready (and every earlier bucket has
        started: buckets start in the same order on every rank, which MPI and NCCL require),
        so the reduction of the last layers overlaps the backward of the first ones.

What actually overlaps depends on the backend's ``iallreduce_``: mpi (``Iallreduce``) and
nccl (a side stream) return at once and progress in the background; threads and local
complete the reduction inside the call, so there the three ways give the same result with no
overlap. ``ready`` needs a caller that sees each gradient as backward produces it:
``Model`` passes ``value_and_grad(..., on_grad_ready=reducer.ready)`` and calls ``finish()``
before the optimizer.

``broadcast_parameters(tensors)`` overwrites tensors with rank 0's values, packed into the
same kind of fused per-dtype buffers (one broadcast per buffer). ``Model`` calls it at the
start of training when ``parameter_broadcast`` is True (set from
``set_auto_parallel_context(parameter_broadcast=True)``), with the network's parameters and
the optimizer's state, so every rank starts from rank 0's model even after a resume.

A parameter whose gradient is None (not reached by the loss) counts as zeros: its slot in the
bucket is zero-filled, so every rank still runs the same collectives, and the returned
gradient is the reduction of the other ranks' gradients (zeros if none had one).

Example:
    >>> reducer = DistributedGradReducer(opt.parameters, mean=True)
    >>> loss, grads = grad_fn(x, y)
    >>> opt(reducer(grads))
"""
import numpy

from minidl.backend import get_array_module
from minidl.tensor import Tensor

from .collectives import resolve_communicator

_WHO = "DistributedGradReducer"


class _Bucket:
    """Parameters (indices) sharing one flat buffer of one dtype."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.indices = []
        self.offsets = []
        self.size = 0
        self.buffer = None
        self.request = None


class DistributedGradReducer:
    """Reduces gradients over the ranks of a communicator, bucket by bucket.

    Args:
        parameters: the Parameters whose gradients will be passed (their order is that of
            ``grads``), e.g. ``optimizer.parameters``.
        mean: divide the sum by ``degree`` (MindSpore's ``gradients_mean``).
        degree: the divisor for the mean; default the group size.
        fusion_bytes: the largest bucket in bytes (a larger gradient gets a bucket of its own).
        comm: the Communicator; None uses the context's world, looked up when first used.
        parameter_broadcast: tells ``Model`` to call :meth:`broadcast_parameters` at the start
            of training.

    Example:
        >>> reducer = DistributedGradReducer(net.trainable_params(), mean=True)
        >>> grads = reducer(grads)
    """

    def __init__(self, parameters, mean=True, degree=None, fusion_bytes=25 * 1024 * 1024, comm=None,
                 parameter_broadcast=False):
        self.parameters = tuple(parameters)
        for i, p in enumerate(self.parameters):
            if not hasattr(p, "shape") or not hasattr(p, "dtype"):
                raise TypeError(f"{_WHO}: parameters[{i}] must be a Parameter, got {type(p).__name__}")
        if not isinstance(mean, bool):
            raise TypeError(f"{_WHO}: mean must be a bool, got {mean!r}")
        if degree is not None and (isinstance(degree, bool) or not isinstance(degree, int) or degree < 1):
            raise ValueError(f"{_WHO}: degree must be a positive int or None (the group size), got {degree!r}")
        if isinstance(fusion_bytes, bool) or not isinstance(fusion_bytes, int) or fusion_bytes < 1:
            raise ValueError(f"{_WHO}: fusion_bytes must be a positive int, got {fusion_bytes!r}")
        if not isinstance(parameter_broadcast, bool):
            raise TypeError(f"{_WHO}: parameter_broadcast must be a bool, got {parameter_broadcast!r}")
        self.parameter_broadcast = parameter_broadcast
        self.mean = mean
        self._degree = degree
        self.fusion_bytes = fusion_bytes
        self._comm = comm if comm is None else resolve_communicator(_WHO, comm)
        self.buckets = self._plan()
        self._where = {}
        for b, bucket in enumerate(self.buckets):
            for i, off in zip(bucket.indices, bucket.offsets):
                self._where[i] = (b, off)
        self._pending = None
        self._blocking = False  # set by __call__, where nothing overlaps (see there)

    @property
    def comm(self):
        return self._comm if self._comm is not None else resolve_communicator(_WHO, None)

    @property
    def degree(self):
        return self._degree if self._degree is not None else self.comm.size

    def _plan(self):
        buckets, open_by_dtype = [], {}
        for i in reversed(range(len(self.parameters))):
            p = self.parameters[i]
            dtype = numpy.dtype(p.dtype)
            n = _numel(p.shape)
            bucket = open_by_dtype.get(dtype)
            if bucket is not None and bucket.size and (bucket.size + n) * dtype.itemsize > self.fusion_bytes:
                bucket = None
            if bucket is None:
                bucket = open_by_dtype[dtype] = _Bucket(dtype)
                buckets.append(bucket)
            bucket.indices.append(i)
            bucket.offsets.append(bucket.size)
            bucket.size += n
        return buckets

    # ---- running ------------------------------------------------------------------------

    def __call__(self, grads):
        """Returns the reduced gradients (a tuple aligned with the parameters); blocking.

        Nothing can overlap here, so each bucket takes the blocking all-reduce: with OpenMPI
        5, ``Iallreduce`` + ``Wait`` measured 1.5-3x slower than ``Allreduce`` on 1-16 MB
        (benchmarks/bench_allreduce.py --variants raw,raw_i).
        """
        self._blocking = True
        try:
            self.start(grads)
            return self.finish()
        finally:
            self._blocking = False

    def start(self, grads):
        """Packs every bucket and starts its non-blocking all-reduce; ``finish()`` collects them."""
        grads = self._check(grads)
        self._begin()
        for i, g in enumerate(grads):
            self.ready(i, g)

    def ready(self, index, grad):
        """Declares parameter ``index``'s gradient (Tensor, array or None); starts every bucket now complete."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.parameters):
            raise ValueError(f"{_WHO}: index {index!r} is not that of one of the {len(self.parameters)} parameters")
        if self._pending is None:
            self._begin()
        state = self._pending
        if index in state["grads"]:
            raise ValueError(f"{_WHO}: the gradient of parameter {index} was already given in this step")
        state["grads"][index] = self._check_one(index, grad)
        b, _ = self._where[index]
        state["missing"][b] -= 1
        while state["next"] < len(self.buckets) and state["missing"][state["next"]] == 0:
            self._launch(state["next"])
            state["next"] += 1

    def finish(self):
        """Waits for every bucket and returns the reduced gradients as a tuple of Tensors.

        Buckets whose gradients were not all declared (``ready``) count the missing ones as None.
        """
        state = self._pending
        if state is None:
            raise RuntimeError(f"{_WHO}: finish() called without start() or ready()")
        for i in range(len(self.parameters)):
            if i not in state["grads"]:
                self.ready(i, None)
        out = [None] * len(self.parameters)
        for bucket in self.buckets:
            if bucket.request is not None:
                bucket.request.wait()
                bucket.request = None
            buf = bucket.buffer
            for i, off in zip(bucket.indices, bucket.offsets):
                p = self.parameters[i]
                n = _numel(p.shape)
                g = buf[off:off + n].reshape(tuple(p.shape))
                given = state["grads"][i]
                if given is not None and given.dtype != g.dtype:
                    g = g.astype(given.dtype)
                out[i] = Tensor(g)
            bucket.buffer = None  # the returned gradients are views of it
        self._pending = None
        return tuple(out)

    def broadcast_parameters(self, tensors, root=0):
        """Overwrites every tensor's data with ``root``'s, in fused buffers; returns the count of broadcasts.

        Args:
            tensors: Parameters (or Tensors) in the same order and shapes on every rank.
            root: the rank whose values win.
        """
        tensors = list(tensors)
        for i, t in enumerate(tensors):
            if not isinstance(t, Tensor):
                raise TypeError(f"{_WHO}.broadcast_parameters: tensors[{i}] must be a Tensor, got {type(t).__name__}")
        comm = self.comm
        if comm.size == 1 or not tensors:
            return 0
        groups = {}
        for t in tensors:
            groups.setdefault((str(t.data.dtype), type(t.data).__module__), []).append(t)
        count = 0
        for members in groups.values():
            chunk, nbytes = [], 0
            for t in members + [None]:
                if t is None or (chunk and nbytes + t.data.nbytes > self.fusion_bytes):
                    self._broadcast_chunk(comm, chunk, root)
                    count += 1
                    chunk, nbytes = [], 0
                if t is not None:
                    chunk.append(t)
                    nbytes += t.data.nbytes
        return count

    @staticmethod
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

    # ---- helpers ------------------------------------------------------------------------

    def _check(self, grads):
        if isinstance(grads, Tensor) or not isinstance(grads, (list, tuple)):
            raise TypeError(f"{_WHO}: grads must be a tuple aligned with the parameters, got {type(grads).__name__}")
        if len(grads) != len(self.parameters):
            raise ValueError(f"{_WHO}: got {len(grads)} gradient(s) for {len(self.parameters)} parameter(s)")
        return [self._check_one(i, g) for i, g in enumerate(grads)]

    def _check_one(self, index, grad):
        grad = grad.data if isinstance(grad, Tensor) else grad
        shape = tuple(self.parameters[index].shape)
        if grad is not None and tuple(grad.shape) != shape:
            raise ValueError(f"{_WHO}: gradient {index} of shape {tuple(grad.shape)} does not match its "
                             f"parameter of shape {shape}")
        return grad

    def _begin(self):
        if self._pending is not None:
            raise RuntimeError(f"{_WHO}: a reduction is already in flight; call finish() first")
        self._pending = {"grads": {}, "missing": [len(b.indices) for b in self.buckets], "next": 0}

    def _launch(self, b):
        bucket = self.buckets[b]
        grads = self._pending["grads"]
        xp = None
        for i in bucket.indices:
            if grads[i] is not None:
                xp = get_array_module(grads[i])
                break
        if xp is None:
            xp = get_array_module(self.parameters[bucket.indices[0]].data)
        # A fresh buffer each step: the returned gradients are views of it, which saves copying
        # them out and keeps them valid after the next step.
        buf = bucket.buffer = xp.empty(bucket.size, dtype=bucket.dtype)
        # The mean's 1/degree is folded into the packing copy, which happens anyway, rather
        # than being a second pass over the reduced buffer.
        scale = bucket.dtype.type(1.0 / self.degree) if self.mean and self.degree != 1 else None
        for i, off in zip(bucket.indices, bucket.offsets):
            n = _numel(self.parameters[i].shape)
            g = grads[i]
            if g is None:
                buf[off:off + n] = 0
            elif scale is None:
                buf[off:off + n] = g.reshape(-1)
            else:
                xp.multiply(g.reshape(-1), scale, out=buf[off:off + n])
        if self._blocking:
            self.comm.allreduce_(buf, "sum")
            bucket.request = None
        else:
            bucket.request = self.comm.iallreduce_(buf, "sum")


def _numel(shape):
    n = 1
    for s in shape:
        n *= int(s)
    return n


__all__ = ["DistributedGradReducer"]
