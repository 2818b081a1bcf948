"""The nccl backend's collectives, device choice and release, on stand-ins for CuPy and
``cupy.cuda.nccl`` (no GPU here), over the threads world.

The stand-ins are strict where the real libraries are and the nccl backend could go wrong:

- device arrays are NumPy memory registered as one machine's GPU buffers; they refuse
  implicit conversion to NumPy (as CuPy does) and know which GPU (PCI bus id) holds them;
- the fake ``NcclCommunicator`` has CuPy 14's signatures (``cupy_backends/cuda/libs/nccl.pyx``:
  positional ints, ``NcclCommunicator(ndev, commId, rank)``) and reads and writes memory only
  through the pointers it is given: a pointer outside every device buffer, a count running
  past its buffer, or a buffer on another GPU than the communicator's raises, as does a call
  on a destroyed communicator; ranks meet through the unique id, and two ranks on one GPU
  are refused as NCCL refuses them ("Duplicate GPU detected");
- each thread-rank has its own view of the GPUs (its ``CUDA_VISIBLE_DEVICES``) and its own
  current device, as a process has;
- streams log the events recorded and waited on them (``cupy.stream_log``), and the fake
  communicator notes the stream of each all-reduce and the current GPU of each error poll.

The inner MPI communicator is replaced by the rank's threads communicator, so host (NumPy)
arrays travel there. What this cannot show: kernels, streams and their ordering, real device
memory, NCCL itself; that needs a GPU (``python -m minidl.gpu_check``).
"""
import collections
import os
import re
import sys
import threading
import time
import types

import numpy as np
import pytest

from minidl import Parameter
from minidl.optim import SGD
from minidl_parallel import get_communicator, run_threads
from minidl_parallel import broadcast as broadcast_module
from minidl_parallel.comm import nccl as nccl_backend
from minidl_parallel.comm.p2p import P2POp
from minidl_parallel.comm.threads import ThreadsCommunicator
from minidl_parallel.grad_reducer import DistributedGradReducer

_RENDEZVOUS_S = 10.0  # a fake collective whose peers never come fails after this, never hangs
_BUS_IDS = ["0000:1A:00.0", "0000:3B:00.0", "0000:5C:00.0", "0000:7D:00.0"]


class _CudaError(RuntimeError):
    """Stands in for cupy_backends.cuda.api.runtime.CUDARuntimeError."""


# ---- the GPUs: memory, visibility, the current device ------------------------------------

class _Gpus:
    """One machine's GPUs (PCI bus ids) and every device buffer on them; per thread-rank, the
    GPUs it sees (its CUDA_VISIBLE_DEVICES) and its current device, as per process in CUDA."""

    def __init__(self, bus_ids):
        self.bus_ids = list(bus_ids)
        self.buffers = {}  # base address -> (uint8 memory, PCI bus id of its GPU)
        self.idle = True  # whether recorded events are complete (False: the GPU is "stuck")
        self._lock = threading.Lock()
        self._local = threading.local()

    def show(self, visible):
        """This thread-rank sees the GPUs at ``visible`` (indices into bus_ids)."""
        self._local.visible = [self.bus_ids[i] for i in visible]
        self._local.current = 0

    @property
    def visible(self):
        return getattr(self._local, "visible", self.bus_ids)

    @property
    def current(self):
        return getattr(self._local, "current", 0)

    def bus_of(self, index):
        if not 0 <= index < len(self.visible):
            raise _CudaError(f"cudaErrorInvalidDevice: invalid device ordinal {index} (this rank sees "
                             f"{len(self.visible)} device(s))")
        return self.visible[index]

    def use(self, index):
        self.bus_of(index)
        self._local.current = index

    def count(self):
        if not self.visible:
            raise _CudaError("cudaErrorNoDevice: no CUDA-capable device is detected")
        return len(self.visible)

    def allocate(self, shape, dtype):
        """Fresh device memory on the current GPU, filled with a pattern (not zeros, as cupy.empty)."""
        shape = tuple(int(s) for s in np.atleast_1d(shape)) if not isinstance(shape, tuple) else shape
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        memory = np.full(max(nbytes, 1), 0xA5, np.uint8)
        bus = self.bus_of(self.current)
        with self._lock:
            self.buffers[memory.ctypes.data] = (memory, bus)
        return _DevArray(memory[:nbytes].view(dtype).reshape(shape), self.current, bus)

    def upload(self, host):
        out = self.allocate(host.shape, host.dtype)
        out._a[...] = host
        return out

    def memory(self, ptr, count, dtype, who):
        """The ``count`` elements of ``dtype`` at device address ``ptr``, and their GPU's bus id."""
        nbytes = count * dtype.itemsize
        with self._lock:
            found = [(base, memory, bus) for base, (memory, bus) in self.buffers.items()
                     if base <= ptr < base + memory.size]
        if not found:
            raise ValueError(f"fake NCCL {who}: address {ptr:#x} is in no device buffer (a host array's?)")
        base, memory, bus = found[0]
        if ptr + nbytes > base + memory.size:
            raise ValueError(f"fake NCCL {who}: {count} x {dtype} from {ptr:#x} runs "
                             f"{ptr + nbytes - base - memory.size} bytes past its device buffer of {memory.size} bytes")
        start = ptr - base
        return memory[start:start + nbytes].view(dtype), bus


_gpus = {"now": None}  # the test's _Gpus (the fake module functions find it here)


class _DevArray:
    """A CuPy array stand-in: device memory that refuses implicit conversion to NumPy."""

    def __init__(self, a, device_id, bus):
        self._a, self._bus = a, bus
        self.device = types.SimpleNamespace(id=device_id)

    def _wrap(self, a):
        if not np.may_share_memory(a, self._a):  # a NumPy copy: copy it to the device, as CuPy would
            return _gpus["now"].upload(a)
        return _DevArray(a, self.device.id, self._bus)

    data = property(lambda self: types.SimpleNamespace(ptr=int(self._a.__array_interface__["data"][0])))
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    flags = property(lambda self: self._a.flags)

    def __len__(self):
        return len(self._a)

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct "
                        "a NumPy array explicitly.")

    def get(self):
        return self._a.copy()

    def reshape(self, *shape):
        return self._wrap(self._a.reshape(*shape))

    def __getitem__(self, key):
        a = self._a[key]
        if not isinstance(a, np.ndarray):  # CuPy indexes to 0-d arrays, never to scalars
            a = self._a[(key if isinstance(key, tuple) else (key,)) + (Ellipsis,)]
        return self._wrap(a)

    def __setitem__(self, key, value):
        self._a[key] = _operand(value)

    def __imul__(self, other):
        self._a *= _operand(other)
        return self

    def __itruediv__(self, other):
        self._a /= _operand(other)
        return self

    def astype(self, dtype):
        return _gpus["now"].upload(self._a.astype(dtype))

    def copy(self):
        return _gpus["now"].upload(self._a)


_DevArray.__module__ = "cupy"  # how minidl_parallel.comm.base tells CuPy arrays from NumPy ones


def _operand(value):
    if isinstance(value, _DevArray):
        return value._a
    if isinstance(value, np.ndarray) and value.ndim:
        raise TypeError(f"Unsupported type {type(value)}")  # CuPy refuses host operands
    return value


