"""N ranks as N threads of one process: the MPI semantics, for tests and notebooks.

Each collective is an exchange through a shared group object: every rank puts a copy of its
contribution in its slot, waits at a barrier, computes its result from all slots, and waits
at a second barrier (so nobody overwrites a slot another rank is still reading). Reductions
add the slots in rank order, so every rank gets bit-identical results.

A rank that raises, or returns while others wait for it in a collective, must not hang the
rest: barriers poll the world's state and raise :class:`CollectiveAborted` then. A rank that
stalls is caught by the communicator's ``timeout``: the barrier knows who has arrived, so the
rank that times out raises :class:`~minidl_parallel.comm.base.CollectiveTimeout` naming the
ranks that have not, and aborts the world (the others raise CollectiveAborted with the same
reason); ``stall_warning`` warns with the same names first.

Worlds of several ranks are started by :func:`minidl_parallel.run_threads`, which gives
every thread its parallel runtime (as ``init()`` does for a process):

Example:
    >>> import numpy as np
    >>> from minidl_parallel import get_communicator, get_rank, run_threads
    >>> run_threads(2, lambda: get_communicator().allreduce(np.array([get_rank() + 1.0])))
    [array([3.]), array([3.])]
"""
import collections
import threading
import time
import warnings

import numpy

from .base import CollectiveStallWarning, CollectiveTimeout, Communicator, Started

__all__ = ["ThreadsCommunicator", "ThreadsWorld", "CollectiveAborted", "run_ranks"]

_POLL_S = 0.05
_REDUCERS = {"sum": numpy.add, "max": numpy.maximum, "min": numpy.minimum, "prod": numpy.multiply}


class CollectiveAborted(RuntimeError):
    """Raised in a rank's pending collective when another rank failed or left the world."""


class ThreadsWorld:
    """The state shared by the N thread-ranks: failure flag, finished ranks, sub-groups."""

    def __init__(self, size):
        self.size = size
        self.failed = None  # description of the first failure, once there is one
        self.finished = [False] * size
        self._lock = threading.Lock()
        self._groups = {}
        self._mailboxes = {}

    def abort(self, why):
        with self._lock:
            if self.failed is None:
                self.failed = why

    def mailbox(self, key):
        """The queue of messages for ``key`` (group, sender, receiver, tag), made on first use."""
        with self._lock:
            if key not in self._mailboxes:
                self._mailboxes[key] = _Mailbox()
            return self._mailboxes[key]

    def group(self, key, members):
        """The shared group for ``key``, created by whichever member asks first."""
        with self._lock:
            if key not in self._groups:
                self._groups[key] = _Group(self, members)
            return self._groups[key]


class _Mailbox:
    """The messages one rank sent another with one tag, oldest first (MPI's non-overtaking order)."""

    def __init__(self):
        self.messages = collections.deque()
        self.cond = threading.Condition()

    def put(self, message):
        with self.cond:
            self.messages.append(message)
            self.cond.notify_all()

    def take(self, comm, call, source):
        """The oldest message, waiting for it; a sender that failed or returned, the world's
        failure and the communicator's timeout end the wait, naming the sender."""
        world, group = comm._world, comm._group
        sender = group.members[source]
        with self.cond:
            start = time.monotonic()
            warned = False
            while not self.messages:
                if world.failed is not None:
                    raise CollectiveAborted(f"threads backend: rank {comm.world_rank}: {call} aborted because "
                                            f"{world.failed}")
                if world.finished[sender]:
                    message = (f"threads backend: rank {comm.rank} of {comm.size}: {call} can never complete: rank "
                               f"{source} returned without sending it")
                    world.abort(message)
                    raise CollectiveAborted(message)
                waited = time.monotonic() - start
                if comm.timeout and waited >= comm.timeout:
                    message = _p2p_stall_message(comm, call, source, waited, "timed out after")
                    world.abort(message)
                    raise CollectiveTimeout(message + " (set MINIDL_COLLECTIVE_TIMEOUT or init(timeout=...) to "
                                            "change the limit)")
                if comm.stall_warning and not warned and waited >= comm.stall_warning:
                    warned = True
                    warnings.warn(_p2p_stall_message(comm, call, source, waited, "has waited"),
                                  CollectiveStallWarning, stacklevel=4)
                self.cond.wait(_POLL_S if not comm.timeout else min(_POLL_S, comm.timeout / 10))
            return self.messages.popleft()


def _p2p_stall_message(comm, call, source, waited, verb):
    sender = comm._group.members[source]
    world = "" if sender == source else f" (world rank {sender})"
    return (f"threads backend: rank {comm.rank} of {comm.size}: {call} {verb} {waited:.1f} s; ranks that have not "
            f"arrived: [{source}]{world} (the sender has not sent it)")


