"""The nccl backend: CuPy's NCCL bindings on CuPy arrays (``pip install 'minidl[gpu]'``).

One process per GPU, launched by mpirun. An inner :class:`~minidl_parallel.comm.mpi.MpiCommunicator`
of the same ranks carries what is not device data: the NCCL unique id from rank 0, barriers,
the small objects of the debug checks, and host (NumPy) arrays. Collectives on CuPy arrays run
on the current CuPy stream, so they order after the kernels that produced their inputs;
``iallreduce_`` runs on a side stream that waits for the current one, so a gradient bucket
can travel while backward keeps computing.

Host arrays: a job on GPUs still reduces and broadcasts a little host state (the optimizer's
``global_step`` and SGD's ``stat`` flags when ``parameter_broadcast`` is on, the votes of join
blocks, metric sums). A NumPy array given to any collective goes over the inner MPI
communicator, in place, as on the mpi backend: it is a few bytes, and MPI avoids two copies
through the device and the synchronisation that bringing the result back to the host needs.

The GPU of a rank is chosen at construction (``init()``): ``device=`` when given, else the
local rank modulo the number of devices this process sees (``cupy.cuda.runtime.getDeviceCount()``),
so both usual setups work: every process sees every GPU of the machine (rank i takes GPU i),
or every process sees one GPU of its own (``CUDA_VISIBLE_DEVICES`` set per rank, it takes
device 0). Two ranks on one GPU are refused at construction, on every rank, naming the
ranks, the GPU and the counts: NCCL refuses them too ("Duplicate GPU detected"), later and
less clearly. Arrays must live on the rank's GPU: a network built before ``init()`` lives on
the device current then (GPU 0), and a collective on it raises naming both devices, so
build the network after ``init()``.

Timeouts (written from CuPy's ``cupy_backends/cuda/libs/nccl.pyx``; the watchdog's logic is
tested with stand-ins for CuPy's events and communicator, never yet on a GPU): NCCL calls
return as soon as they are enqueued, so the host never waits in them. A watchdog thread (as
PyTorch's ProcessGroupNCCL) follows each collective with a CUDA event: it calls
``check_async_error()`` (an NCCL error on this rank, e.g. a peer's connection lost, ends the
job at once), warns at ``stall_warning``, and at ``timeout`` asks the other ranks over the MPI
watch channel who has not arrived, prints the message, ``abort()``s the NCCL communicator
(which frees the stuck kernels) and ``MPI.COMM_WORLD.Abort(1)``, which ends every rank. Waits
on the inner MPI communicator (host arrays, barriers, object gathers) are bounded as the mpi
backend's.

``release()`` frees the communicator and every sub-communicator split from it: it stops the
watchdog first (so it never polls a destroyed communicator), destroys the NCCL communicators
and frees the MPI ones.
"""
import atexit
import collections
import contextlib
import numbers
import os
import socket
import sys
import threading
import time

import numpy

from .base import CallInfo, Communicator
from .mpi import MpiCommunicator, import_mpi, watch

__all__ = ["NcclCommunicator", "import_nccl", "stop_watchdogs"]

_WATCHDOG_JOIN_S = 5.0  # longest a release waits for the watchdog (its survey window is <= 1 s)


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
    for thread in list(_watchdogs):
        if thread is not threading.current_thread():
            thread.join(wait_s)


def _visible_env():
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "unset" if value is None else repr(value)


def _host_id():
    """What NCCL counts as one machine (its getHostHash): NCCL_HOSTID, else hostname + boot id,
    so that two ranks are said to share a GPU exactly when NCCL would refuse them."""
    forced = os.environ.get("NCCL_HOSTID")
    if forced:
        return forced
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = (f.read().split() or [""])[0]
    except OSError:
        boot = ""
    return socket.gethostname() + boot