def _dev(host):
    return _gpus["now"].upload(np.asarray(host))


def _fake_cupy():
    def device_arrays(xs):
        for x in xs:
            if not isinstance(x, _DevArray):
                raise TypeError(f"Unsupported type {type(x)}")
        return [x._a for x in xs]

    class Device:
        def __init__(self, index=None):
            self.id = _gpus["now"].current if index is None else int(index)

        def use(self):
            _gpus["now"].use(self.id)
            return self

        @property
        def pci_bus_id(self):
            return _gpus["now"].bus_of(self.id)

    class Event:
        def __init__(self, stream_ptr=None):
            self._gpus, self.stream_ptr = _gpus["now"], stream_ptr

        @property
        def done(self):
            return self._gpus.idle

    class Stream:
        """Records what is done on it in ``cupy.stream_log``: ("record", stream) and ("wait",
        stream, the stream the event was recorded on)."""

        def __init__(self, non_blocking=False, ptr=None):
            self.ptr = id(self) if ptr is None else ptr
            self.non_blocking = non_blocking

        def record(self):
            cupy.stream_log.append(("record", self.ptr))
            return Event(self.ptr)

        def wait_event(self, event):
            assert isinstance(event, Event)
            cupy.stream_log.append(("wait", self.ptr, event.stream_ptr))

    cupy = types.ModuleType("cupy")
    cupy.stream_log = []
    cupy.ndarray = _DevArray
    cupy.empty = lambda shape, dtype=float: _gpus["now"].allocate(shape, dtype)
    cupy.empty_like = lambda x: _gpus["now"].allocate(x.shape, x.dtype)
    cupy.array = lambda x, order="C", copy=True: _gpus["now"].upload(
        x._a if isinstance(x, _DevArray) else np.asarray(x))
    cupy.asarray = lambda x: x if isinstance(x, _DevArray) else _gpus["now"].upload(np.asarray(x))
    cupy.ascontiguousarray = lambda x: x if x.flags.c_contiguous else _gpus["now"].upload(x._a)
    cupy.concatenate = lambda xs, axis=0: _gpus["now"].upload(np.concatenate(device_arrays(xs), axis=axis))
    cupy.ravel = lambda x: x.reshape(-1)
    cupy.moveaxis = lambda x, source, destination: x._wrap(np.moveaxis(x._a, source, destination))
    cupy.asnumpy = lambda x: x.get()
    cupy.cuda = types.SimpleNamespace(
        Device=Device, Stream=Stream, get_current_stream=lambda: Stream(ptr=0),
        runtime=types.SimpleNamespace(getDeviceCount=lambda: _gpus["now"].count()))
    return cupy


# ---- cupy.cuda.nccl ----------------------------------------------------------------------

class NcclError(RuntimeError):
    pass


_NCCL_DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64,
                6: np.float16, 7: np.float32, 8: np.float64}  # NCCL's ncclDataType_t values
_NCCL_OPS = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum}  # ncclSum, ncclProd, ncclMax, ncclMin


class _Clique:
    """The ranks of one unique id: they meet here for every collective, as NCCL's ranks do."""

    def __init__(self, ndev):
        self.ndev = ndev
        self.slots = [None] * ndev
        self.joined = [None] * ndev
        self.barrier = threading.Barrier(ndev, timeout=_RENDEZVOUS_S)
        self.lock = threading.Lock()
        self.in_flight = collections.defaultdict(collections.deque)  # (sender, receiver) -> sent, in order
        self.posted = threading.Condition()

    def post(self, sender, receiver, data):
        with self.posted:
            self.in_flight[(sender, receiver)].append(data)
            self.posted.notify_all()

    def take(self, sender, receiver):
        """The oldest message of sender to receiver (NCCL orders a pair's messages), waiting for it."""
        with self.posted:
            if not self.posted.wait_for(lambda: self.in_flight[(sender, receiver)], _RENDEZVOUS_S):
                raise NcclError(f"fake NCCL: rank {receiver} waited {_RENDEZVOUS_S} s for a message of rank {sender}")
            return self.in_flight[(sender, receiver)].popleft()

    def exchange(self, rank, value):
        self.slots[rank] = value
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot another rank still reads
        return values


