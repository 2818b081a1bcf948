"""Counting host synchronisations: each place where a real GPU would make the host wait.

``get()``, ``cupy.asnumpy``, ``float()``/``int()``/``bool()``/``item()``/``tolist()``, printing,
pickling, boolean-mask indexing (the result's size must reach the host) and explicit
``synchronize()`` calls each count one. Tests budget them per training step:

    with count_host_syncs() as syncs:
        step()
    assert syncs.total <= 1, syncs.by_reason
"""
import collections
import contextlib
import threading

_lock = threading.Lock()
_totals = collections.Counter()
_uploads = [0]


def record(reason):
    """Counts one host synchronisation, labelled with what caused it."""
    with _lock:
        _totals[reason] += 1


def record_upload():
    """Counts one host -> device copy (asarray of host data); not a sync, but a cost."""
    with _lock:
        _uploads[0] += 1


def host_syncs():
    """Host synchronisations since the last reset()."""
    with _lock:
        return sum(_totals.values())


def uploads():
    """Host -> device copies since the last reset()."""
    with _lock:
        return _uploads[0]


def reset():
    with _lock:
        _totals.clear()
        _uploads[0] = 0


class SyncCount:
    """What happened inside one ``count_host_syncs()`` block (read after or during it)."""

    def __init__(self):
        with _lock:
            self._start = collections.Counter(_totals)
            self._start_uploads = _uploads[0]

    @property
    def by_reason(self):
        with _lock:
            diff = collections.Counter(_totals)
        diff.subtract(self._start)
        return {k: v for k, v in diff.items() if v}

    @property
    def total(self):
        return sum(self.by_reason.values())

    @property
    def uploads(self):
        with _lock:
            return _uploads[0] - self._start_uploads


@contextlib.contextmanager
def count_host_syncs():
    """Measures the host synchronisations (all threads) inside the block."""
    yield SyncCount()
