"""DistributedGradReducer: sums (or averages) gradients over ranks in fused buckets.

Gradients are packed into flat per-dtype buffers ("buckets") of at most ``fusion_bytes``,
filled with the parameters in REVERSE order, as PyTorch DDP does (minidl_parallel/buckets.py).
One collective runs per bucket, never one per parameter: small tensors cost one latency per
bucket, not each.

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
same kind of fused per-dtype buffers (one broadcast per buffer; minidl_parallel/broadcast.py).
``Model`` calls it at the start of training when ``parameter_broadcast`` is True.

A parameter whose gradient is None (not reached by the loss) counts as zeros: its slot in the
bucket is zero-filled, so every rank still runs the same collectives, and the returned
gradient is the reduction of the other ranks' gradients (zeros if none had one).

Compression (``compression=Compression.fp16`` / ``bf16``, minidl_parallel/compression.py) and
Horovod's ``gradient_predivide_factor``: buckets travel in the 16-bit type, divided by f before
the sum and by degree / f after; ``overflowed()`` tells whether the last such reduction had an
inf or NaN (a device flag, read only when asked).

Agreement check: the first reduction on a communicator (and ``broadcast_parameters``, every
call) first compares every rank's parameter names, shapes and dtypes (and ``mean``/``degree``)
with one small ``allgather_object`` of a digest (``require_same_tensors``,
minidl_parallel/agreement.py). Ranks that built different models get, on every rank, a
ValueError naming the first parameter that differs and each rank's value, instead of
MPI_ERR_TRUNCATE, a crash or a hang. The result is cached per communicator, so later steps do
not pay for it; a new reducer (``Model.train`` makes one per run) or another communicator
checks again.

Gradient accumulation (``backward_passes_per_step``) sums k calls' gradients locally
(minidl_parallel/accumulation.py); Adasum combines the ranks' gradients per tensor
(minidl_parallel/adasum.py).

Uneven inputs: inside ``with reducer.join(optimizer):`` (or ``minidl_parallel.join``, see
minidl_parallel/join.py) every reduction is preceded by a one-number all-reduce saying that
this rank still has data, and a rank that leaves the block keeps taking part with zero
gradients until every rank has left it. Buckets are reduced with blocking all-reduces there
(no overlap with backward): MPI does not match a blocking collective with a non-blocking one,
and a shadowing rank cannot know which one its peers use.

Example:
    >>> reducer = DistributedGradReducer(opt.parameters, mean=True)
    >>> loss, grads = grad_fn(x, y)
    >>> opt(reducer(grads))
"""
import weakref

import numpy

from minidl.backend import get_array_module
from minidl.tensor import Tensor

from . import adasum
from .accumulation import GradientAccumulator
from .agreement import require_same_tensors
from .broadcast import broadcast_tensors
from .buckets import DEFAULT_FUSION_BYTES, plan_buckets
from .collectives import resolve_communicator
from .compression import Compression
from .join import Join, count_ranks_with_data
from .tensor_parallel.counter import record
from .tensor_parallel.plan import comm_bytes

