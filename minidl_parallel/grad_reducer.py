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

Compression (``compression=Compression.fp16`` / ``bf16``, minidl_parallel/compression.py) and
Horovod's ``gradient_predivide_factor``: buckets travel in the 16-bit type, divided by f before
the sum and by degree / f after; ``overflowed()`` tells whether the last such reduction had an
inf or NaN (a device flag, read only when asked).

Agreement check: the first reduction on a communicator (and ``broadcast_parameters``, every
call) first compares every rank's parameter names, shapes and dtypes (and ``mean``/``degree``)
with one small ``allgather_object`` of a digest (minidl_parallel/agreement.py). Ranks that
built different models get, on every rank, a ValueError naming the first parameter that
differs and each rank's value, instead of MPI_ERR_TRUNCATE, a crash or a hang. The result
is cached per communicator, so later steps do not pay for it; a new reducer (``Model.train``
makes one per run) or another communicator checks again.

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
from .agreement import describe_ranks, disagreement, first_difference
from .collectives import resolve_communicator
from .compression import Compression
from .tensor_parallel.counter import record
from .tensor_parallel.plan import comm_bytes

_WHO = "DistributedGradReducer"


class _Bucket:
    """Parameters (indices) sharing one flat buffer of one dtype."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.indices = []
        self.offsets = []
        self.size = 0
        self.buffer = None
        self.wire = None  # the buffer on the wire when compressed (else the buffer itself)
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

    def __init__(self, parameters, mean=True, degree=None, fusion_bytes=25 * 1024 * 1024, comm=None,
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
        self._passes = 0  # calls accumulated since the last reduction
        self._accumulated = [None] * len(self.parameters)
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
        self.buckets = self._plan()
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
            self._accumulate(index, grad)
            return
        state["grads"][index] = self._take_accumulated(index, grad)
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
            self._passes += 1
            self._pending = None
            return None
        self._passes = 0
        out = [None] * len(self.parameters)
        finite = []
        for bucket in self.buckets:
            if bucket.request is not None:
                bucket.request.wait()
                bucket.request = None
            buf = bucket.buffer
            if self._rescales():
                finite.append(self._unpack(bucket))
            for i, off in zip(bucket.indices, bucket.offsets):
                p = self.parameters[i]
                n = _numel(p.shape)
                g = buf[off:off + n].reshape(tuple(p.shape))
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
        for i, off in zip(bucket.indices, bucket.offsets):
            n = _numel(self.parameters[i].shape)
            rows = [gathered[r, off:off + n] for r in range(gathered.shape[0])]
            bucket.buffer[off:off + n] = adasum.adasum_tree(xp, rows).astype(bucket.dtype)

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
            self._check_agreement(comm, _WHO, _describe_tensors(self.parameters), mean=self.mean,
                                  degree=self.degree)
        self._agreed_on = weakref.ref(comm)

    @staticmethod
    def _check_agreement(comm, who, tensors, **settings):
        description = (tuple(sorted(settings.items())), tensors)
        found = disagreement(comm, "parameters", description)
        if found is not None:
            raise ValueError(_mismatch_message(who, found))

    def join(self, optimizer=None):
        """A join block for uneven inputs (see :class:`minidl_parallel.join.Join`)."""
        from .join import Join
        return Join(self, optimizer)

    def _vote(self, comm, has_data):
        """The number of ranks that still have data (a one-number all-reduce; join blocks only)."""
        return int(round(float(comm.allreduce(numpy.array([float(has_data)]), "sum")[0])))

    def _begin(self):
        if self._pending is not None:
            raise RuntimeError(f"{_WHO}: a reduction is already in flight; call finish() first")
        if self._passes < self.backward_passes_per_step - 1:  # this call only accumulates
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
            self._vote(self.comm, True)
        self._pending = {"grads": {}, "missing": [len(b.indices) for b in self.buckets], "next": 0,
                         "accumulate": False}

    def _accumulate(self, index, grad):
        if grad is None:
            return
        acc = self._accumulated[index]
        if acc is None:
            self._accumulated[index] = grad.copy()
        else:
            acc += grad

    def _take_accumulated(self, index, grad):
        """grad plus what earlier calls accumulated for parameter index (which is then cleared)."""
        acc, self._accumulated[index] = self._accumulated[index], None
        if acc is None:
            return grad
        if grad is not None:
            acc += grad
        return acc

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
        # than being a second pass over the reduced buffer. With compression or a predivide
        # factor the packing divides by f only, and _unpack by degree / f (Horovod's order).
        if self._rescales():
            f = self.gradient_predivide_factor
            scale = bucket.dtype.type(1.0 / f) if self.mean and f != 1.0 else None
        else:
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


def broadcast_tensors(tensors, root=0, comm=None, fusion_bytes=25 * 1024 * 1024, who="broadcast_parameters"):
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
    found = disagreement(comm, "parameters", ((("root", root),), _describe_tensors(tensors)))
    if found is not None:
        raise ValueError(_mismatch_message(who, found))
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


def _describe_tensors(tensors):
    """The compact description the ranks compare: (name, shape, dtype) of each tensor, in order."""
    return tuple((getattr(t, "name", None), tuple(int(d) for d in t.shape), str(numpy.dtype(t.dtype)))
                 for t in tensors)


def _show_tensor(entry):
    if entry is None:
        return "nothing"
    name, shape, dtype = entry
    return f"{name!r} of shape {shape} {dtype}"


def _mismatch_message(who, found):
    kinds = [kind for kind, _ in found]
    if any(k != kinds[0] for k in kinds):
        return (f"{who}: the ranks are running different checks at the same point ({describe_ranks(kinds)}): "
                f"they run different programs or parallel modes; every rank must make the same calls")
    settings = [dict(description[0]) for _, description in found]
    tensors = [description[1] for _, description in found]
    i = first_difference(tensors)
    if i is not None:
        counts = [len(t) for t in tensors]
        at = [t[i] if i < len(t) else None for t in tensors]
        count_note = "" if all(c == counts[0] for c in counts) else f" (numbers of tensors: " \
            f"{describe_ranks(counts, str)})"
        return (f"{who}: the ranks' parameters differ at tensor {i}: {describe_ranks(at, _show_tensor)}"
                f"{count_note}; every rank must build the same network (same layers, shapes and dtypes, "
                f"in the same order) before training")
    return (f"{who}: the ranks reduce gradients with different settings: "
            f"{describe_ranks(settings, lambda s: ', '.join(f'{k}={v!r}' for k, v in s.items()))}; set the same "
            f"gradients_mean (and degree) on every rank")


def _numel(shape):
    n = 1
    for s in shape:
        n *= int(s)
    return n


__all__ = ["DistributedGradReducer", "broadcast_tensors"]