def _fake_nccl():
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.NcclError = NcclError
    nccl.NCCL_INT8, nccl.NCCL_UINT8, nccl.NCCL_INT32, nccl.NCCL_UINT32 = 0, 1, 2, 3
    nccl.NCCL_INT64, nccl.NCCL_UINT64, nccl.NCCL_FLOAT16, nccl.NCCL_FLOAT32, nccl.NCCL_FLOAT64 = 4, 5, 6, 7, 8
    nccl.NCCL_SUM, nccl.NCCL_PROD, nccl.NCCL_MAX, nccl.NCCL_MIN = 0, 1, 2, 3
    cliques, made = {}, []
    group = threading.local()
    groups = []  # each group of sends and receives ended: [(rank, "send" or "recv", peer), ...]

    def get_unique_id():
        return tuple(b - 256 if b > 127 else b for b in os.urandom(128))  # 128 C chars, as CuPy's

    def groupStart():  # noqa: N802 - NCCL's names
        group.depth = getattr(group, "depth", 0) + 1
        group.__dict__.setdefault("queued", [])

    def groupEnd():  # noqa: N802
        if getattr(group, "depth", 0) < 1:
            raise NcclError("invalid usage: groupEnd without groupStart")
        group.depth -= 1
        if group.depth == 0:
            queued, group.queued = group.queued, []
            groups.append([(comm.rank, kind, peer) for comm, (kind, _, peer) in queued])
            by_comm = {}
            for comm, op in queued:
                by_comm.setdefault(id(comm), (comm, []))[1].append(op)
            for comm, ops in by_comm.values():
                comm._point_to_point(ops)

    class NcclCommunicator:
        def __init__(self, ndev, commId, rank, /):  # noqa: N803 - CuPy's names
            _ints("NcclCommunicator", ndev=ndev, rank=rank)
            if not isinstance(commId, tuple) or len(commId) != 128:
                raise AssertionError("commId must be the 128-tuple get_unique_id() returns")  # CuPy asserts
            if not 0 <= rank < ndev:
                raise NcclError(f"invalid argument: rank {rank} of {ndev}")
            self.gpus = _gpus["now"]
            self.bus = self.gpus.bus_of(self.gpus.current)  # NCCL takes the current device
            self.rank, self.ndev, self.calls, self.destroyed, self.aborted = rank, ndev, [], False, False
            self.streams, self.polled_on = [], []  # allReduce's streams; the current GPU of each poll
            self.async_error = None
            with threading.Lock():
                clique = cliques.setdefault(commId, _Clique(ndev))
            if clique.ndev != ndev or clique.joined[rank] is not None:
                raise NcclError(f"invalid usage: rank {rank} joined twice or ndev differs")
            clique.joined[rank] = self
            self.clique = clique
            buses = clique.exchange(rank, self.bus)
            if len(set(buses)) != len(buses):
                raise NcclError(f"invalid usage: Duplicate GPU detected: buses {buses}")
            made.append(self)

        def _live(self, who):
            if self.destroyed:
                raise NcclError(f"invalid argument: {who} on a destroyed communicator")
            self.calls.append(who)

        def _view(self, who, ptr, count, datatype):
            if datatype not in _NCCL_DTYPES:
                raise NcclError(f"invalid argument: datatype {datatype}")
            view, bus = self.gpus.memory(ptr, count, np.dtype(_NCCL_DTYPES[datatype]), who)
            if bus != self.bus:
                raise NcclError(f"invalid argument: {who}: a buffer on GPU {bus}, the communicator's is {self.bus}")
            return view

        def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream, /):  # noqa: N802
            _ints("allReduce", sendbuf=sendbuf, recvbuf=recvbuf, count=count, datatype=datatype, op=op,
                  stream=stream)
            self._live("allReduce")
            self.streams.append(stream)
            send, recv = self._view("allReduce", sendbuf, count, datatype), self._view("allReduce", recvbuf, count,
                                                                                       datatype)
            values = self.clique.exchange(self.rank, send.copy())
            out = values[0].copy()
            for v in values[1:]:
                out = _NCCL_OPS[op](out, v)
            recv[...] = out

        def bcast(self, buff, count, datatype, root, stream, /):
            _ints("bcast", buff=buff, count=count, datatype=datatype, root=root, stream=stream)
            self._live("bcast")
            buf = self._view("bcast", buff, count, datatype)
            values = self.clique.exchange(self.rank, buf.copy() if self.rank == root else None)
            buf[...] = values[root]

        def allGather(self, sendbuf, recvbuf, count, datatype, stream, /):  # noqa: N802
            _ints("allGather", sendbuf=sendbuf, recvbuf=recvbuf, count=count, datatype=datatype, stream=stream)
            self._live("allGather")
            send = self._view("allGather", sendbuf, count, datatype)
            recv = self._view("allGather", recvbuf, count * self.ndev, datatype)
            recv[...] = np.concatenate(self.clique.exchange(self.rank, send.copy()))

        def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream, /):  # noqa: N802
            _ints("reduceScatter", sendbuf=sendbuf, recvbuf=recvbuf, recvcount=recvcount, datatype=datatype, op=op,
                  stream=stream)
            self._live("reduceScatter")
            send = self._view("reduceScatter", sendbuf, recvcount * self.ndev, datatype)
            recv = self._view("reduceScatter", recvbuf, recvcount, datatype)
            values = self.clique.exchange(self.rank, send.copy())
            block = [v[self.rank * recvcount:(self.rank + 1) * recvcount] for v in values]
            out = block[0].copy()
            for v in block[1:]:
                out = _NCCL_OPS[op](out, v)
            recv[...] = out

        def send(self, sendbuf, count, datatype, peer, stream, /):
            _ints("send", sendbuf=sendbuf, count=count, datatype=datatype, peer=peer, stream=stream)
            self._queue(("send", self._view("send", sendbuf, count, datatype), peer))

        def recv(self, recvbuf, count, datatype, peer, stream, /):
            _ints("recv", recvbuf=recvbuf, count=count, datatype=datatype, peer=peer, stream=stream)
            self._queue(("recv", self._view("recv", recvbuf, count, datatype), peer))

        def _queue(self, op):
            self._live(op[0])
            if getattr(group, "depth", 0) < 1:
                raise NcclError("fake NCCL: send/recv outside groupStart/groupEnd (an all-to-all would deadlock)")
            group.queued.append((self, op))

        def _point_to_point(self, ops):
            # A group's sends all start before its receives wait: only the pairs involved meet.
            for kind, view, peer in ops:
                if kind == "send":
                    self.clique.post(self.rank, peer, view.copy())
            for kind, view, peer in ops:
                if kind == "recv":
                    data = self.clique.take(peer, self.rank)
                    if data.shape != view.shape or data.dtype != view.dtype:
                        raise NcclError(f"fake NCCL: rank {self.rank} receives {view.shape} {view.dtype} from {peer}, "
                                        f"which sent {data.shape} {data.dtype}")
                    view[...] = data

        def check_async_error(self):
            self._live("check_async_error")
            self.polled_on.append(self.gpus.bus_of(self.gpus.current))  # CUDA works on the current GPU
            if self.async_error is not None:
                raise NcclError(self.async_error)

        def abort(self):
            self.aborted = self.destroyed = True

        def destroy(self):
            self.destroyed = True

    nccl.get_unique_id, nccl.groupStart, nccl.groupEnd = get_unique_id, groupStart, groupEnd
    nccl.NcclCommunicator = NcclCommunicator
    nccl.made, nccl.groups = made, groups
    return nccl


def _ints(who, **args):
    for name, value in args.items():
        if isinstance(value, bool) or not isinstance(value, int):  # Cython's intptr_t / size_t / int
            raise TypeError(f"{who}: {name} must be an int, got {type(value).__name__}")
        if value < 0 and name not in ("stream",):
            raise OverflowError(f"{who}: {name} = {value} cannot be negative")


# ---- the inner MPI communicator: the thread-rank's threads communicator ------------------

class _PickledBcast:
    """mpi4py's pickled ``comm.bcast`` over the threads communicator (the inner communicator's ``comm``)."""

    def __init__(self, host):
        self._host = host

    def bcast(self, obj, root=0):
        return self._host._allgather_object(obj)[root]


_inner_made = []  # the arguments each inner communicator was made with


def _host_stand_in(comm=None, debug=None, timeout=None, stall_warning=None):
    _inner_made.append((comm, debug, timeout, stall_warning))
    host = get_communicator()
    host.comm = _PickledBcast(host)
    return host


@pytest.fixture
def fakes(monkeypatch):
    gpus = _gpus["now"] = _Gpus(_BUS_IDS)
    cupy, nccl = _fake_cupy(), _fake_nccl()
    aborts = []

    def abort(code):
        aborts.append(code)
        nccl_backend._stopping.set()  # MPI_Abort ends the process, and with it every watchdog

    mpi = types.SimpleNamespace(COMM_WORLD=types.SimpleNamespace(Abort=abort))
    monkeypatch.setitem(sys.modules, "cupy", cupy)  # comm.base imports it for CuPy arrays
    monkeypatch.setattr(nccl_backend, "import_nccl", lambda: (cupy, nccl))
    monkeypatch.setattr(nccl_backend, "import_mpi", lambda: mpi)
    monkeypatch.setattr(nccl_backend, "MpiCommunicator", _host_stand_in)
    nccl_backend._stopping.clear()
    _inner_made.clear()
    yield types.SimpleNamespace(gpus=gpus, cupy=cupy, nccl=nccl, aborts=aborts)
    nccl_backend._stopping.clear()
    _gpus["now"] = None


def _run(n, fn, visible=None):
    """fn(rank) on n thread-ranks; rank r sees the GPUs visible[r] (default: all of them)."""
    def body():
        rank = get_communicator().rank
        _gpus["now"].show(range(len(_BUS_IDS)) if visible is None else visible[rank])
        return fn(rank)
    return run_threads(n, body, timeout=60)


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: B902 - the test compares every rank's error
        return (type(exc).__name__, str(exc))


# ---- collectives ---------------------------------------------------------------------------