class _Group:
    def __init__(self, world, members):
        self.world = world
        self.members = tuple(members)  # world ranks, in group-rank order
        self.slots = [None] * len(members)
        self._cond = threading.Condition()
        self._arrived = set()  # group ranks waiting at the barrier of this generation
        self._generation = 0

    def wait(self, group_rank, what, comm=None):
        """Returns once every member has called it; bounded by ``comm``'s timeout."""
        with self._cond:
            # A failed world fails a rank that arrives last too: else its barrier would
            # complete with the slot of a rank that already raised (timed out or aborted).
            self._check_alive(group_rank, what)
            gen = self._generation
            self._arrived.add(group_rank)
            if len(self._arrived) == len(self.members):
                self._arrived = set()
                self._generation += 1
                self._cond.notify_all()
                return
            start = time.monotonic()
            warned = False
            while self._generation == gen:
                try:
                    self._check_alive(group_rank, what)
                except CollectiveAborted:
                    self._arrived.discard(group_rank)
                    raise
                waited = time.monotonic() - start
                if comm is not None and comm.timeout and waited >= comm.timeout:
                    message = self._stall_message(group_rank, what, comm, waited, "timed out after")
                    self._arrived.discard(group_rank)  # it leaves: the barrier must not count it
                    self.world.abort(message)
                    raise CollectiveTimeout(message + " (set MINIDL_COLLECTIVE_TIMEOUT or "
                                            "init(timeout=...) to change the limit)")
                if comm is not None and comm.stall_warning and not warned and waited >= comm.stall_warning:
                    warned = True
                    warnings.warn(self._stall_message(group_rank, what, comm, waited, "has waited"),
                                  CollectiveStallWarning, stacklevel=2)
                self._cond.wait(_POLL_S if comm is None or not comm.timeout else min(_POLL_S, comm.timeout / 10))

    def _stall_message(self, group_rank, what, comm, waited, verb):
        missing = [r for r in range(len(self.members)) if r not in self._arrived]
        world = "" if list(self.members) == list(range(len(self.members))) else \
            f" (world ranks {[self.members[r] for r in missing]})"
        return (f"threads backend: rank {group_rank} of {len(self.members)}: {comm._call} {verb} "
                f"{waited:.1f} s; ranks that have not arrived: {missing}{world} [{what}]")

    def _check_alive(self, group_rank, what):
        world = self.world
        me = self.members[group_rank]
        if world.failed is not None:
            raise CollectiveAborted(f"threads backend: rank {me}: {what} aborted because {world.failed}")
        gone = [m for m in self.members if world.finished[m]]
        if gone:
            world.abort(f"rank(s) {gone} returned while rank {me} waited for them in {what}")
            raise CollectiveAborted(f"threads backend: rank {me}: {what} can never complete: rank(s) {gone} "
                                    f"already returned (ranks called different collectives)")

    def exchange(self, group_rank, value, what, comm=None):
        """Every member's ``value``, in group-rank order (call with the same ``what`` on all)."""
        self.slots[group_rank] = value
        self.wait(group_rank, what, comm)
        values = list(self.slots)
        self.wait(group_rank, what, comm)
        return values


class ThreadsCommunicator(Communicator):
    """A communicator whose ranks are threads sharing a :class:`ThreadsWorld`."""

    backend = "threads"

    def __init__(self, world, group, rank, debug=None, timeout=None, stall_warning=None):
        super().__init__(rank, len(group.members), debug=debug, timeout=timeout, stall_warning=stall_warning)
        self._world = world
        self._group = group
        self._split_calls = {}

    @property
    def world_rank(self):
        return self._group.members[self.rank]

    def _exchange(self, value, what):
        return self._group.exchange(self.rank, value, what, self)

    def _allreduce(self, buf, op):
        values = self._exchange(buf.copy(), f"allreduce(op={op!r})")
        _check_same(values, "allreduce")
        fn = _REDUCERS[op]
        acc = values[0].copy()
        for v in values[1:]:
            fn(acc, v, out=acc)
        buf[...] = acc

    def _allgather(self, x):
        values = self._exchange(x.copy(), "allgather")
        _check_same(values, "allgather")
        return numpy.stack(values)

    def _reduce_scatter(self, x, op):
        values = self._exchange(x.copy(), f"reduce_scatter(op={op!r})")
        _check_same(values, "reduce_scatter")
        fn = _REDUCERS[op]
        acc = values[0][self.rank].copy()
        for v in values[1:]:
            fn(acc, v[self.rank], out=acc)
        return acc

    def _bcast(self, buf, root):
        values = self._exchange(buf.copy(), f"broadcast(root={root})")
        _check_same(values, "broadcast")
        buf[...] = values[root]

    def _alltoall(self, x):
        values = self._exchange(x.copy(), "alltoall")
        _check_same(values, "alltoall")
        return numpy.stack([v[self.rank] for v in values])

    def _barrier(self):
        self._group.wait(self.rank, "barrier", self)

    def _allgather_object(self, obj):
        return self._exchange(obj, "debug check")

    def _mailbox(self, sender, receiver, tag):
        return self._world.mailbox((id(self._group), sender, receiver, tag))

    def _isend(self, buf, dest, tag, call, fingerprint):
        # Buffered: the copy is the message, so the sender never waits (MPI allows a Send to
        # complete before its receive starts).
        self._mailbox(self.rank, dest, tag).put((buf.copy(), fingerprint))
        return None

    def _send_fingerprint(self, fingerprint, dest, tag):
        """A fingerprint on its own (the nccl backend's debug check, whose host side this is in tests)."""
        self._mailbox(self.rank, dest, ("fingerprint", tag)).put(fingerprint)

    def _recv_fingerprint(self, source, tag, call):
        return self._mailbox(source, self.rank, ("fingerprint", tag)).take(self, call, source)

    def _irecv(self, buf, source, tag, call, fingerprint):
        mailbox = self._mailbox(source, self.rank, tag)

        def wait():
            data, sent = mailbox.take(self, call, source)
            self._check_fingerprint(sent, fingerprint, call, source)
            buf[...] = data
        return Started(wait, lambda: bool(mailbox.messages))  # (only this rank takes from its mailbox)

    def _split(self, ranks):
        # Members meet on the same key: the ranks and how often this rank asked for them.
        n = self._split_calls.get(ranks, 0)
        self._split_calls[ranks] = n + 1
        members = [self._group.members[r] for r in ranks]
        group = self._world.group((id(self._group), ranks, n), members)
        return ThreadsCommunicator(self._world, group, ranks.index(self.rank), **self._settings())