def _choose_device(cupy, device, local_rank):
    """(device id, number of devices this process sees); raises naming what CUDA sees."""
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: B902 - CuPy's CUDARuntimeError (no device, driver too old)
        raise RuntimeError(f"CUDA sees no usable GPU (CUDA_VISIBLE_DEVICES {_visible_env()}): "
                           f"{type(exc).__name__}: {exc}") from exc
    if count < 1:
        raise RuntimeError(f"CUDA sees no GPU (getDeviceCount() is 0; CUDA_VISIBLE_DEVICES {_visible_env()})")
    if device is None:
        # One process per GPU either way: all GPUs visible (rank i takes GPU i), or one GPU
        # per process through CUDA_VISIBLE_DEVICES (every rank takes its device 0).
        return local_rank % count, count
    if isinstance(device, bool) or not isinstance(device, numbers.Integral) or not 0 <= device < count:
        raise ValueError(f"device must be an int in [0, {count - 1}] (this process sees {count} CUDA "
                         f"device(s), CUDA_VISIBLE_DEVICES {_visible_env()}), got {device!r}")
    return int(device), count


def _describe_placement(rank, info):
    return (f"rank {rank} (local rank {info['local_rank']} of {info['local_size']} on its machine, "
            f"device {info['device']} of the {info['count']} it sees, CUDA_VISIBLE_DEVICES {info['visible']})")


def _check_placement(placements):
    """Raises on every rank when a rank failed to pick its GPU, or two ranks picked one GPU."""
    for rank, info in enumerate(placements):
        if "error" in info:
            raise RuntimeError(f"nccl backend: rank {rank} cannot choose its GPU: {info['error']}")
    owner = {}
    for rank, info in enumerate(placements):
        key = (info["host"], info["bus_id"].lower())
        if key in owner:
            first = owner[key]
            raise RuntimeError(
                f"nccl backend: {_describe_placement(first, placements[first])} and "
                f"{_describe_placement(rank, info)} would share one GPU (PCI bus {info['bus_id']}); NCCL "
                f"refuses two ranks of one communicator on one GPU ('Duplicate GPU detected'). "
                f"The machine runs {info['local_size']} ranks and rank {rank} sees {info['count']} GPU(s): "
                f"start at most as many ranks per machine as it has GPUs (e.g. mpirun --map-by "
                f"ppr:{info['count']}:node) and let each see all of them or one of its own")
        owner[key] = rank


def _check_same_unique_id(placements):
    """Raises on every rank when the ranks were handed different unique ids (NCCL would wait in
    ncclCommInitRank for peers that joined another communicator, until its timeout)."""
    missing = [r for r, info in enumerate(placements) if not info["uid_given"]]
    if missing:
        raise RuntimeError(f"nccl backend: rank(s) {missing} were given no unique_id while the others were; every "
                           f"rank must pass the one id its launcher made (unique_id=...), or none")
    uids = [tuple(info["uid"]) for info in placements]
    differ = [r for r, uid in enumerate(uids) if uid != uids[0]]
    if differ:
        raise RuntimeError(f"nccl backend: the ranks were given different unique ids: rank(s) {differ} differ from "
                           f"rank 0's; every rank must pass the one id its launcher made (unique_id=...)")