def _inputs(rank, dtype):
    rng = np.random.default_rng([7, rank])
    return (rng.integers(-50, 50, size=(4, 6)) if np.dtype(dtype).kind == "i" else
            rng.standard_normal((4, 6))).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_device_collectives_go_through_nccl_and_match_numpy(fakes, dtype):
    def body(rank):
        comm = nccl_backend.NcclCommunicator(timeout=30, stall_warning=0)
        try:
            x = _dev(_inputs(rank, dtype))
            inplace = _dev(_inputs(rank, dtype))
            out = {
                "device": comm.device,
                "sum": comm.allreduce(x, "sum").get(),
                "max": comm.allreduce(x, "max").get(),
                "inplace": comm.allreduce_(inplace, "min") is inplace and inplace.get(),
                "iallreduce": comm.iallreduce_(_dev(_inputs(rank, dtype)), "sum").wait().get(),
                "gather0": comm.allgather(x, axis=0).get(),
                "gather1": comm.allgather(x, axis=1).get(),
                "scatter": comm.reduce_scatter(x, "sum", axis=1).get(),
                "bcast": comm.broadcast(x, root=1).get(),
                "alltoall": comm.alltoall(x, split_axis=0, concat_axis=1).get(),
                "x_kept": x.get(),
            }
            if np.dtype(dtype).kind == "f":
                out["mean"] = comm.allreduce(x, "mean").get()
            out["calls"] = list(comm.comm.calls)
            return out
        finally:
            comm.release()

    results = _run(2, body)
    a, b = _inputs(0, dtype), _inputs(1, dtype)
    for rank, out in enumerate(results):
        assert out["device"] == rank  # every GPU visible: rank i takes GPU i
        np.testing.assert_array_equal(out["sum"], a + b)
        np.testing.assert_array_equal(out["max"], np.maximum(a, b))
        np.testing.assert_array_equal(out["inplace"], np.minimum(a, b))
        np.testing.assert_array_equal(out["iallreduce"], a + b)
        np.testing.assert_array_equal(out["gather0"], np.concatenate([a, b], axis=0))
        np.testing.assert_array_equal(out["gather1"], np.concatenate([a, b], axis=1))
        np.testing.assert_array_equal(out["scatter"], (a + b)[:, 3 * rank:3 * rank + 3])
        np.testing.assert_array_equal(out["bcast"], b)
        np.testing.assert_array_equal(out["alltoall"], np.concatenate([a[2 * rank:2 * rank + 2],
                                                                       b[2 * rank:2 * rank + 2]], axis=1))
        np.testing.assert_array_equal(out["x_kept"], _inputs(rank, dtype))
        if "mean" in out:
            np.testing.assert_allclose(out["mean"], (a + b) / 2, rtol=1e-6)
        for name in ("allReduce", "allGather", "reduceScatter", "bcast", "send", "recv"):
            assert name in out["calls"], f"{name} never reached NCCL: {out['calls']}"


def test_host_arrays_travel_over_the_inner_communicator_in_place(fakes):
    """Bug 1: host state (NumPy) given to the nccl backend crashed on ``.data.ptr``."""
    def body(rank):
        comm = nccl_backend.NcclCommunicator(timeout=30, stall_warning=0)
        try:
            x = _inputs(rank, np.float64)
            step = np.array([10 * (rank + 1)], np.int32)  # an optimizer's global_step
            out = {
                "allreduce": comm.allreduce(x, "sum"),
                "inplace_is_x": comm.allreduce_(step, "max") is step,
                "step": step.copy(),
                "iallreduce": comm.iallreduce_(x.copy(), "mean").wait(),
                "bcast": comm.broadcast(np.array([rank + 0.5]), root=1),
                "gather": comm.allgather(x[0], axis=0),
                "scatter": comm.reduce_scatter(x, "sum", axis=0),
                "alltoall": comm.alltoall(x),
                "calls": list(comm.comm.calls),
            }
            return out
        finally:
            comm.release()

    results = _run(2, body)
    a, b = _inputs(0, np.float64), _inputs(1, np.float64)
    for rank, out in enumerate(results):
        for key in ("allreduce", "iallreduce", "bcast", "gather", "scatter", "alltoall"):
            assert isinstance(out[key], np.ndarray), f"{key} came back as {type(out[key])}, not on the host"
        np.testing.assert_array_equal(out["allreduce"], a + b)
        assert out["inplace_is_x"]
        np.testing.assert_array_equal(out["step"], [20])
        np.testing.assert_allclose(out["iallreduce"], (a + b) / 2)
        np.testing.assert_array_equal(out["bcast"], [1.5])
        np.testing.assert_array_equal(out["gather"], np.concatenate([a[0], b[0]]))
        np.testing.assert_array_equal(out["scatter"], (a + b)[2 * rank:2 * rank + 2])
        np.testing.assert_array_equal(out["alltoall"], np.concatenate([a[2 * rank:2 * rank + 2],
                                                                       b[2 * rank:2 * rank + 2]]))
        assert out["calls"] == [], f"host arrays must not reach NCCL: {out['calls']}"


def test_parameter_broadcast_sends_host_optimizer_state_and_device_parameters(fakes, monkeypatch):
    """What Model does with parameter_broadcast=True (examples/resnet_cifar.py): the network's
    parameters (device) and the optimizer's state (device momentum, host global_step and SGD's
    stat flags) take rank 0's values on every rank, each where it lives."""
    real = broadcast_module.get_array_module
    monkeypatch.setattr(broadcast_module, "get_array_module",
                        lambda *xs: fakes.cupy if any(isinstance(x, _DevArray) for x in xs) else real(*xs))

    def body(rank):
        comm = nccl_backend.NcclCommunicator(timeout=30, stall_warning=0)
        try:
            params = [Parameter(np.zeros(s, np.float32), name=f"w{i}") for i, s in enumerate([(3, 2), (2,)])]
            opt = SGD(params, learning_rate=0.1, momentum=0.9)
            for p in params:  # the network on this rank's GPU, as built after init()
                p.data = _dev(np.full(p.shape, rank + 1.0, np.float32))
            for name, buf in opt.parameters_and_names():
                if name.startswith("accum."):
                    buf.data = _dev(np.full(buf.shape, 10.0 * (rank + 1), np.float32))
            opt.global_step = 100 * (rank + 1)
            for name, buf in opt.parameters_and_names():
                if name.startswith("stat."):
                    buf.data[...] = rank  # rank 0 has done its first update, rank 1 not
            tensors = params + [p for _, p in opt.parameters_and_names()]
            held = [t.data for t in tensors]
            reducer = DistributedGradReducer(opt.parameters, comm=comm, parameter_broadcast=True)
            reducer.broadcast_parameters(tensors)
            kinds = {name: type(p.data).__name__ for name, p in opt.parameters_and_names()}
            return {
                "params": [p.data.get() for p in params],
                "accum": [b.data.get() for n, b in opt.parameters_and_names() if n.startswith("accum.")],
                "stat": [b.data.copy() for n, b in opt.parameters_and_names() if n.startswith("stat.")],
                "global_step": opt.global_step,
                "in_place": all(t.data is h for t, h in zip(tensors, held)),
                "kinds": kinds,
                "calls": list(comm.comm.calls),
            }
        finally:
            comm.release()

    for out in _run(2, body):
        for p in out["params"]:
            np.testing.assert_array_equal(p, np.ones_like(p))
        for a in out["accum"]:
            np.testing.assert_array_equal(a, np.full_like(a, 10.0))
        for s in out["stat"]:
            np.testing.assert_array_equal(s, [0.0])
        assert out["global_step"] == 100
        assert out["in_place"]
        assert out["kinds"]["global_step"] == "ndarray" and out["kinds"]["stat.w0"] == "ndarray"
        assert out["kinds"]["accum.w0"] == "_DevArray"
        assert out["calls"].count("bcast") == 1, f"the device tensors fit in one fused broadcast: {out['calls']}"


