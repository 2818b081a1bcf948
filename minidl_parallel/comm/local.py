"""The world of one process: every collective returns this rank's own data."""
import collections

from .base import Communicator, Started

__all__ = ["LocalCommunicator"]


class LocalCommunicator(Communicator):
    """A communicator of size 1 (``init()`` outside mpirun); the collectives are copies."""

    backend = "local"

    def __init__(self, debug=None, timeout=None, stall_warning=None):
        # One rank never waits for another: the timeout settings are kept only for split().
        super().__init__(0, 1, debug=debug, timeout=timeout, stall_warning=stall_warning)
        self._to_self = collections.defaultdict(collections.deque)  # tag -> messages this rank sent itself

    def _allreduce(self, buf, op):
        pass

    def _allgather(self, x):
        return x[None].copy()

    def _reduce_scatter(self, x, op):
        return x[0].copy()

    def _bcast(self, buf, root):
        pass

    def _alltoall(self, x):
        return x.copy()

    def _barrier(self):
        pass

    def _allgather_object(self, obj):
        return [obj]

    def _isend(self, buf, dest, tag, call, fingerprint):
        self._to_self[tag].append((buf.copy(), fingerprint))
        return None

    def _irecv(self, buf, source, tag, call, fingerprint):
        def wait():
            if not self._to_self[tag]:  # no other rank could ever send it
                raise RuntimeError(f"minidl_parallel: {call} can never complete: in a world of one, only this rank "
                                   f"sends, and it has not sent a message with tag {tag}")
            data, sent = self._to_self[tag].popleft()
            self._check_fingerprint(sent, fingerprint, call, source)
            buf[...] = data
        return Started(wait, lambda: bool(self._to_self[tag]))

    def _split(self, ranks):
        return LocalCommunicator(**self._settings())
