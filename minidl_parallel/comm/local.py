"""The world of one process: every collective returns this rank's own data."""
from .base import Communicator

__all__ = ["LocalCommunicator"]


class LocalCommunicator(Communicator):
    """A communicator of size 1 (``init()`` outside mpirun); the collectives are copies."""

    backend = "local"

    def __init__(self, debug=None, timeout=None, stall_warning=None):
        # One rank never waits for another: the timeout settings are kept only for split().
        super().__init__(0, 1, debug=debug, timeout=timeout, stall_warning=stall_warning)

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

    def _split(self, ranks):
        return LocalCommunicator(**self._settings())