# ---- the device of each rank ----------------------------------------------------------------

def test_ranks_that_each_see_one_gpu_take_their_device_0(fakes):
    """Bug 4: CUDA_VISIBLE_DEVICES per rank (the usual cluster setup) made Device(local_rank) fail."""
    def body(rank):
        comm = nccl_backend.NcclCommunicator(timeout=30, stall_warning=0)
        try:
            total = comm.allreduce(_dev(np.array([rank + 1.0])), "sum").get()
            return comm.device, comm.visible_devices, comm.comm.bus, total
        finally:
            comm.release()

    results = _run(2, body, visible=[[2], [3]])
    assert results == [(0, 1, _BUS_IDS[2], np.array([3.0])), (0, 1, _BUS_IDS[3], np.array([3.0]))]


def test_two_ranks_on_one_gpu_are_refused_on_every_rank_naming_the_counts(fakes):
    def body(rank):
        return _outcome(lambda: nccl_backend.NcclCommunicator(timeout=30, stall_warning=0))

    results = _run(2, body, visible=[[1], [1]])
    for kind, message in results:
        assert kind == "RuntimeError", message
        assert "rank 0 (local rank 0 of 2 on its machine, device 0 of the 1 it sees" in message
        assert "rank 1 (local rank 1 of 2 on its machine, device 0 of the 1 it sees" in message
        assert f"would share one GPU (PCI bus {_BUS_IDS[1]})" in message
        assert "The machine runs 2 ranks and rank 1 sees 1 GPU(s)" in message
    assert fakes.nccl.made == [], "no NCCL communicator may be made"


def test_more_ranks_than_visible_gpus_are_refused(fakes):
    def body(rank):
        return _outcome(lambda: nccl_backend.NcclCommunicator(timeout=30, stall_warning=0))

    results = _run(3, body, visible=[[0, 1]] * 3)  # 3 ranks, 2 GPUs: ranks 0 and 2 would share GPU 0
    for kind, message in results:
        assert kind == "RuntimeError", message
        assert "rank 0 (local rank 0 of 3" in message and "rank 2 (local rank 2 of 3" in message
        assert "sees 2 GPU(s)" in message and "ppr:2:node" in message


def test_a_rank_that_sees_no_gpu_fails_every_rank_naming_it(fakes):
    def body(rank):
        return _outcome(lambda: nccl_backend.NcclCommunicator(timeout=30, stall_warning=0))

    for kind, message in _run(2, body, visible=[[0], []]):
        assert kind == "RuntimeError", message
        assert message.startswith("nccl backend: rank 1 cannot choose its GPU: RuntimeError: CUDA sees no usable GPU")
        assert "cudaErrorNoDevice" in message


def test_an_explicit_device_out_of_range_is_refused_naming_the_count(fakes):
    def body(rank):
        return _outcome(lambda: nccl_backend.NcclCommunicator(device=2, timeout=30, stall_warning=0))

    for kind, message in _run(1, body, visible=[[0, 1]]):
        assert kind == "RuntimeError", message
        assert "device must be an int in [0, 1] (this process sees 2 CUDA device(s)" in message
        assert "got 2" in message


def test_an_array_on_another_gpu_is_refused_naming_both(fakes):
    """A network built before init() lives on GPU 0; rank 1's collectives run on GPU 1."""
    def body(rank):
        comm = nccl_backend.NcclCommunicator(timeout=30, stall_warning=0)
        try:
            if rank == 0:
                return None
            fakes.gpus.use(0)
            early = _dev(np.ones(3))  # allocated while GPU 0 was current
            fakes.gpus.use(comm.device)
            # allreduce_ (the gradient buckets' in-place reduction) hands the array itself to NCCL.
            return _outcome(lambda: comm.allreduce_(early))
        finally:
            comm.release()

    kind, message = _run(2, body)[1]
    assert kind == "ValueError", message
    assert "allreduce_ got an array on GPU 0, but rank 1 runs its collectives on GPU 1" in message
    assert "after minidl_parallel.init()" in message


# ---- sub-communicators and release -----------------------------------------------------------

def test_release_destroys_sub_communicators_and_frees_their_inner_communicators(fakes, monkeypatch):
    """Bug 9: sub-communicators (SyncBatchNorm groups, tensor-parallel groups) were never freed."""
    released = []
    monkeypatch.setattr(ThreadsCommunicator, "release", lambda self: released.append(self))

    def body(rank):
        comm = nccl_backend.NcclCommunicator(timeout=30, stall_warning=0)
        sub = comm.split([1, 0])
        total = sub.allreduce(_dev(np.array([rank + 1.0])), "sum").get()
        nccl_comms, host = (comm.comm, sub.comm), sub._mpi
        kept = (sub.device, sub.timeout, sub.stall_warning, sub.debug) == (comm.device, 30.0, 0.0, comm.debug)
        comm.release()
        comm.release()  # a second release does nothing
        return {"sub_rank": sub.rank, "total": total, "destroyed": [c.destroyed for c in nccl_comms],
                "sub_comm": sub.comm, "host_released": [h is host for h in released if h is host], "kept": kept,
                "world_host_released": any(h is comm._mpi for h in released)}

    for rank, out in enumerate(_run(2, body)):
        assert out["sub_rank"] == 1 - rank
        assert out["kept"], "the sub-communicator left the rank's GPU or its settings"
        np.testing.assert_array_equal(out["total"], [3.0])
        assert out["destroyed"] == [True, True]
        assert out["sub_comm"] is None
        assert out["host_released"] == [True], "the sub-communicator's inner communicator was not freed once"
        assert out["world_host_released"], "the communicator's own inner communicator was not freed"


def test_release_stops_the_watchdog_before_destroying_the_communicator(fakes):
    def body(rank):
        comm = nccl_backend.NcclCommunicator(timeout=60, stall_warning=0)
        fakes.gpus.idle = False  # the collective stays in flight: the watchdog polls check_async_error
        comm.allreduce(_dev(np.ones(2)))
        dog = comm._watchdog
        polled = _wait_until(lambda: "check_async_error" in comm.comm.calls)
        nccl_comm = comm.comm
        comm.release()
        named = dog.name == "minidl-nccl-watchdog" and dog.daemon  # a daemon: never holds up the exit
        # the thread makes the rank's GPU current: CUDA calls from it would make a context on GPU 0
        return polled, dog.is_alive(), dog in nccl_backend._watchdogs, named, set(nccl_comm.polled_on), rank

    try:
        results = _run(2, body)
    finally:
        fakes.gpus.idle = True
    for polled, alive, listed, named, polled_on, rank in results:
        assert polled, "the watchdog never polled NCCL for asynchronous errors"
        assert not alive and not listed and named
        assert polled_on == {_BUS_IDS[rank]}
    assert fakes.aborts == [], "the watchdog used the destroyed communicator and ended the job"