def _check_same(values, name):
    # MPI would hang or read garbage on mismatched buffers; here every rank sees every slot,
    # so all of them can raise the same error instead.
    shapes = [(tuple(v.shape), str(v.dtype)) for v in values]
    if any(s != shapes[0] for s in shapes):
        detail = ", ".join(f"rank {r}: {s} {d}" for r, (s, d) in enumerate(shapes))
        raise RuntimeError(f"threads backend: {name}: ranks passed different shapes/dtypes ({detail})")


def run_ranks(n, fn, timeout=300.0):
    """Runs ``fn(comm)`` on n threads, each with its rank's communicator of one threads world.

    This is the backend's part of :func:`minidl_parallel.run_threads` (which also gives each
    thread its parallel runtime, as ``init()`` does for a process): starting the threads,
    the deadline, and turning one rank's failure into the others' abort.

    An exception in any rank aborts the others' pending collectives and is re-raised here,
    with "rank r of n" prefixed to its message (the first real failure wins over the
    :class:`CollectiveAborted` it caused elsewhere).

    Args:
        n: number of ranks (>= 1).
        fn: the per-rank function, called with the rank's communicator.
        timeout: seconds to wait for all ranks before raising TimeoutError (the ranks
            still running are aborted at their next collective).

    Returns:
        ``[fn result on rank 0, ..., on rank n - 1]``.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"run_threads: n must be an int >= 1, got {n!r}")
    world = ThreadsWorld(n)
    root = world.group(("world",), range(n))
    results = [None] * n
    errors = {}
    order = []

    def body(rank):
        comm = ThreadsCommunicator(world, root, rank)
        try:
            results[rank] = fn(comm)
        except BaseException as exc:  # noqa: B902 - re-raised in the caller
            errors[rank] = exc
            order.append(rank)
            world.abort(f"rank {rank} raised {type(exc).__name__}: {exc}")
        finally:
            world.finished[rank] = True

    threads = [threading.Thread(target=body, args=(r,), name=f"minidl-rank-{r}", daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [r for r, t in enumerate(threads) if t.is_alive()]
    if alive:
        world.abort(f"run_threads timed out after {timeout} s")
        raise TimeoutError(f"run_threads: ranks {alive} of {n} still running after {timeout} s")
    if errors:
        real = [r for r in order if not isinstance(errors[r], CollectiveAborted)]
        rank = (real or order)[0]
        raise _with_rank(errors[rank], rank, n)
    return results


def _with_rank(exc, rank, n):
    prefix = f"rank {rank} of {n}: "
    if exc.args and isinstance(exc.args[0], str) and not isinstance(exc, KeyError):
        exc.args = (prefix + exc.args[0],) + exc.args[1:]
    else:
        _add_note(exc, prefix + "raised in run_threads")
    return exc


def _add_note(exc, note):
    """``exc.add_note(note)``, also on Python 3.9 and 3.10, which lack it (PEP 678 is 3.11).

    The fallback stores the note where 3.11 does, in ``__notes__``: pytest (``match``) and the
    ``exceptiongroup`` backport's traceback printing read it there on every version.
    """
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:
        exc.__notes__ = list(getattr(exc, "__notes__", ())) + [note]