class NcclCommunicator(Communicator):
    """A communicator over NCCL, bootstrapped over an mpi4py communicator.

    Args:
        mpi_comm: the mpi4py communicator of the same ranks (default COMM_WORLD).
        device: the CUDA device of this rank (default: the local rank modulo the number of
            devices this process sees).
        debug, timeout, stall_warning: see :class:`Communicator`.
        unique_id: NCCL's unique id (``cupy.cuda.nccl.get_unique_id()``), when the process
            that started the ranks made one and handed it to each (SINGA's NcclIdHolder;
            ``init("nccl", unique_id=...)``): every rank must pass the same; default: rank 0
            makes one and the bootstrap gather hands it on.

    Attributes:
        device: the CUDA device this rank's collectives run on.
        visible_devices: how many CUDA devices this process sees.
    """

    backend = "nccl"

    def __init__(self, mpi_comm=None, device=None, debug=None, timeout=None, stall_warning=None, unique_id=None):
        import_nccl()  # first: the missing library a GPU user needs is CuPy's NCCL
        import_mpi()
        # The inner mpi communicator (made with comm=None for the world, so it makes the watch).
        host = MpiCommunicator(mpi_comm, debug=0, timeout=timeout, stall_warning=stall_warning)
        try:
            self._setup(host, device, debug, timeout, stall_warning, owns_host=True, unique_id=unique_id)
        except BaseException:
            host.release()
            raise

    @classmethod
    def over(cls, host, device=None, debug=None, timeout=None, stall_warning=None, unique_id=None):
        """The NCCL communicator of the ranks of ``host``, a :class:`Communicator` that carries
        the bootstrap, barriers, object gathers and host arrays (the mpi backend in a job; the
        threads backend in tests). ``host`` stays the caller's: ``release()`` leaves it open."""
        self = cls.__new__(cls)
        self._setup(host, device, debug, timeout, stall_warning, owns_host=False, unique_id=unique_id)
        return self

    def _setup(self, host, device, debug, timeout, stall_warning, owns_host, unique_id=None):
        cupy, nccl = import_nccl()
        self._cupy, self._nccl_mod = cupy, nccl
        self._mpi, self._owns_host = host, owns_host
        self.mpi_comm = getattr(host, "comm", None)
        self.comm = None
        self._children = []  # the sub-communicators split from this one, released with it
        self._side_stream = None
        self._batch_depth = 0  # open batch_isend_irecv groups: their sends and receives join them
        self._pending = collections.deque()  # (CUDA event, CallInfo, start time) the watchdog follows
        self._watchdog = None
        super().__init__(host.rank, host.size, host.local_rank, host.local_size,
                         debug=debug, timeout=timeout, stall_warning=stall_warning)
        self._ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN, "prod": nccl.NCCL_PROD}
        # Each rank picks its GPU, then one exchange carries the unique id from rank 0 and
        # every rank's placement: a failure or two ranks on one GPU raise on every rank,
        # rather than on one while the others wait for it in ncclCommInitRank.
        mine = {"local_rank": self.local_rank, "local_size": self.local_size, "visible": _visible_env(),
                "uid_given": unique_id is not None, "uid": None}
        try:
            self.device, self.visible_devices = _choose_device(cupy, device, self.local_rank)
            cupy.cuda.Device(self.device).use()
            mine.update(device=self.device, count=self.visible_devices, host=_host_id(),
                        bus_id=str(cupy.cuda.Device(self.device).pci_bus_id),
                        uid=unique_id if unique_id is not None else nccl.get_unique_id() if self.rank == 0 else None)
        except Exception as exc:  # noqa: B902 - told to every rank below, then raised there
            mine["error"] = f"{type(exc).__name__}: {exc}"
        self._call = CallInfo("nccl init (unique id, GPU placement)", -1, None, None)
        placements = self._inner()._allgather_object(mine)
        self._call = CallInfo("(none)", -1, None, None)
        _check_placement(placements)
        if any(info["uid_given"] for info in placements):
            _check_same_unique_id(placements)
        self.comm = nccl.NcclCommunicator(self.size, placements[0]["uid"], self.rank)

    def _dtype(self, x):
        nccl = self._nccl_mod
        table = {"float16": nccl.NCCL_FLOAT16, "float32": nccl.NCCL_FLOAT32, "float64": nccl.NCCL_FLOAT64,
                 "int32": nccl.NCCL_INT32, "int64": nccl.NCCL_INT64, "uint8": nccl.NCCL_UINT8,
                 "int8": nccl.NCCL_INT8, "uint32": nccl.NCCL_UINT32, "uint64": nccl.NCCL_UINT64}
        try:
            return table[str(x.dtype)]
        except KeyError:
            raise TypeError(f"nccl backend: dtype {x.dtype} is not supported; use one of {sorted(table)}") from None

    def _ptr(self, x):
        """x's device address, once x is known to be a CuPy array on this rank's GPU."""
        ptr = getattr(getattr(x, "data", None), "ptr", None)
        if ptr is None:
            raise TypeError(f"nccl backend: {self._call.name} takes CuPy arrays (device memory) or NumPy arrays "
                            f"(host state, sent over MPI), got {type(x).__module__}.{type(x).__name__}")
        device = getattr(getattr(x, "device", None), "id", self.device)
        if device != self.device:
            raise ValueError(f"nccl backend: {self._call.name} got an array on GPU {device}, but rank {self.rank} "
                             f"runs its collectives on GPU {self.device} (chosen at init); build the network "
                             f"and its arrays after minidl_parallel.init(), which makes GPU {self.device} current")
        return ptr

    def _stream(self):
        return self._cupy.cuda.get_current_stream().ptr

    def _allreduce(self, buf, op, stream=None):
        if isinstance(buf, numpy.ndarray):
            self._inner()._allreduce(buf, op)
            return
        ptr = self._ptr(buf)
        self.comm.allReduce(ptr, ptr, buf.size, self._dtype(buf), self._ops[op],
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
        # Below MPI_THREAD_MULTIPLE this thread must not call MPI while the main thread may.
        serve = not getattr(self._mpi, "_polled", False)
        while not _stopping.is_set():
            time.sleep(0.01)  # only deadlines matter here: the host does not wait on NCCL
            # Read once per turn: release() clears it and waits for this thread before it
            # destroys the communicator, so a destroyed one is never polled.
            comm = self.comm
            if comm is None:
                return
            while self._pending:
                event, call, start = self._pending[0]
                if event.done:
                    self._pending.popleft()
                    continue
                waited = time.monotonic() - start
                try:
                    comm.check_async_error()
                except Exception as exc:  # noqa: B902 - any NCCL error ends the job
                    self._end_job(f"minidl_parallel: rank {self.rank}: NCCL reported an error during {call}: {exc}")
                if serve:
                    self._mpi._serve_peers(call)
                if self.timeout and waited >= self.timeout:
                    self._end_job(self._stall_message(call, waited, "timed out after") +
                                  f"; aborting NCCL and the MPI job (timeout {self.timeout:g} s)")
                if self.stall_warning and waited >= self.stall_warning and warned is not call:
                    warned = call
                    sys.stderr.write(self._stall_message(call, waited, "has waited") + "\n")
                break

    def _missing_ranks(self, call):
        if watch() is not None:
            return self._mpi._missing_ranks(call)
        return ([call.peer], "") if call.peer is not None else (None, "")  # a message waits for its peer

    def _end_job(self, message):
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        comm = self.comm
        try:
            if comm is not None:
                comm.abort()  # frees the NCCL kernels that wait for the missing ranks
        finally:
            import_mpi().COMM_WORLD.Abort(1)

    def _stop_watchdog(self):
        dog, self._watchdog = self._watchdog, None
        if dog is None:
            return
        if dog is not threading.current_thread():
            dog.join(_WATCHDOG_JOIN_S)
        if dog in _watchdogs:
            _watchdogs.remove(dog)

    # ---- the collectives ----------------------------------------------------------------

    def _iallreduce(self, buf, op):
        if isinstance(buf, numpy.ndarray):
            return self._inner()._iallreduce(buf, op)
        cupy = self._cupy
        if self._side_stream is None:
            self._side_stream = cupy.cuda.Stream(non_blocking=True)
        current = cupy.cuda.get_current_stream()
        self._side_stream.wait_event(current.record())
        self._allreduce(buf, op, stream=self._side_stream)
        done = self._side_stream.record()
        return lambda: current.wait_event(done)

    def _allgather(self, x):
        if isinstance(x, numpy.ndarray):
            return self._inner()._allgather(x)
        ptr = self._ptr(x)
        out = self._cupy.empty((self.size,) + x.shape, dtype=x.dtype)
        self.comm.allGather(ptr, out.data.ptr, x.size, self._dtype(x), self._stream())
        self._follow()
        return out

    def _reduce_scatter(self, x, op):
        if isinstance(x, numpy.ndarray):
            return self._inner()._reduce_scatter(x, op)
        ptr = self._ptr(x)
        out = self._cupy.empty(x.shape[1:], dtype=x.dtype)
        self.comm.reduceScatter(ptr, out.data.ptr, out.size, self._dtype(x), self._ops[op], self._stream())
        self._follow()
        return out

    def _bcast(self, buf, root):
        if isinstance(buf, numpy.ndarray):
            self._inner()._bcast(buf, root)
            return
        self.comm.bcast(self._ptr(buf), buf.size, self._dtype(buf), root, self._stream())
        self._follow()

    def _alltoall(self, x):
        if isinstance(x, numpy.ndarray):
            return self._inner()._alltoall(x)
        # NCCL has no all-to-all; grouped point-to-point sends and receives make one.
        self._ptr(x)
        nccl = self._nccl_mod
        out = self._cupy.empty_like(x)
        count = x[0].size
        dtype, stream = self._dtype(x), self._stream()
        nccl.groupStart()
        try:
            for peer in range(self.size):
                self.comm.send(x[peer].data.ptr, count, dtype, peer, stream)
                self.comm.recv(out[peer].data.ptr, count, dtype, peer, stream)
        finally:
            nccl.groupEnd()  # an open group would swallow every later NCCL call of this thread
        self._follow()
        return out

    # ---- point-to-point (comm/p2p.py) ---------------------------------------------------

    def _grouped(self, enqueue):
        """Runs ``enqueue`` (an ncclSend or ncclRecv) in an NCCL group of its own, unless a batch
        (``_p2p_batch``) already holds one open."""
        if self._batch_depth:
            enqueue()
            return
        self._nccl_mod.groupStart()
        try:
            enqueue()
        finally:
            self._nccl_mod.groupEnd()  # an open group would swallow every later NCCL call of this thread

    @contextlib.contextmanager
    def _p2p_batch(self):
        # One group: NCCL starts its sends and receives together, so two stages that send to each
        # other in the same batch do not wait for each other's receive.
        self._nccl_mod.groupStart()
        self._batch_depth += 1
        try:
            yield
        finally:
            self._batch_depth -= 1
            self._nccl_mod.groupEnd()

    def _isend(self, buf, dest, tag, call, fingerprint):
        if isinstance(buf, numpy.ndarray):
            return self._inner()._isend(buf, dest, tag, call, fingerprint)
        ptr = self._ptr(buf)
        if self.debug:  # the fingerprint goes over MPI ahead of the data (NCCL has no tags)
            self._inner()._send_fingerprint(fingerprint, dest, tag)
        self._grouped(lambda: self.comm.send(ptr, buf.size, self._dtype(buf), dest, self._stream()))
        self._follow()
        return None  # the current stream orders the buffer's next writes after the send

    def _irecv(self, buf, source, tag, call, fingerprint):
        if isinstance(buf, numpy.ndarray):
            return self._inner()._irecv(buf, source, tag, call, fingerprint)
        ptr = self._ptr(buf)
        if self.debug:  # before the receive is enqueued: NCCL would corrupt memory or hang on a mismatch
            sent = self._inner()._recv_fingerprint(source, tag, call)
            self._check_fingerprint(sent, fingerprint, call, source)
        self._grouped(lambda: self.comm.recv(ptr, buf.size, self._dtype(buf), source, self._stream()))
        self._follow()
        return None  # kernels on the current stream read buf after the receive

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
        # The inner communicator splits first (MPI's Create_group involves the members only),
        # then the NCCL communicator of the members is made over it, on this rank's GPU.
        host = self._mpi._split(ranks)
        try:
            sub = type(self).over(host, device=self.device, **self._settings())
        except BaseException:
            host.release()
            raise
        sub._owns_host = True
        self._children.append(sub)
        return sub

    def release(self):
        """Frees the sub-communicators split from this one, then this one: stops the watchdog,
        destroys the NCCL communicator and frees the inner MPI one (not COMM_WORLD). Calling it
        again does nothing."""
        children, self._children = self._children, []
        failure = None
        for child in children:
            try:
                child.release()
            except Exception as exc:  # noqa: B902 - free the others and this one, then report it
                failure = failure or exc
        comm, self.comm = self.comm, None  # the watchdog leaves once it sees None
        if comm is not None:
            self._stop_watchdog()
            try:
                comm.destroy()
            finally:
                self._pending.clear()
                if self._owns_host:
                    self._mpi.release()
        if failure is not None:
            raise failure