def test_an_asynchronous_nccl_error_aborts_nccl_and_the_mpi_job(fakes, capfd):
    """NCCL's asynchronous error (e.g. a peer's connection lost) on a rank ends the job:
    ncclCommAbort, then MPI_Abort, which mpirun turns into the end of every rank."""
    def body(rank):
        comm = nccl_backend.NcclCommunicator(timeout=60, stall_warning=0)
        fakes.gpus.idle = False
        nccl_comm = comm.comm
        if rank == 1:
            nccl_comm.async_error = "remote process exited or there was a network error"
        comm.allreduce(_dev(np.ones(2)))
        if rank == 1:
            _wait_until(lambda: fakes.aborts)
        comm.comm = None  # stops the watchdog (what MPI_Abort would have done)
        return nccl_comm.aborted

    try:
        results = _run(2, body)
    finally:
        fakes.gpus.idle = True
    assert results == [False, True]
    assert fakes.aborts == [1]
    assert capfd.readouterr().err == ("minidl_parallel: rank 1: NCCL reported an error during allreduce #0(shape=(2,), "
                                      "dtype=float64): remote process exited or there was a network error\n")


def _wait_until(condition, limit=5.0):
    done = threading.Event()
    for _ in range(int(limit / 0.01)):
        if condition():
            return True
        done.wait(0.01)
    return False


# ---- under mpirun: the real inner MpiCommunicator -----------------------------------------

_MPI_SCRIPT = '''
import sys, types
import numpy as np
sys.path.insert(0, {tests!r})
import test_nccl_backend as fakes
from minidl_parallel.comm import nccl as nccl_backend
from mpi4py import MPI

fakes._gpus["now"] = fakes._Gpus(fakes._BUS_IDS)
made = []

class NcclCommunicator:  # only made and destroyed here: its collectives need the in-process fakes
    def __init__(self, ndev, commId, rank, /):
        assert len(commId) == 128 and 0 <= rank < ndev
        self.destroyed = False
        made.append(self)

    def destroy(self):
        self.destroyed = True

nccl = types.SimpleNamespace(NcclCommunicator=NcclCommunicator, get_unique_id=lambda: tuple([1] * 128),
                             NCCL_SUM=0, NCCL_PROD=1, NCCL_MAX=2, NCCL_MIN=3)
nccl_backend.import_nccl = lambda: (fakes._fake_cupy(), nccl)
comm = nccl_backend.NcclCommunicator(timeout=30, stall_warning=0)
r = comm.rank
step = np.array([10 * (r + 1)], np.int32)
assert comm.allreduce_(step, "max") is step and step.tolist() == [20], step
assert comm.broadcast(np.array([r + 0.5]), root=1).tolist() == [1.5]
assert comm.allgather(np.array([float(r)])).tolist() == [0.0, 1.0]
sub = comm.split([1, 0])
assert sub.rank == 1 - r and sub.allreduce(np.array([r + 1.0])).tolist() == [3.0]
inner = sub._mpi.comm
comm.release()
assert inner == MPI.COMM_NULL, "the sub-communicator's MPI communicator was not freed"
assert sub.comm is None and all(c.destroyed for c in made), "an NCCL communicator was not destroyed"
print(f"rank {{r}}: ok", flush=True)
'''


def test_host_arrays_split_and_release_over_the_real_inner_mpi_communicator(tmp_path):
    """NcclCommunicator() as init() makes it, on mpirun's ranks: the bootstrap, host arrays, a
    split and its release go through the real MpiCommunicator (CuPy and NCCL still faked)."""
    from .test_mpi import mpirun
    script = tmp_path / "nccl_over_mpi.py"
    script.write_text(_MPI_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    proc = mpirun(2, script)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("rank")) == ["rank 0: ok", "rank 1: ok"]


# ---- a unique id made by the launcher (SINGA's nccl_id, init("nccl", unique_id=...)) -------

def test_ranks_given_one_unique_id_join_through_it(fakes):
    uid = fakes.nccl.get_unique_id()

    def body(rank):
        comm = nccl_backend.NcclCommunicator(timeout=30, stall_warning=0, unique_id=uid)
        try:
            return comm.allreduce(_dev(np.array([rank + 1.0])), "sum").get()
        finally:
            comm.release()

    assert [float(t[0]) for t in _run(2, body)] == [3.0, 3.0]


@pytest.mark.parametrize("ids", ["different", "one missing"])
def test_different_or_missing_unique_ids_are_refused_on_every_rank(fakes, ids):
    uids = [fakes.nccl.get_unique_id(), fakes.nccl.get_unique_id()]
    if ids == "one missing":
        uids[1] = None

    def body(rank):
        return _outcome(lambda: nccl_backend.NcclCommunicator(timeout=30, stall_warning=0, unique_id=uids[rank]))

    results = _run(2, body)
    want = "rank(s) [1] differ from rank 0's" if ids == "different" else "rank(s) [1] were given no unique_id"
    assert all(kind == "RuntimeError" and want in message for kind, message in results), results


# ---- settings, the bootstrap, dtypes and ops, streams ------------------------------------------

def test_the_settings_reach_the_communicator_and_its_inner_mpi_communicator(fakes):
    mpi_comm = object()  # the mpi4py communicator a caller passes (the stand-in inner ignores it)

    def body(rank):
        comm = nccl_backend.NcclCommunicator(mpi_comm, timeout=12, stall_warning=3, debug=1)
        try:
            gathered = comm.allgather_object({"rank": rank})
            assert comm.mpi_comm is comm._mpi.comm  # the mpi4py communicator of the same ranks
            return (comm.timeout, comm.stall_warning, comm.debug, comm.local_rank, comm.local_size), gathered
        finally:
            comm.release()

    for rank, (settings, gathered) in enumerate(_run(2, body)):
        assert settings == (12.0, 3.0, 1, rank, 2)
        assert gathered == [{"rank": 0}, {"rank": 1}]
    # the inner communicator: the same bounds, no debug checks of its own (the nccl one makes them)
    assert _inner_made == [(mpi_comm, 0, 12, 3)] * 2


def test_the_bootstrap_is_one_named_gather_of_the_placements_and_one_unique_id(fakes, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    seen, names = {}, []
    check = nccl_backend._check_placement

    def spy(placements):
        seen[get_communicator().rank] = placements
        return check(placements)

    gather = ThreadsCommunicator._allgather_object

    def named_gather(self, obj):
        names.append(str(self._call))  # what a timeout of the inner communicator would name
        return gather(self, obj)

    monkeypatch.setattr(nccl_backend, "_check_placement", spy)
    monkeypatch.setattr(ThreadsCommunicator, "_allgather_object", named_gather)

    def body(rank):
        nccl_backend.NcclCommunicator(timeout=30, stall_warning=0).release()

    _run(2, body)
    uid = seen[0][0]["uid"]
    assert isinstance(uid, tuple) and len(uid) == 128
    want = [{"local_rank": r, "local_size": 2, "visible": "unset", "uid_given": False, "uid": uid if r == 0 else None,
             "device": r, "count": 4, "host": nccl_backend._host_id(), "bus_id": _BUS_IDS[r]} for r in range(2)]
    assert seen == {0: want, 1: want}  # only rank 0 made a unique id (each one starts NCCL's bootstrap root)
    assert names == ["nccl init (unique id, GPU placement) #-1()"] * 2


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int8", "uint8", "int32", "uint32", "int64",
                                   "uint64"])
