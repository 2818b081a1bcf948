"""The Communicator contract that every backend (threads, mpi, nccl, local) fulfils.

A communicator joins ``size`` ranks. Every collective is *collective*: all ranks of the
communicator call it, in the same order, with arrays of the same shape and dtype (the array
arguments may differ in value only). A rank that calls collectives in another order, or with
another shape, makes MPI and NCCL hang or corrupt memory; set ``MINIDL_DIST_DEBUG=1`` to have
every collective first compare its fingerprint (sequence number, name, shape, dtype,
arguments) across ranks and raise on every rank a RuntimeError that names the collective, the
sequence number and each rank's call instead; ``MINIDL_DIST_DEBUG=2`` adds the call site
(file:line of the first frame outside minidl and minidl_parallel) to the fingerprint, which
also catches two same-shape collectives called in a different order.

No wait is unbounded: every blocking collective waits at most ``timeout`` seconds
(``MINIDL_COLLECTIVE_TIMEOUT``, default 600, 0 = wait forever), warning after
``stall_warning`` seconds (``MINIDL_STALL_WARNING_SECONDS``, default 60, 0 = never); the
warning and the timeout name the collective, its sequence number, shape, dtype and the ranks
that have not arrived. What a timeout does is the backend's: the threads backend raises
:class:`CollectiveTimeout` on every rank, mpi and nccl print the message and abort the job.

Arrays are raw ndarrays of the backend's device (NumPy for threads/mpi/local, CuPy for nccl).
Results are identical on every rank: reductions combine the ranks' arrays in a fixed order
(threads: rank order) so no rank sees a different rounding than another.

A backend implements only the private primitives below (``_allreduce``, ``_allgather``,
``_reduce_scatter``, ``_bcast``, ``_alltoall``, ``_barrier``, ``_allgather_object``,
``_split``, optionally ``_iallreduce``) on C-contiguous buffers; this base class turns axes,
``mean``, in-place variants, validation, counting and debug checks into calls to them.

Point-to-point messages (``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv``) are
not collective: two ranks take part. Their waits are bounded and reported like the collectives'
(the peer is the rank that has not arrived), and a receive checks what arrives against what it
expects (comm/p2p.py); a backend implements ``_isend`` and ``_irecv``.
"""
import contextlib
import math
import os
import sys
import time
import warnings
from abc import ABC, abstractmethod

import numpy

from .p2p import Fingerprint, P2POp, check_peer, check_tag, mismatch

REDUCE_OPS = ("sum", "mean", "max", "min", "prod")
DEFAULT_TIMEOUT_S = 600.0  # PyTorch's NCCL default: long enough for a slow first step or checkpoint
DEFAULT_STALL_WARNING_S = 60.0  # Horovod's stall inspector warns after 60 s

__all__ = ["Communicator", "Request", "Started", "REDUCE_OPS", "CollectiveTimeout", "CollectiveStallWarning",
           "debug_enabled", "debug_level", "timeout_from_env", "stall_warning_from_env"]


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than its communicator's ``timeout`` for the other ranks."""


class CollectiveStallWarning(RuntimeWarning):
    """A collective has waited ``stall_warning`` seconds; it goes on waiting until the timeout."""


