"""Counting the collectives that tensor parallelism runs, for tests, explain and benchmarks.

Every collective the redistribution executor or the dispatcher's gradient reduction runs is
reported here with its kind, group size, the bytes this rank sends (see
redistribution.comm_bytes) and whether it ran in forward or backward.

Example:
    >>> with CommCounter() as c:
    ...     loss = train_step(x, y)
    >>> c.count("allreduce", phase="backward"), c.bytes()
"""
import threading
from dataclasses import dataclass

__all__ = ["CommCounter", "CommEvent", "record", "backward_phase", "current_phase", "CountedGroup"]

_tls = threading.local()


@dataclass(frozen=True)
class CommEvent:
    kind: str
    group_size: int
    bytes_per_rank: int
    phase: str


def _active():
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    return stack


def current_phase():
    """"backward" while a sharded operator's backward runs on this thread, else "forward"."""
    return getattr(_tls, "phase", "forward")


class backward_phase:
    """Marks the enclosed code as backward for the collectives it runs (re-entrant)."""

    def __enter__(self):
        self._prev = current_phase()
        _tls.phase = "backward"

    def __exit__(self, *exc):
        _tls.phase = self._prev
        return False


def record(kind, group_size, bytes_per_rank, phase=None):
    """Reports one collective run by this rank (thread) to every open CommCounter."""
    phase = current_phase() if phase is None else phase
    for counter in _active():
        counter.events.append(CommEvent(kind, int(group_size), int(bytes_per_rank), phase))


class CommCounter:
    """Collects the collectives this rank runs inside ``with``: ``events``, ``count()``, ``bytes()``."""

    def __init__(self):
        self.events = []

    def __enter__(self):
        _active().append(self)
        return self

    def __exit__(self, *exc):
        _active().remove(self)
        return False

    def _select(self, kind, phase):
        return [e for e in self.events if (kind is None or e.kind == kind) and (phase is None or e.phase == phase)]

    def count(self, kind=None, phase=None):
        """How many collectives (of ``kind``, in ``phase`` "forward"/"backward") ran."""
        return len(self._select(kind, phase))

    def bytes(self, kind=None, phase=None):
        """The bytes this rank sent in them."""
        return sum(e.bytes_per_rank for e in self._select(kind, phase))

    def summary(self):
        """One line per (phase, kind): count and bytes."""
        keys = sorted({(e.phase, e.kind) for e in self.events})
        return "\n".join(f"{phase:8s} {kind:15s} x{self.count(kind, phase)}  {self.bytes(kind, phase)} B/rank"
                         for phase, kind in keys)


class CountedGroup:
    """A communicator whose all-reduces are reported here (for ops that communicate themselves)."""

    def __init__(self, comm):
        self._comm = comm

    def allreduce(self, x, op="sum"):
        from .plan import comm_bytes
        record("allreduce", self._comm.size, comm_bytes("allreduce", x.nbytes, self._comm.size))
        return self._comm.allreduce(x, op)

    def __getattr__(self, name):
        return getattr(self._comm, name)
