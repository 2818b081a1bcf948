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

__all__ = ["CommCounter", "CommEvent", "record"]

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


def record(kind, group_size, bytes_per_rank, phase="forward"):
    """Reports one collective run by this rank (thread) to every open CommCounter."""
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