def debug_level():
    """``MINIDL_DIST_DEBUG`` as a level: 0 (off), 1 (fingerprints: op, seq, shape, dtype) or
    2 (1 plus the call site); "true", "yes" and "on" mean 1."""
    value = os.environ.get("MINIDL_DIST_DEBUG", "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return 0
    if value in ("1", "true", "yes", "on"):
        return 1
    if value == "2":
        return 2
    raise ValueError(f"MINIDL_DIST_DEBUG must be 0, 1 or 2 (or true/false), got {value!r}")


def debug_enabled():
    """True when ``MINIDL_DIST_DEBUG`` is set to a level >= 1."""
    return debug_level() > 0


def _seconds_from_env(name, default):
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds (0 = off), got {value!r}") from None
    # NaN compares false with every deadline: it would silently mean "wait forever".
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{name} must be a finite number of seconds >= 0 (0 = off), got {value!r}")
    return seconds


def timeout_from_env():
    """``MINIDL_COLLECTIVE_TIMEOUT`` in seconds (default 600; 0 turns the timeout off)."""
    return _seconds_from_env("MINIDL_COLLECTIVE_TIMEOUT", DEFAULT_TIMEOUT_S)


def stall_warning_from_env():
    """``MINIDL_STALL_WARNING_SECONDS`` (default 60; 0 turns the warning off)."""
    return _seconds_from_env("MINIDL_STALL_WARNING_SECONDS", DEFAULT_STALL_WARNING_S)


def _check_seconds(value, who):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{who} must be a finite number of seconds >= 0 (0 = off), got {value!r}")
    return float(value)


class CallInfo:
    """What a rank is doing in a collective or a point-to-point message: name, sequence number,
    shape, dtype and, for a send or receive, the peer and tag (for messages)."""

    __slots__ = ("name", "seq", "shape", "dtype", "phase", "peer", "tag")

    def __init__(self, name, seq, shape, dtype, phase="", peer=None, tag=None):
        self.name, self.seq, self.shape, self.dtype, self.phase = name, seq, shape, dtype, phase
        self.peer, self.tag = peer, tag

    def key(self):
        """What two ranks waiting in the same collective share."""
        return (self.name, self.seq, self.phase)

    def __str__(self):
        args = "" if self.shape is None else f"shape={self.shape}, dtype={self.dtype}"
        phase = f" ({self.phase})" if self.phase else ""
        if self.peer is not None:
            direction = "to" if self.name == "send" else "from"
            return f"{self.name} #{self.seq} {direction} rank {self.peer} (tag {self.tag}, {args}){phase}"
        return f"{self.name} #{self.seq}({args}){phase}"


class Started:
    """A started message's wait function (called to complete it) with ``test()``: whether it has
    completed, without waiting. Backends return one from ``_isend`` / ``_irecv`` when completion
    can be asked (MPI's Test, a mailbox that holds the message)."""

    __slots__ = ("_wait", "test")

    def __init__(self, wait, test):
        self._wait, self.test = wait, test

    def __call__(self):
        self._wait()


class Request:
    """A pending non-blocking collective; ``wait()`` completes it and returns its array.

    Args:
        wait_fn: completes the communication (None when it already completed).
        array: the array the collective writes into (returned by ``wait``).
        finish: called once after ``wait_fn`` (copy-back, mean's division).
    """

    def __init__(self, wait_fn, array, finish=None):
        self._wait_fn = wait_fn
        self._array = array
        self._finish = finish
        self._done = False

    def wait(self):
        if not self._done:
            if self._wait_fn is not None:
                self._wait_fn()
            if self._finish is not None:
                self._finish()
            self._done = True
            self._wait_fn = self._finish = None  # (their closures hold buffers: a completed request lets go)
        return self._array

    def test(self):
        """Whether the communication has completed, without waiting (completing the request when it
        has: the Request then holds its array no more than ``wait`` does). A backend whose wait
        function is a :class:`Started` answers from its ``test``; a request without a wait function
        (the threads backend's buffered sends, nccl's stream-ordered messages) has completed once
        started. Other non-blocking collectives cannot be asked: they answer False until waited."""
        if not self._done:
            if self._wait_fn is not None and not (isinstance(self._wait_fn, Started) and self._wait_fn.test()):
                return False
            self.wait()
        return True

    @property
    def done(self):
        return self._done


def _check_op(op, who):
    if op not in REDUCE_OPS:
        raise ValueError(f"{who}: op must be one of {REDUCE_OPS}, got {op!r}")


def _norm_axis(axis, ndim, who):
    if not isinstance(axis, int) or isinstance(axis, bool) or not -ndim <= axis < ndim:
        raise ValueError(f"{who}: axis must be an int in [{-ndim}, {ndim - 1}] for an array of {ndim} "
                         f"dimensions, got {axis!r}")
    return axis % ndim


def _xp(x):
    mod = type(x).__module__
    if mod.startswith("cupy"):
        import cupy
        return cupy
    import numpy
    return numpy


class Communicator(ABC):
    """A group of ranks that run collectives together; backends implement the primitives.

    Attributes:
        rank, size: this rank's index in the group and the group's size.
        local_rank, local_size: the same among the ranks on this machine.
        collective_count: how many collectives this rank has called on this communicator
            (one per public call: allreduce, allreduce_, iallreduce_, allgather,
            reduce_scatter, broadcast, alltoall, barrier), for tests that count them.
        sent_messages, sent_bytes, received_messages, received_bytes: the point-to-point
            messages (send, isend, recv, irecv) this rank has started on this communicator.
        debug: 0, 1 or 2 (True means 1): whether every collective first checks that all
            ranks make the same call, and with level 2 from the same line
            (default: the ``MINIDL_DIST_DEBUG`` environment variable).
        timeout: seconds a collective waits for the other ranks before the job ends
            (default ``MINIDL_COLLECTIVE_TIMEOUT`` or 600; 0 = no timeout). Settable.
        stall_warning: seconds after which a waiting collective warns, naming the ranks that
            have not arrived (default ``MINIDL_STALL_WARNING_SECONDS`` or 60; 0 = never).
    """

    backend = "base"

    def __init__(self, rank, size, local_rank=None, local_size=None, debug=None, timeout=None,
                 stall_warning=None):
        self._rank = int(rank)
        self._size = int(size)
        self._local_rank = self._rank if local_rank is None else int(local_rank)
        self._local_size = self._size if local_size is None else int(local_size)
        self.debug = debug_level() if debug is None else _check_debug(debug)
        self.timeout = timeout_from_env() if timeout is None else _check_seconds(timeout, "timeout")
        self.stall_warning = (stall_warning_from_env() if stall_warning is None
                              else _check_seconds(stall_warning, "stall_warning"))
        self.collective_count = 0
        self.sent_messages = self.sent_bytes = self.received_messages = self.received_bytes = 0
        self._p2p_seq = {}  # (kind, peer, tag) -> messages so far: pairs a send with its receive
        self._p2p_label = ""  # what the messages started now are for (labelled), printed in their stalls
        self._call = CallInfo("(none)", -1, None, None)  # the latest collective begun, for messages

    def _settings(self):
        """The keyword arguments a sub-communicator inherits."""
        return {"debug": self.debug, "timeout": self.timeout, "stall_warning": self.stall_warning}

    # ---- identity -----------------------------------------------------------------------

    @property
    def rank(self):
        return self._rank

    @property
    def size(self):
        return self._size

    @property
    def local_rank(self):
        return self._local_rank

    @property
    def local_size(self):
        return self._local_size

    def __repr__(self):
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"

    # ---- primitives a backend implements (C-contiguous buffers, op never "mean") --------

    @abstractmethod
    def _allreduce(self, buf, op):
        """Reduces ``buf`` over all ranks in place (op: sum, max, min or prod)."""

    def _iallreduce(self, buf, op):
        """Starts an in-place all-reduce and returns a function that waits for it.

        The default completes it at once; backends with real non-blocking collectives
        override it. Either way ranks must start non-blocking collectives in the same order.
        """
        self._allreduce(buf, op)
        return None

    @abstractmethod
    def _allgather(self, x):
        """Returns an array of shape ``(size,) + x.shape`` whose row r is rank r's x."""

    @abstractmethod
    def _reduce_scatter(self, x, op):
        """``x`` has shape ``(size,) + s``; returns the reduction of row ``rank`` over ranks."""

    @abstractmethod
    def _bcast(self, buf, root):
        """Overwrites ``buf`` with root's ``buf`` in place."""

    @abstractmethod
    def _alltoall(self, x):
        """``x`` has shape ``(size,) + s``; returns y with ``y[r]`` = row ``self.rank`` of rank r's x."""

    @abstractmethod
    def _barrier(self):
        """Returns once every rank has called it."""

    @abstractmethod
    def _allgather_object(self, obj):
        """Returns the list of every rank's small picklable ``obj``, in rank order."""

    @abstractmethod
    def _split(self, ranks):
        """Returns the communicator over ``ranks`` (this group's rank numbers, in that order)."""

    def _isend(self, buf, dest, tag, call, fingerprint):
        """Starts sending the C-contiguous ``buf`` to ``dest``; returns a function that waits until
        buf may be written again (None when it already may). ``fingerprint`` (p2p.Fingerprint)
        travels with the message where the backend carries it."""
        raise NotImplementedError(f"the {self.backend} backend has no point-to-point messages")

    def _irecv(self, buf, source, tag, call, fingerprint):
        """Starts receiving into the C-contiguous ``buf`` from ``source``; returns a function that
        waits for the message (bounded by ``timeout``) and raises when it does not fit
        ``fingerprint`` (what this rank expects)."""
        raise NotImplementedError(f"the {self.backend} backend has no point-to-point messages")

    def _p2p_batch(self):
        """A context in which the sends and receives started form one batch (nccl: one group)."""
        return contextlib.nullcontext()

    def release(self):
        """Frees the backend's resources; the communicator is unusable afterwards."""

    # ---- the public collectives ---------------------------------------------------------

    def allreduce(self, x, op="sum"):
        """Returns a new array: the element-wise reduction of every rank's x.

        Args:
            x: array of the same shape and dtype on every rank.
            op: "sum", "mean" (sum, then divided by size; floating dtypes only), "max",
                "min" or "prod".
        """
        _check_op(op, "allreduce")
        self._begin("allreduce", x, op=op)
        buf = _xp(x).array(x, order="C", copy=True)
        self._reduce_into(buf, op, "allreduce")
        return buf

    def allreduce_(self, x, op="sum"):
        """Like :meth:`allreduce` but writes the result into x and returns x."""
        _check_op(op, "allreduce_")
        self._begin("allreduce_", x, op=op)
        buf = self._contiguous(x)
        self._reduce_into(buf, op, "allreduce_")
        if buf is not x:
            x[...] = buf
        return x

    def iallreduce_(self, x, op="sum"):
        """Starts an in-place all-reduce of x and returns a :class:`Request`.

        x must not be read or written until ``request.wait()`` returns (which returns x).
        Non-blocking collectives, like blocking ones, must be started in the same order on
        every rank.
        """
        _check_op(op, "iallreduce_")
        self._begin("iallreduce_", x, op=op)
        self._check_mean_dtype(x, op, "iallreduce_")
        buf = self._contiguous(x)
        wait_fn = self._iallreduce(buf, "sum" if op == "mean" else op)

        def finish():
            if op == "mean":
                buf[...] *= buf.dtype.type(1.0 / self.size)  # a multiply is cheaper than a divide
            if buf is not x:
                x[...] = buf
        return Request(wait_fn, x, finish)

    def allgather(self, x, axis=0):
        """Returns the concatenation along ``axis`` of every rank's x, in rank order.

        x has the same shape on every rank; a 0-d x is gathered into shape (size,).
        """
        if x.ndim == 0:
            x = x.reshape(1)
        axis = _norm_axis(axis, x.ndim, "allgather")
        self._begin("allgather", x, axis=axis)
        xp = _xp(x)
        gathered = self._allgather(xp.ascontiguousarray(x))
        if axis == 0:
            return gathered.reshape((self.size * x.shape[0],) + x.shape[1:])
        return xp.concatenate([gathered[r] for r in range(self.size)], axis=axis)

    def reduce_scatter(self, x, op="sum", axis=0):
        """Reduces every rank's x, then returns this rank's block of it along ``axis``.

        ``x.shape[axis]`` must be divisible by size; rank r gets block r, of length
        ``x.shape[axis] // size``.
        """
        _check_op(op, "reduce_scatter")
        axis = _norm_axis(axis, x.ndim, "reduce_scatter")
        if x.shape[axis] % self.size:
            raise ValueError(f"reduce_scatter: x.shape[{axis}] = {x.shape[axis]} must be divisible by the group "
                             f"size {self.size} (x of shape {tuple(x.shape)})")
        self._check_mean_dtype(x, op, "reduce_scatter")
        self._begin("reduce_scatter", x, op=op, axis=axis)
        blocks = self._blocks(x, axis)
        out = self._reduce_scatter(blocks, "sum" if op == "mean" else op)
        if op == "mean":
            out /= self.size
        return out

    def broadcast(self, x, root=0):
        """Returns a new array holding root's x on every rank (x has the same shape everywhere)."""
        self._check_root(root, "broadcast")
        self._begin("broadcast", x, root=root)
        buf = _xp(x).array(x, order="C", copy=True)
        self._bcast(buf, root)
        return buf

    def alltoall(self, x, split_axis=0, concat_axis=0):
        """Splits x into size blocks along split_axis, sends block r to rank r, and concatenates
        the blocks received (in rank order) along concat_axis.

        ``x.shape[split_axis]`` must be divisible by size.
        """
        split_axis = _norm_axis(split_axis, x.ndim, "alltoall")
        concat_axis = _norm_axis(concat_axis, x.ndim, "alltoall")
        if x.shape[split_axis] % self.size:
            raise ValueError(f"alltoall: x.shape[{split_axis}] = {x.shape[split_axis]} must be divisible by the "
                             f"group size {self.size} (x of shape {tuple(x.shape)})")
        self._begin("alltoall", x, split_axis=split_axis, concat_axis=concat_axis)
        received = self._alltoall(self._blocks(x, split_axis))
        return _xp(x).concatenate([received[r] for r in range(self.size)], axis=concat_axis)

    def allgather_object(self, obj):
        """Returns every rank's small picklable ``obj``, in rank order (for agreement checks:
        names, shapes, counts; never for tensors, which go through :meth:`allgather`)."""
        self._begin("allgather_object", None)
        return self._allgather_object(obj)

    def barrier(self):
        """Returns once every rank of the group has called it."""
        self._begin("barrier", None)
        self._barrier()

    def split(self, ranks):
        """Returns the communicator over ``ranks`` (rank numbers of this group).

        Only the ranks in ``ranks`` call it; ranks of disjoint groups may call it at the
        same time with their own lists. Group rank i is ``ranks[i]``.
        """
        ranks = self._check_ranks(ranks)
        if self.rank not in ranks:
            raise ValueError(f"split: this rank ({self.rank}) is not in ranks {list(ranks)}; only members of "
                             f"the new group call split/new_group")
        return self._split(ranks)

    def new_group(self, ranks):
        """Alias of :meth:`split` (MindSpore/PyTorch spelling)."""
        return self.split(ranks)

    # ---- point-to-point -----------------------------------------------------------------

    def send(self, x, dest, tag=0):
        """Sends x to rank ``dest``, which receives it with ``recv(buf, source=this rank, tag)``.

        Returns once x may be written again: the threads backend copies it, mpi hands it to MPI
        (a large message waits for its receive to start), nccl enqueues it on the current stream
        as its collectives. Messages from one rank to another with one tag arrive in order.
        """
        self.isend(x, dest, tag).wait()

    def recv(self, buf, source, tag=0):
        """Receives the next message of rank ``source`` with ``tag`` into ``buf`` (in place) and
        returns buf. Waits at most ``timeout`` seconds; the timeout names the sender."""
        return self.irecv(buf, source, tag).wait()

    def isend(self, x, dest, tag=0):
        """Starts :meth:`send` and returns a :class:`Request`; x must not be written until its
        ``wait()`` returns."""
        call, fingerprint = self._begin_p2p("send", x, dest, tag)
        wait_fn = self._isend(self._contiguous(x), dest, tag, call, fingerprint)
        self.sent_messages += 1
        self.sent_bytes += int(x.nbytes)
        return Request(wait_fn, x)

    def irecv(self, buf, source, tag=0):
        """Starts :meth:`recv` into ``buf`` and returns a :class:`Request` whose ``wait()`` returns
        buf, filled; buf must not be read or written until then."""
        call, fingerprint = self._begin_p2p("recv", buf, source, tag)
        target = self._contiguous(buf)
        wait_fn = self._irecv(target, source, tag, call, fingerprint)
        self.received_messages += 1
        self.received_bytes += int(buf.nbytes)

        def finish():
            if target is not buf:
                buf[...] = target
        return Request(wait_fn, buf, finish)

    def batch_isend_irecv(self, ops):
        """Starts every :class:`~minidl_parallel.comm.p2p.P2POp` of ``ops`` and returns their
        Requests, in order (PyTorch's ``batch_isend_irecv``).

        A rank that sends to a peer while that peer sends to it (a pipeline stage passing an
        activation forward while the next stage passes a gradient back) must start both before
        waiting: nccl runs the batch as one group, and MPI's large sends wait for their receive.
        """
        ops = list(ops)
        for op in ops:
            if not isinstance(op, P2POp):
                raise TypeError(f"batch_isend_irecv: ops must be P2POp objects, got {type(op).__name__}: {op!r}")
        with self._p2p_batch():
            return [self.isend(op.array, op.peer, op.tag) if op.op == "send" else self.irecv(op.array, op.peer, op.tag)
                    for op in ops]

    @contextlib.contextmanager
    def labelled(self, label):
        """Names what the sends and receives started inside the block are for (a pipeline's "stage 1,
        F3: the activation from stage 0"): stall warnings and timeouts print it after the message."""
        previous, self._p2p_label = self._p2p_label, str(label)
        try:
            yield self
        finally:
            self._p2p_label = previous

    def _begin_p2p(self, kind, x, peer, tag):
        """Checks the peer and tag, numbers the message for its pair, and names it for messages."""
        who = "send" if kind == "send" else "recv"
        if not (isinstance(x, numpy.ndarray) or type(x).__module__.startswith("cupy")):
            raise TypeError(f"{who}: takes a NumPy or CuPy array, got {type(x).__module__}.{type(x).__name__} "
                            f"(a 0-d array is numpy.asarray(value))")
        check_peer(peer, self.rank, self.size, who)
        check_tag(tag, who)
        key = (kind, peer, tag)
        seq = self._p2p_seq.get(key, 0)
        self._p2p_seq[key] = seq + 1
        shape, dtype = tuple(int(d) for d in x.shape), str(x.dtype)
        call = self._call = CallInfo(kind, seq, shape, dtype, self._p2p_label, peer=peer, tag=tag)
        site = _call_site() if self.debug >= 2 else None
        return call, Fingerprint(seq, shape, dtype, site)

    def _check_fingerprint(self, received, expected, call, peer):
        problem = mismatch(received, expected, call, peer)
        if problem is not None:
            raise RuntimeError(f"minidl_parallel: rank {self.rank} of {self.size} ({self.backend} backend): {problem}")

    # ---- helpers ------------------------------------------------------------------------

    def _begin(self, name, x, **params):
        """Counts the collective, remembers it for timeout messages and, in debug mode, checks
        that every rank makes the same call (level 2: from the same line)."""
        seq = self.collective_count
        self.collective_count += 1
        shape = None if x is None else tuple(int(d) for d in x.shape)
        dtype = None if x is None else str(x.dtype)
        self._call = CallInfo(name, seq, shape, dtype)
        if not self.debug:
            return
        sig = (name, shape, dtype, tuple(sorted(params.items())))
        if self.debug >= 2:
            sig += (_call_site(),)
        self._call = CallInfo(name, seq, shape, dtype, "debug check")
        calls = self._allgather_object((seq, sig))
        self._call = CallInfo(name, seq, shape, dtype)
        if any(c != calls[0] for c in calls):
            lines = "; ".join(f"rank {r}: #{s} {_describe(sg)}" for r, (s, sg) in enumerate(calls))
            raise RuntimeError(f"MINIDL_DIST_DEBUG={self.debug}: ranks disagree at collective #{seq} ({name} on "
                               f"rank {self.rank}): {lines}")

    # ---- bounded waiting ----------------------------------------------------------------

    def _wait_for(self, is_done, call=None):
        """Polls ``is_done()`` until it is true, bounded by ``timeout``; warns at ``stall_warning``.

        For waits that cannot block in a call a watchdog thread bounds: nccl's barrier (a CUDA
        event) and the mpi backend without MPI_THREAD_MULTIPLE (non-blocking collectives).
        Latency first: a tight spin of about 50 us (most collectives of a training step finish
        there), then sleeps that double from 20 us up to 1 ms, so a long wait costs little CPU
        and a short one adds at most a few microseconds.
        """
        if is_done():
            return
        call = self._call if call is None else call
        start = time.perf_counter()
        spin_until = start + 50e-6
        while time.perf_counter() < spin_until:
            if is_done():
                return
        warn_at = start + self.stall_warning if self.stall_warning else float("inf")
        deadline = start + self.timeout if self.timeout else float("inf")
        nap = 20e-6
        while not is_done():
            now = time.perf_counter()
            if now >= deadline:
                self._on_timeout(call, now - start)
                return
            if now >= warn_at:
                warn_at = float("inf")
                self._on_stall(call, now - start)
                continue
            if nap >= 1e-3:
                self._serve_peers(call)  # only once the wait is long: answers "where are you?"
            time.sleep(nap)
            nap = min(2 * nap, 1e-3)

    def _missing_ranks(self, call):
        """(ranks that have not arrived at ``call``, a note on what the others do); backends
        that can tell override it."""
        return None, ""

    def _serve_peers(self, call):
        """Hook for backends whose peers ask, on a stall, which collective this rank waits in."""

    def _stall_message(self, call, waited, verb):
        missing, note = self._missing_ranks(call)
        who = "unknown" if missing is None else (str(sorted(missing)) if missing else "none")
        return (f"minidl_parallel: rank {self.rank} of {self.size} ({self.backend} backend): {call} {verb} "
                f"{waited:.1f} s; ranks that have not arrived: {who}{note}")

    def _on_stall(self, call, waited, where=None):
        """Warns; ``where`` (file, line) is the waiting line when a watchdog thread warns for it."""
        message = (self._stall_message(call, waited, "has waited") +
                   f" (the timeout ends the job after {self.timeout:g} s)")
        if where is None:
            warnings.warn(message, CollectiveStallWarning, stacklevel=2)
        else:
            warnings.warn_explicit(message, CollectiveStallWarning, where[0], where[1])

    def _on_timeout(self, call, waited):
        """Ends the wait: the default raises :class:`CollectiveTimeout` on this rank."""
        raise CollectiveTimeout(self._stall_message(call, waited, "timed out after") +
                                " (set MINIDL_COLLECTIVE_TIMEOUT or init(timeout=...) to change the limit)")

    def _reduce_into(self, buf, op, who):
        self._check_mean_dtype(buf, op, who)
        self._allreduce(buf, "sum" if op == "mean" else op)
        if op == "mean":
            buf *= buf.dtype.type(1.0 / self.size)  # a multiply is cheaper than a divide

    @staticmethod
    def _check_mean_dtype(x, op, who):
        if op == "mean" and x.dtype.kind not in "fc":
            raise TypeError(f"{who}: op='mean' needs a floating dtype, got {x.dtype}; use op='sum' for integers")

    @staticmethod
    def _contiguous(x):
        return x if x.flags.c_contiguous else _xp(x).ascontiguousarray(x)

    def _blocks(self, x, axis):
        """x split into size blocks along axis, stacked: shape (size,) + block shape, contiguous."""
        xp = _xp(x)
        shape = x.shape[:axis] + (self.size, x.shape[axis] // self.size) + x.shape[axis + 1:]
        return xp.ascontiguousarray(xp.moveaxis(x.reshape(shape), axis, 0))

    def _check_root(self, root, who):
        if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < self.size:
            raise ValueError(f"{who}: root must be an int in [0, {self.size - 1}], got {root!r}")

    def _check_ranks(self, ranks):
        try:
            ranks = tuple(int(r) for r in ranks)
        except TypeError:
            raise TypeError(f"split: ranks must be a list of ints, got {ranks!r}") from None
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < self.size for r in ranks):
            raise ValueError(f"split: ranks must be distinct ints in [0, {self.size - 1}], got {list(ranks)}")
        return ranks


def _check_debug(debug):
    if debug is True or debug is False:
        return int(debug)
    if debug not in (0, 1, 2):
        raise ValueError(f"debug must be 0, 1, 2, True or False, got {debug!r}")
    return int(debug)


def _package_dirs():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # minidl_parallel/
    dirs = [here + os.sep]
    core = sys.modules.get("minidl")
    core_file = getattr(core, "__file__", None)
    dirs.append((os.path.dirname(os.path.abspath(core_file)) if core_file else
                 os.path.join(os.path.dirname(here), "minidl")) + os.sep)
    return tuple(dirs)


_PACKAGE_DIRS = None
_INSIDE = {}  # co_filename -> whether it lies in minidl or minidl_parallel (abspath is slow)


def _call_site():
    """file:line of the first frame outside minidl and minidl_parallel (the user's call)."""
    where = user_frame(sys._getframe(2))
    return "(inside minidl)" if where is None else f"{where[0]}:{where[1]}"


def user_frame(frame):
    """(file, line) of ``frame`` or the first of its callers outside minidl and minidl_parallel."""
    global _PACKAGE_DIRS
    if _PACKAGE_DIRS is None:
        _PACKAGE_DIRS = _package_dirs()
    while frame is not None:
        filename = frame.f_code.co_filename
        inside = _INSIDE.get(filename)
        if inside is None:
            inside = _INSIDE[filename] = os.path.abspath(filename).startswith(_PACKAGE_DIRS)
        if not inside:
            return filename, frame.f_lineno
        frame = frame.f_back
    return None


def _describe(sig):
    name, shape, dtype, params = sig[:4]
    args = [f"shape={shape}", f"dtype={dtype}"] if shape is not None else []
    args += [f"{k}={v!r}" for k, v in params]
    site = f" at {sig[4]}" if len(sig) > 4 else ""
    return f"{name}({', '.join(args)}){site}"
