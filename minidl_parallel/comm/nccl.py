"""The nccl backend: CuPy's NCCL bindings on CuPy arrays (``pip install 'minidl[gpu]'``).

One process per GPU, launched by mpirun: MPI carries the NCCL unique id from rank 0 (and the
small objects of the debug checks); the device is the local rank. Collectives run on the
current CuPy stream, so they order after the kernels that produced their inputs;
``iallreduce_`` runs on a side stream that waits for the current one, so a gradient bucket
can travel while backward keeps computing.

Timeouts (written from CuPy's ``cupy_backends/cuda/libs/nccl.pyx``; the watchdog's logic is
tested with stand-ins for CuPy's events and communicator, never yet on a GPU): NCCL calls
return as soon as they are enqueued, so the host never waits in them. A watchdog thread (as PyTorch's ProcessGroupNCCL) follows each
collective with a CUDA event: it calls ``check_async_error()``, warns at ``stall_warning``,
and at ``timeout`` asks the other ranks over the MPI watch channel who has not arrived,
prints the message, ``abort()``s the NCCL communicator (which frees the stuck kernels) and
``MPI.COMM_WORLD.Abort(1)``. Barriers and the object gathers of the debug checks go over an
inner :class:`~minidl_parallel.comm.mpi.MpiCommunicator`, bounded like the mpi backend's.
"""
import atexit
import collections
import sys
import threading
import time

from .base import Communicator
from .mpi import MpiCommunicator, import_mpi, watch

__all__ = ["NcclCommunicator", "import_nccl", "stop_watchdogs"]


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


_stopping = threading.Event()
_watchdogs = []  # the started watchdog threads, stopped at exit


def _start_watchdog(thread):
    if not _watchdogs:
        # atexit runs before mpi4py's MPI_Finalize (a C-level exit hook), and after init's exit
        # guard registered earlier: the threads must leave the MPI side channel before either.
        atexit.register(stop_watchdogs)
    _watchdogs.append(thread)
    thread.start()


def stop_watchdogs(wait_s=1.0):
    """Stops every nccl watchdog thread of this process (at exit; they use MPI)."""
    _stopping.set()
    for thread in _watchdogs:
        if thread is not threading.current_thread():
            thread.join(wait_s)


class NcclCommunicator(Communicator):
    """A communicator over NCCL, bootstrapped over an mpi4py communicator.

    Args:
        mpi_comm: the mpi4py communicator of the same ranks (default COMM_WORLD).
        device: the CUDA device of this rank (default: the local rank).
        debug, timeout, stall_warning: see :class:`Communicator`.
    """

    backend = "nccl"

    def __init__(self, mpi_comm=None, device=None, debug=None, timeout=None, stall_warning=None):
        cupy, nccl = import_nccl()
        import_mpi()
        self._cupy, self._nccl_mod = cupy, nccl
        # The inner mpi communicator (made with comm=None for the world, so it makes the watch).
        self._mpi = MpiCommunicator(mpi_comm, debug=0, timeout=timeout, stall_warning=stall_warning)
        self.mpi_comm = self._mpi.comm
        super().__init__(self._mpi.rank, self._mpi.size, self._mpi.local_rank, self._mpi.local_size,
                         debug=debug, timeout=timeout, stall_warning=stall_warning)
        self.device = self.local_rank if device is None else int(device)
        cupy.cuda.Device(self.device).use()
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = self.mpi_comm.bcast(uid, root=0)
        self.comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        self._side_stream = None
        self._pending = collections.deque()  # (CUDA event, CallInfo, start time) the watchdog follows
        self._watchdog = None
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
        self._follow(stream)

    # ---- the watchdog -------------------------------------------------------------------

    def _follow(self, stream=None):
        """Hands the collective just enqueued on ``stream`` to the watchdog thread."""
        if not (self.timeout or self.stall_warning):
            return
        stream = self._cupy.cuda.get_current_stream() if stream is None else stream
        self._pending.append((stream.record(), self._call, time.monotonic()))
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch_loop, name="minidl-nccl-watchdog", daemon=True)
            _start_watchdog(self._watchdog)

    def _watch_loop(self):
        self._cupy.cuda.Device(self.device).use()
        warned = None
        while self.comm is not None and not _stopping.is_set():
            time.sleep(0.01)  # only deadlines matter here: the host does not wait on NCCL
            while self._pending:
                event, call, start = self._pending[0]
                if event.done:
                    self._pending.popleft()
                    continue
                waited = time.monotonic() - start
                try:
                    self.comm.check_async_error()
                except Exception as exc:  # noqa: B902 - any NCCL error ends the job
                    self._end_job(f"minidl_parallel: rank {self.rank}: NCCL reported an error during {call}: {exc}")
                self._mpi._serve_peers(call)
                if self.timeout and waited >= self.timeout:
                    self._end_job(self._stall_message(call, waited, "timed out after") +
                                  f"; aborting NCCL and the MPI job (timeout {self.timeout:g} s)")
                if self.stall_warning and waited >= self.stall_warning and warned is not call:
                    warned = call
                    sys.stderr.write(self._stall_message(call, waited, "has waited") + "\n")
                break

    def _missing_ranks(self, call):
        return self._mpi._missing_ranks(call) if watch() is not None else (None, "")

    def _end_job(self, message):
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        try:
            self.comm.abort()  # frees the NCCL kernels that wait for the missing ranks
        finally:
            import_mpi().COMM_WORLD.Abort(1)

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
        self._follow()
        return out

    def _reduce_scatter(self, x, op):
        out = self._cupy.empty(x.shape[1:], dtype=x.dtype)
        self.comm.reduceScatter(x.data.ptr, out.data.ptr, out.size, self._dtype(x), self._ops[op], self._stream())
        self._follow()
        return out

    def _bcast(self, buf, root):
        self.comm.bcast(buf.data.ptr, buf.size, self._dtype(buf), root, self._stream())
        self._follow()

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
        self._follow()
        return out

    def _inner(self):
        """The inner mpi communicator, told which collective this is (for its messages)."""
        self._mpi._call = self._call
        self._mpi.timeout, self._mpi.stall_warning = self.timeout, self.stall_warning
        return self._mpi

    def _barrier(self):
        done = self._cupy.cuda.get_current_stream().record()
        self._wait_for(lambda: done.done)  # the GPU work before the barrier, bounded too
        self._inner()._barrier()

    def _allgather_object(self, obj):
        return self._inner()._allgather_object(obj)

    def _on_timeout(self, call, waited):
        self._end_job(self._stall_message(call, waited, "timed out after") +
                      f"; aborting NCCL and the MPI job (timeout {self.timeout:g} s)")

    def _split(self, ranks):
        group = self.mpi_comm.Get_group().Incl(list(ranks))
        sub = self.mpi_comm.Create_group(group)
        group.Free()
        return NcclCommunicator(sub, device=self.device, **self._settings())

    def release(self):
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None
            self._mpi.release()