def test_every_nccl_dtype_and_op_reduces_as_numpy_does(fakes, dtype):
    def body(rank):
        comm = nccl_backend.NcclCommunicator(timeout=30, stall_warning=0)
        try:
            x = _dev(np.array([1, 2, 3, 4, 5, 6]) * (rank + 1) % 7)
            x = x.astype(dtype)
            return {op: comm.allreduce(x, op).get() for op in ("sum", "max", "min", "prod")}
        finally:
            comm.release()

    a, b = (np.array([1, 2, 3, 4, 5, 6]) * (r + 1) % 7 for r in range(2))
    for out in _run(2, body):
        for op, fn in {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}.items():
            assert out[op].dtype == np.dtype(dtype), op
            np.testing.assert_array_equal(out[op], fn(a, b).astype(dtype), err_msg=op)


class _NoData:
    """Array-like but neither CuPy nor NumPy: a shape, a dtype, no device memory."""
    shape, dtype, size, ndim = (2,), np.dtype(np.float32), 2, 1
    flags = types.SimpleNamespace(c_contiguous=True)


class _DataWithoutPointer(_NoData):
    data = b"\0" * 8


def test_unsupported_dtypes_and_arrays_are_refused_naming_them(fakes):
    def body(rank):
        comm = nccl_backend.NcclCommunicator(timeout=30, stall_warning=0)
        try:
            return [_outcome(lambda: comm.allreduce(_dev(np.ones(2, np.complex64))))] + [
                _outcome(lambda a=a: comm.allreduce_(a)) for a in (_NoData(), _DataWithoutPointer())]
        finally:
            comm.release()

    dtype_error, *array_errors = _run(1, body)[0]
    assert dtype_error == ("TypeError", "nccl backend: dtype complex64 is not supported; use one of ['float16', "
                                        "'float32', 'float64', 'int32', 'int64', 'int8', 'uint32', 'uint64', 'uint8']")
    for kind, cls in zip(array_errors, (_NoData, _DataWithoutPointer)):
        assert kind == ("TypeError", "nccl backend: allreduce_ takes CuPy arrays (device memory) or NumPy arrays "
                                     f"(host state, sent over MPI), got {cls.__module__}.{cls.__name__}")


def test_iallreduce_runs_on_a_non_blocking_side_stream_that_the_current_stream_then_waits_for(fakes):
    def body(rank):
        comm = nccl_backend.NcclCommunicator(timeout=30, stall_warning=0)
        try:
            x = _dev(np.arange(4.0))
            fakes.cupy.stream_log.clear()
            request = comm.iallreduce_(x, "sum")
            started = list(fakes.cupy.stream_log)
            assert request.wait() is x
            side = comm._side_stream
            comm.allreduce_(x)
            # alltoall of one rank: its block is the whole array
            return (side.ptr, side.non_blocking, started, list(fakes.cupy.stream_log), list(comm.comm.streams),
                    x.get(), comm.alltoall(_dev(np.arange(3.0))).get())
        finally:
            comm.release()

    side, non_blocking, started, log, streams, x, exchanged = _run(1, body)[0]
    # a blocking stream would wait for the default stream's kernels: no overlap with backward
    assert non_blocking is True and side != 0
    assert started == [("record", 0), ("wait", side, 0),  # the side stream waits for the gradients
                       ("record", side),  # the watchdog follows the side stream
                       ("record", side)]  # the end of the reduction
    assert log[len(started)] == ("wait", 0, side)  # wait(): the current stream waits for the reduction
    assert streams == [side, 0]  # NCCL ran the iallreduce_ on the side stream, allreduce_ on the current one
    np.testing.assert_array_equal(x, np.arange(4.0))
    np.testing.assert_array_equal(exchanged, np.arange(3.0))


def test_a_barrier_whose_gpu_work_never_ends_times_out_and_ends_the_job(fakes, capfd):
    def body(rank):
        comm = nccl_backend.NcclCommunicator(timeout=0.2, stall_warning=0)
        comm.barrier()  # the GPU work before it is done: it returns, and nothing ends
        assert fakes.aborts == [] and capfd.readouterr().err == ""
        fakes.gpus.idle = False
        try:
            comm.barrier()  # the abort is recorded, not done: the barrier goes on
            return comm.comm.aborted
        finally:
            fakes.gpus.idle = True
            comm.release()

    assert _run(1, body) == [True]
    assert fakes.aborts == [1]
    assert re.fullmatch(r"minidl_parallel: rank 0 of 1 \(nccl backend\): barrier #1\(\) timed out after 0\.\d s; "
                        r"ranks that have not arrived: unknown; aborting NCCL and the MPI job \(timeout 0\.2 s\)\n",
                        capfd.readouterr().err)


def test_over_a_host_communicator_takes_the_given_device_settings_and_unique_id(fakes, monkeypatch):
    released = []
    monkeypatch.setattr(ThreadsCommunicator, "release", lambda self: released.append(self))
    uid = fakes.nccl.get_unique_id()
    others = [fakes.nccl.get_unique_id(), fakes.nccl.get_unique_id()]

    def body(rank):
        host = get_communicator()
        comm = nccl_backend.NcclCommunicator.over(host, device=3 - rank, debug=1, timeout=9, stall_warning=2,
                                                  unique_id=uid)
        try:
            total = comm.allreduce(_dev(np.array([rank + 1.0])), "sum").get()
            settings = (comm.device, comm.debug, comm.timeout, comm.stall_warning)
        finally:
            comm.release()
        refused = _outcome(lambda: nccl_backend.NcclCommunicator.over(host, unique_id=others[rank]))
        return settings, total, refused

    for rank, (settings, total, refused) in enumerate(_run(2, body)):
        assert settings == (3 - rank, 1, 9.0, 2.0)
        np.testing.assert_array_equal(total, [3.0])
        assert refused[0] == "RuntimeError" and "rank(s) [1] differ from rank 0's" in refused[1]
    assert released == [], "release() closed the caller's host communicator"


def test_release_frees_everything_then_raises_the_failure_of_a_sub_communicator(fakes):
    def body(rank):
        comm = nccl_backend.NcclCommunicator(timeout=30, stall_warning=0)
        sub = comm.split([0, 1])

        def fail():
            sub.comm.destroy()
            raise OSError(f"rank {rank}: the sub-communicator could not be freed")
        sub.release = fail
        nccl_comm = comm.comm
        outcome = _outcome(comm.release)
        return outcome, comm.comm, nccl_comm.destroyed

    for rank, (outcome, left, destroyed) in enumerate(_run(2, body)):
        assert outcome == ("OSError", f"rank {rank}: the sub-communicator could not be freed")
        assert left is None and destroyed  # the parent was freed before the failure was raised


# ---- the device choice and the machine's identity (pure functions) ------------------------------

def _cupy_seeing(count):
    def get_count():
        if isinstance(count, Exception):
            raise count
        return count
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=get_count)))


