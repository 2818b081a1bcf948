"""The nccl backend: CuPy's NCCL bindings on CuPy arrays (``pip install 'minidl[gpu]'``).

One process per GPU, launched by mpirun: MPI carries the NCCL unique id from rank 0 (and the
small objects of the debug checks); the device is the local rank. Collectives run on the
current CuPy stream, so they order after the kernels that produced their inputs;
``iallreduce_`` runs on a side stream that waits for the current one, so a gradient bucket
can travel while backward keeps computing.
"""
from .base import Communicator
from .mpi import import_mpi

__all__ = ["NcclCommunicator", "import_nccl"]


def import_nccl():
    """(cupy, cupy.cuda.nccl), or ImportError saying which extra to install."""
    try:
        import cupy
        from cupy.cuda import nccl
        nccl.get_unique_id  # noqa: B018 - CuPy builds without NCCL lack it
    except (ImportError, AttributeError) as exc:
        raise ImportError("the nccl backend needs CuPy with NCCL: pip install 'minidl[gpu]' "
                          f"(cupy-cuda12x + nvidia-nccl-cu12) ({exc})") from exc
    return cupy, nccl


class NcclCommunicator(Communicator):
    """A communicator over NCCL, bootstrapped over an mpi4py communicator.

    Args:
        mpi_comm: the mpi4py communicator of the same ranks (default COMM_WORLD).
        device: the CUDA device of this rank (default: the local rank).
        debug: see :class:`Communicator`.
    """

    backend = "nccl"

    def __init__(self, mpi_comm=None, device=None, debug=None):
        cupy, nccl = import_nccl()
        MPI = import_mpi()
        self._cupy, self._nccl_mod = cupy, nccl
        self.mpi_comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        local = self.mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
        super().__init__(self.mpi_comm.Get_rank(), self.mpi_comm.Get_size(), local.Get_rank(), local.Get_size(),
                         debug=debug)
        local.Free()
        self.device = self.local_rank if device is None else int(device)
        cupy.cuda.Device(self.device).use()
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = self.mpi_comm.bcast(uid, root=0)
        self.comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        self._side_stream = None
        self._ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN, "prod": nccl.NCCL_PROD}

    def _dtype(self, x):
        nccl = self._nccl_mod
        table = {"float16": nccl.NCCL_FLOAT16, "float32": nccl.NCCL_FLOAT32, "float64": nccl.NCCL_FLOAT64,
                 "int32": nccl.NCCL_INT32, "int64": nccl.NCCL_INT64, "uint8": nccl.NCCL_UINT8,
                 "int8": nccl.NCCL_INT8, "uint32": nccl.NCCL_UINT32, "uint64": nccl.NCCL_UINT64}
        try:
            return table[str(x.dtype)]
        except KeyError:
            raise TypeError(f"nccl backend: dtype {x.dtype} is not supported; use one of {sorted(table)}") from None

    def _stream(self):
        return self._cupy.cuda.get_current_stream().ptr

    def _allreduce(self, buf, op, stream=None):
        self.comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self._dtype(buf), self._ops[op],
                            self._stream() if stream is None else stream.ptr)

    def _iallreduce(self, buf, op):
        cupy = self._cupy
        if self._side_stream is None:
            self._side_stream = cupy.cuda.Stream(non_blocking=True)
        current = cupy.cuda.get_current_stream()
        self._side_stream.wait_event(current.record())
        self._allreduce(buf, op, stream=self._side_stream)
        done = self._side_stream.record()
        return lambda: current.wait_event(done)

    def _allgather(self, x):
        out = self._cupy.empty((self.size,) + x.shape, dtype=x.dtype)
        self.comm.allGather(x.data.ptr, out.data.ptr, x.size, self._dtype(x), self._stream())
        return out

    def _reduce_scatter(self, x, op):
        out = self._cupy.empty(x.shape[1:], dtype=x.dtype)
        self.comm.reduceScatter(x.data.ptr, out.data.ptr, out.size, self._dtype(x), self._ops[op], self._stream())
        return out

    def _bcast(self, buf, root):
        self.comm.bcast(buf.data.ptr, buf.size, self._dtype(buf), root, self._stream())

    def _alltoall(self, x):
        # NCCL has no all-to-all; grouped point-to-point sends and receives make one.
        nccl = self._nccl_mod
        out = self._cupy.empty_like(x)
        count = x[0].size
        dtype, stream = self._dtype(x), self._stream()
        nccl.groupStart()
        for peer in range(self.size):
            self.comm.send(x[peer].data.ptr, count, dtype, peer, stream)
            self.comm.recv(out[peer].data.ptr, count, dtype, peer, stream)
        nccl.groupEnd()
        return out

    def _barrier(self):
        self._cupy.cuda.get_current_stream().synchronize()
        self.mpi_comm.Barrier()

    def _allgather_object(self, obj):
        return self.mpi_comm.allgather(obj)

    def _split(self, ranks):
        group = self.mpi_comm.Get_group().Incl(list(ranks))
        sub = self.mpi_comm.Create_group(group)
        group.Free()
        return NcclCommunicator(sub, device=self.device, debug=self.debug)

    def release(self):
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None