_WHO = "DistributedGradReducer"


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
        compression: ``Compression.none`` (default), ``Compression.fp16`` or
            ``Compression.bf16`` (or their names): the type buckets travel in
            (minidl_parallel/compression.py); the returned gradients have the parameters' dtype.
        backward_passes_per_step: k >= 1 (Horovod's name): the gradients of k calls are summed
            locally and reduced once, on the k-th; the other calls return None (no
            communication; the caller skips its optimizer step). Scale the loss by 1/k for the
            mean over the k micro-batches, as Horovod's examples do.
        adasum: combine the ranks' gradients with Horovod's Adasum (minidl_parallel/adasum.py)
            instead of summing them; ``mean`` does not apply (Adasum of equal gradients is that
            gradient). Needs a power-of-two world, checked when first used.
        gradient_predivide_factor: Horovod's f, with ``mean`` only: gradients are divided by f
            before the sum and by degree / f after it (f = degree divides everything first,
            which keeps fp16 sums of many ranks from overflowing). Default 1.0; without it and
            without compression the 1/degree is folded into the packing copy (equal up to rounding).

    Example:
        >>> reducer = DistributedGradReducer(net.trainable_params(), mean=True)
        >>> grads = reducer(grads)
    """

    # Every call is a collective: every rank must make as many (Model.train agrees the step counts).
    collective = True

    def __init__(self, parameters, mean=True, degree=None, fusion_bytes=DEFAULT_FUSION_BYTES, comm=None,
                 parameter_broadcast=False, compression=None, gradient_predivide_factor=1.0,
                 backward_passes_per_step=1, adasum=False):
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
        if isinstance(gradient_predivide_factor, bool) or not isinstance(gradient_predivide_factor, (int, float)) \
                or not gradient_predivide_factor > 0 or gradient_predivide_factor == float("inf"):
            raise ValueError(f"{_WHO}: gradient_predivide_factor must be a finite number > 0, got "
                             f"{gradient_predivide_factor!r}")
        if gradient_predivide_factor != 1.0 and not mean:
            raise ValueError(f"{_WHO}: gradient_predivide_factor={gradient_predivide_factor} divides an average; "
                             f"it needs mean=True (Horovod allows it with op=Average only)")
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
                or backward_passes_per_step < 1:
            raise ValueError(f"{_WHO}: backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}")
        self.backward_passes_per_step = backward_passes_per_step
        self._accumulator = GradientAccumulator(len(self.parameters), backward_passes_per_step)
        if not isinstance(adasum, bool):
            raise TypeError(f"{_WHO}: adasum must be a bool, got {adasum!r}")
        if adasum and gradient_predivide_factor != 1.0:
            raise ValueError(f"{_WHO}: gradient_predivide_factor applies to an average, not to Adasum; got "
                             f"{gradient_predivide_factor} with adasum=True")
        self.adasum = adasum
        self.compression = Compression.resolve(compression, _WHO)
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.parameter_broadcast = parameter_broadcast
        self.mean = mean
        self._degree = degree
        self.fusion_bytes = fusion_bytes
        self._comm = comm if comm is None else resolve_communicator(_WHO, comm)
        self.buckets = plan_buckets(((p.shape, p.dtype) for p in self.parameters), fusion_bytes)
        for bucket in self.buckets:  # an integer bucket with fp16 raises here, on every rank
            bucket.wire_dtype = self.compression.wire_dtype(bucket.dtype, _WHO)
        self._finite = None  # per step with compression: whether every reduced value was finite
        self._where = {}
        for b, bucket in enumerate(self.buckets):
            for i, off in zip(bucket.indices, bucket.offsets):
                self._where[i] = (b, off)
        self._pending = None
        self._blocking = False  # set by __call__, where nothing overlaps (see there)
        self._agreed_on = None  # weak reference to the communicator the ranks' parameters were checked on
        self._joined = None  # the open join block (minidl_parallel/join.py), if any
        self._vote_before_reducing = True  # False while a join block shadows a step (it voted already)

    @property
    def comm(self):
        return self._comm if self._comm is not None else resolve_communicator(_WHO, None)

    @property
    def degree(self):
        return self._degree if self._degree is not None else self.comm.size

    # ---- running ------------------------------------------------------------------------

    def __call__(self, grads):
        """Returns the reduced gradients (a tuple aligned with the parameters); blocking. With
        ``backward_passes_per_step`` k > 1, None on the calls that only accumulate.

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
        grad = self._check_one(index, grad)
        if state["accumulate"]:
            state["grads"][index] = None
            self._accumulator.add(index, grad)
            return
        state["grads"][index] = self._accumulator.take(index, grad)
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
        if state["accumulate"]:
            self._accumulator.call_done(reduced=False)
            self._pending = None
            return None
        self._accumulator.call_done(reduced=True)
        out = [None] * len(self.parameters)
        finite = []
        for bucket in self.buckets:
            if bucket.request is not None:
                bucket.request.wait()
                bucket.request = None
            buf = bucket.buffer
            if self._rescales():
                finite.append(self._unpack(bucket))
            for i, off, n in bucket.slots():
                g = buf[off:off + n].reshape(tuple(self.parameters[i].shape))
                given = state["grads"][i]
                if given is not None and given.dtype != g.dtype:
                    g = g.astype(given.dtype)
                out[i] = Tensor(g)
            bucket.buffer = bucket.wire = None  # the returned gradients are views of the buffer
        self._pending = None
        if finite:
            xp = get_array_module(finite[0])
            self._finite = xp.stack(finite).all() if len(finite) > 1 else finite[0]
        return tuple(out)

    def overflowed(self):
        """Whether the last reduction with compression (or a predivide factor) gave an inf or
        NaN: a 16-bit sum out of range, or a non-finite gradient on some rank. Computed on the
        device; reading it here is a host synchronisation on the GPU. False without such a step.
        """
        return self._finite is not None and not bool(self._finite)

    def _combine_adasum(self, xp, bucket):
        """The bucket's gathered (n, size) wire values -> each parameter's Adasum, in float64."""
        gathered = bucket.wire.reshape(self.comm.size, bucket.size).astype(numpy.float64)
        bucket.wire = None
        adasum.adasum_per_tensor(xp, gathered, [(off, n) for _, off, n in bucket.slots()], bucket.buffer)

    def _rescales(self):
        return self.compression is not Compression.none or self.gradient_predivide_factor != 1.0 or self.adasum

    def _unpack(self, bucket):
        """Decompresses a reduced bucket into its buffer and divides by degree / f; returns the
        device flag "every reduced value is finite"."""
        xp = get_array_module(bucket.buffer)
        finite = xp.isfinite(bucket.wire).all()
        if self.adasum:
            self._combine_adasum(xp, bucket)
            return finite
        self.compression.decompress(xp, bucket.wire, bucket.buffer)
        bucket.wire = None
        if self.mean:
            post = self.gradient_predivide_factor / self.degree
            if post != 1.0:
                bucket.buffer *= bucket.dtype.type(post)
        return finite

    def broadcast_parameters(self, tensors, root=0):
        """Overwrites every tensor's data with ``root``'s, in fused buffers; returns the count of broadcasts.

        Args:
            tensors: Parameters (or Tensors) in the same order and shapes on every rank.
            root: the rank whose values win.
        """
        return broadcast_tensors(tensors, root, self.comm, self.fusion_bytes, f"{_WHO}.broadcast_parameters")

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

    def agree_on_parameters(self):
        """Checks, once per communicator, that every rank reduces the same parameters (collective).

        Raises:
            ValueError: on every rank, naming the first parameter (name, shape, dtype) that
                differs and each rank's value, or each rank's ``mean``/``degree``.
        """
        comm = self.comm
        if self._agreed_on is not None and self._agreed_on() is comm:
            return
        if comm.size > 1:
            require_same_tensors(comm, _WHO, self.parameters, mean=self.mean, degree=self.degree)
        self._agreed_on = weakref.ref(comm)

    def join(self, optimizer=None):
        """A join block for uneven inputs (see :class:`minidl_parallel.join.Join`)."""
        return Join(self, optimizer)

    def _begin(self):
        if self._pending is not None:
            raise RuntimeError(f"{_WHO}: a reduction is already in flight; call finish() first")
        if self._accumulator.only_accumulates():
            if self._joined is not None:
                raise RuntimeError(f"{_WHO}: backward_passes_per_step={self.backward_passes_per_step} inside a "
                                   f"join block is not supported: a finished rank cannot tell which calls its "
                                   f"peers reduce; use backward_passes_per_step=1 with uneven inputs")
            self._pending = {"grads": {}, "accumulate": True}
            return
        self.agree_on_parameters()
        if self.adasum:
            adasum.check_world(self.comm.size, _WHO)
        self._finite = None
        if self._joined is not None and self._vote_before_reducing:
            count_ranks_with_data(self.comm, True)
        self._pending = {"grads": {}, "missing": [len(b.indices) for b in self.buckets], "next": 0,
                         "accumulate": False}

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
        # The mean's 1/degree is folded into the packing copy, which happens anyway, rather
        # than being a second pass over the reduced buffer. With compression or a predivide
        # factor the packing divides by f only, and _unpack by degree / f (Horovod's order).
        if self._rescales():
            f = self.gradient_predivide_factor
            scale = bucket.dtype.type(1.0 / f) if self.mean and f != 1.0 else None
        else:
            scale = bucket.dtype.type(1.0 / self.degree) if self.mean and self.degree != 1 else None
        buf = bucket.pack(xp, grads, scale)
        # Inside a join block every bucket takes the blocking all-reduce: a rank shadowing a step
        # cannot know whether its peers overlap (iallreduce_) or not, and MPI never matches a
        # blocking collective with a non-blocking one.
        wire = bucket.wire = self.compression.compress(xp, buf, _WHO)
        comm = self.comm
        if self.adasum:  # every rank's bucket, combined in _unpack (blocking: the tree needs them all)
            record("allgather", comm.size, comm_bytes("allgather", wire.nbytes, comm.size), phase="gradients")
            bucket.wire = comm.allgather(wire)
            bucket.request = None
            return
        record("allreduce", comm.size, comm_bytes("allreduce", wire.nbytes, comm.size), phase="gradients")
        if self._blocking or self._joined is not None:
            comm.allreduce_(wire, "sum")
            bucket.request = None
        else:
            bucket.request = comm.iallreduce_(wire, "sum")


# broadcast_tensors is importable from here too, where it lived before broadcast.py
__all__ = ["DistributedGradReducer", "broadcast_tensors"]