def test_choose_device_names_what_cuda_sees(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert nccl_backend._choose_device(_cupy_seeing(2), None, 3) == (1, 2)  # the local rank modulo the count
    assert nccl_backend._choose_device(_cupy_seeing(2), 1, 0) == (1, 2)
    with pytest.raises(ValueError) as bad:
        nccl_backend._choose_device(_cupy_seeing(2), True, 0)  # a bool is no device number
    assert str(bad.value) == ("device must be an int in [0, 1] (this process sees 2 CUDA device(s), "
                              "CUDA_VISIBLE_DEVICES '2,3'), got True")
    with pytest.raises(RuntimeError) as none:
        nccl_backend._choose_device(_cupy_seeing(0), None, 0)
    assert str(none.value) == "CUDA sees no GPU (getDeviceCount() is 0; CUDA_VISIBLE_DEVICES '2,3')"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(RuntimeError) as failed:
        nccl_backend._choose_device(_cupy_seeing(_CudaError("cudaErrorInsufficientDriver")), None, 0)
    assert str(failed.value) == ("CUDA sees no usable GPU (CUDA_VISIBLE_DEVICES unset): _CudaError: "
                                 "cudaErrorInsufficientDriver")


def test_the_host_id_is_nccl_hostid_else_the_hostname_and_boot_id(monkeypatch, tmp_path):
    import builtins
    import socket
    monkeypatch.setenv("NCCL_HOSTID", "node-7")
    assert nccl_backend._host_id() == "node-7"
    monkeypatch.delenv("NCCL_HOSTID")
    boot = tmp_path / "boot_id"
    real_open = builtins.open

    def fake_open(path, *args, **kwargs):
        if path == "/proc/sys/kernel/random/boot_id":
            return real_open(boot, *args, **kwargs)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    for text, want in (("1b2c-3d\n", "1b2c-3d"), ("", "")):
        boot.write_text(text)
        assert nccl_backend._host_id() == socket.gethostname() + want
    boot.unlink()  # no boot id (not Linux): the hostname alone
    assert nccl_backend._host_id() == socket.gethostname()


def test_without_cupy_the_nccl_backend_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(ImportError) as missing:
        nccl_backend.import_nccl()
    assert str(missing.value).startswith("the nccl backend needs CuPy with NCCL: pip install 'minidl[gpu]' "
                                         "(cupy-cuda12x + nvidia-nccl-cu12) (")


# ---- point-to-point messages ----------------------------------------------------------------

def test_device_messages_go_through_nccl_send_and_recv_in_groups_and_host_ones_over_mpi(fakes):
    """Four ranks as a pipeline: each passes an activation forward and a gradient back in one
    batch (one NCCL group, so neighbours sending to each other at once cannot deadlock)."""
    def body(rank):
        comm = nccl_backend.NcclCommunicator(timeout=30, stall_warning=0)
        try:
            nxt, prev = rank + 1, rank - 1
            ops = []
            activation, gradient = _dev(np.zeros((2, 3))), _dev(np.zeros(4, np.float32))
            if nxt < 4:
                ops += [P2POp("send", _dev(np.full((2, 3), rank + 0.5)), nxt),
                        P2POp("recv", gradient, nxt)]
            if prev >= 0:
                ops += [P2POp("recv", activation, prev),
                        P2POp("send", _dev(np.full(4, 10.0 * rank, np.float32)), prev)]
            for request in comm.batch_isend_irecv(ops):
                request.wait()
            # blocking forms, one group each; a host array goes over the inner communicator
            step = np.array([rank], np.int64)
            if rank == 0:
                comm.send(_dev(np.arange(3.0)), 3, tag=4)
                comm.send(step, 3)
            elif rank == 3:
                comm.recv(step, 0)
                got = comm.recv(_dev(np.empty(3)), 0, tag=4).get()
                assert np.array_equal(got, np.arange(3.0)), got
            return (activation.get(), gradient.get(), step.copy(), [c for c in comm.comm.calls if c in ("send", "recv")],
                    comm.sent_messages, comm.received_messages)
        finally:
            comm.release()

    results = _run(4, body)
    for rank, (activation, gradient, step, calls, sent, received) in enumerate(results):
        np.testing.assert_array_equal(activation, np.full((2, 3), rank - 0.5) if rank else np.zeros((2, 3)))
        np.testing.assert_array_equal(gradient, np.full(4, 10.0 * (rank + 1)) if rank < 3 else np.zeros(4))
        np.testing.assert_array_equal(step, [0 if rank == 3 else rank])  # rank 3 received rank 0's host step
        neighbours = (rank > 0) + (rank < 3)
        device_sends = neighbours + (rank == 0)
        device_recvs = neighbours + (rank == 3)
        assert sorted(calls) == sorted(["send"] * device_sends + ["recv"] * device_recvs)  # host step: not NCCL
        assert (sent, received) == (neighbours + 2 * (rank == 0), neighbours + 2 * (rank == 3))
    by_rank = {}
    for g in fakes.nccl.groups:
        by_rank.setdefault(g[0][0], []).append([op[1:] for op in g])
    assert by_rank[1][0] == [("send", 2), ("recv", 2), ("recv", 0), ("send", 0)]  # the batch: one group
    assert by_rank[0][1:] == [[("send", 3)]]  # a blocking device send: a group of its own
    assert by_rank[3][1:] == [[("recv", 0)]]


def test_debug_mode_refuses_a_device_message_of_another_shape_before_nccl_receives_it(fakes):
    def body(rank):
        comm = nccl_backend.NcclCommunicator(timeout=30, stall_warning=0, debug=1)
        try:
            if rank == 0:
                comm.send(_dev(np.ones((2, 2), np.float32)), 1, tag=2)
                return None
            return _outcome(lambda: comm.recv(_dev(np.empty(4, np.float32)), 0, tag=2)), comm.comm.calls
        finally:
            comm.release()

    (kind, message), calls = _run(2, body)[1]
    assert (kind, message) == ("RuntimeError", "minidl_parallel: rank 1 of 2 (nccl backend): recv #0 from rank 0 (tag 2, "
                               "shape=(4,), dtype=float32): rank 0's send #0 (shape=(2, 2), dtype=float32) does not "
                               "match what this rank expects: message #0 of shape=(4,), dtype=float32 (the two ranks' "
                               "sends and receives differ in order or in their arrays)")
    assert "recv" not in calls  # NCCL was never asked: it would have read 16 bytes into another layout


def test_a_message_whose_gpu_work_never_ends_times_out_naming_its_peer(fakes, capfd):
    def body(rank):
        comm = nccl_backend.NcclCommunicator(timeout=0.2, stall_warning=0)
        fakes.gpus.idle = False
        try:
            comm.send(_dev(np.ones(2)), 0)  # a world of one sends itself: its receive never comes
            time.sleep(1.0)  # the watchdog sees the send's event never complete
            return comm.comm.aborted
        finally:
            fakes.gpus.idle = True
            comm.release()

    assert _run(1, body) == [True]
    err = capfd.readouterr().err
    assert re.search(r"minidl_parallel: rank 0 of 1 \(nccl backend\): send #0 to rank 0 \(tag 0, shape=\(2,\), "
                     r"dtype=float64\) timed out after 0\.\d s; ranks that have not arrived: \[0\]; aborting NCCL and "
                     r"the MPI job \(timeout 0\.2 s\)", err), err
