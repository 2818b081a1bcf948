"""Details of the point-to-point messages that the mutation runs (tools/mutation.py p2p, comm_backends)
found untested: the largest tag is allowed, a P2POp's default tag is 0 (it pairs with a send or
receive without a tag), and a P2POp prints without a shape when its array has none; on the mpi
backend (MPI's singleton world) which message a stalled wait names and which thread bounds it, and
on the nccl backend the name of a receive that waits on its inner communicator."""
import re
import threading
import time

import numpy as np
import pytest

import minidl_parallel as mp
from minidl_parallel.comm import create_communicator, nccl as nccl_backend
from minidl_parallel.comm.base import CollectiveStallWarning, CollectiveTimeout
from minidl_parallel.comm.p2p import MAX_TAG, P2POp, check_tag
from minidl_parallel.comm.threads import CollectiveAborted

from . import test_mpi, test_nccl_backend as nccl_tests

world = test_mpi.world  # the fixture: an MpiCommunicator over MPI's singleton world, as init("mpi") makes it
fakes = nccl_tests.fakes  # the fixture: CuPy's and NCCL's stand-ins, the inner communicator a threads one


def test_the_largest_tag_is_allowed_and_one_more_is_refused():
    def body():
        comm = mp.get_communicator()
        peer = 1 - comm.rank
        comm.send(np.array([float(comm.rank)]), peer, tag=MAX_TAG)
        return comm.recv(np.empty(1), peer, tag=MAX_TAG)

    got = mp.run_threads(2, body, timeout=20)
    assert [g.tolist() for g in got] == [[1.0], [0.0]]
    assert check_tag(MAX_TAG, "send") == MAX_TAG and check_tag(0, "recv") == 0
    with pytest.raises(ValueError, match=re.escape(f"send: tag must be an int in [0, {MAX_TAG}], got {MAX_TAG + 1}")):
        check_tag(MAX_TAG + 1, "send")


def test_a_p2p_op_without_a_tag_pairs_with_a_send_and_a_receive_without_one():
    def body():
        comm = mp.get_communicator()
        if comm.rank == 0:
            comm.send(np.arange(3.0), 1)  # tag 0
            into = np.empty(2)
            requests = comm.batch_isend_irecv([P2POp("recv", into, 1)])
            return requests[0].wait()
        got = np.empty(3)
        for request in comm.batch_isend_irecv([P2POp("recv", got, 0), P2POp("send", np.array([5.0, 6.0]), 0)]):
            request.wait()
        return got

    got = mp.run_threads(2, body, timeout=20)
    assert got[0].tolist() == [5.0, 6.0] and got[1].tolist() == [0.0, 1.0, 2.0]
    assert P2POp("send", np.ones(2), 1).tag == 0


def test_a_p2p_op_prints_its_kind_shape_peer_and_tag_and_no_shape_for_an_array_without_one():
    assert repr(P2POp("isend", np.ones((2, 3)), 1)) == "P2POp('send', shape=(2, 3), peer=1, tag=0)"
    assert repr(P2POp("recv", [1.0, 2.0], 0, tag=7)) == "P2POp('recv', shape=None, peer=0, tag=7)"


# ---- the mpi backend's messages on a world of one (tools/mutation.py comm_backends) ---------------
#
# What the mutation run of mpi.py found untested: which call a stalled message's wait names and
# which thread bounds it, the debug fingerprints' sends being let go once sent, device receives
# staged through the host, and the peer named when there is no watch channel.

class _TimedOut(Exception):
    """Raised by the stand-in timeout on the waiting thread (the real one aborts the MPI job)."""


@pytest.mark.parametrize("mode", ["watched", "polled"])
@pytest.mark.parametrize("debug", [0, 1])
@pytest.mark.parametrize("kind", ["recv", "send"])
def test_a_message_that_times_out_is_named_by_itself_and_bounded_by_the_watchdog_or_the_waiting_thread(
        world, monkeypatch, mode, debug, kind):
    """The wait names the message it waits for, not the one begun last; a watched wait is timed by
    the watchdog thread, a polled one (below MPI_THREAD_MULTIPLE) by the waiting thread."""
    test_mpi._set_mode(world, monkeypatch, mode)
    world.debug, world.timeout, world.stall_warning = debug, 0.2, 0
    other = world.isend(np.arange(5.0), 0, tag=5)  # pending: a probe for any tag would find it
    if kind == "recv":
        waited = world.irecv(np.empty(2), 0, tag=1)
    else:
        waited = world.isend(np.arange(4096.0), 0, tag=1)  # 32 KiB to itself: pending until its receive is posted
    latest = world.irecv(np.empty(3), 0, tag=2)  # begun last: what a wait without its own call would name
    waiting_thread = threading.current_thread()
    seen, releases, released = [], [], threading.Event()

    def on_timeout(call, waited_s):
        seen.append((str(call), threading.current_thread() is waiting_thread))
        if len(seen) == 1:  # let the waited message complete, as the missing peer would
            releases.append(world.isend(np.array([1.0, 2.0]), 0, tag=1) if kind == "recv"
                            else world.irecv(np.empty(4096), 0, tag=1))
            released.set()  # (the waiting thread may wake before this thread has returned from isend)
        if threading.current_thread() is waiting_thread:
            raise _TimedOut  # (a watched wait goes on once its message arrives)

    monkeypatch.setattr(world, "_on_timeout", on_timeout)
    try:
        got = waited.wait()
    except _TimedOut:
        got = waited.wait()
    name = ("recv #0 from rank 0 (tag 1, shape=(2,), dtype=float64)" if kind == "recv" else
            "send #0 to rank 0 (tag 1, shape=(4096,), dtype=float64)")
    assert seen[0] == (name, mode == "polled")
    assert released.wait(10)
    release = releases[0].wait()
    if kind == "recv":
        np.testing.assert_array_equal(got, [1.0, 2.0])
    else:  # the receive posted for it got what was sent
        np.testing.assert_array_equal(release, np.arange(4096.0))
    world.send(np.ones(3), 0, tag=2)
    np.testing.assert_array_equal(latest.wait(), np.ones(3))
    np.testing.assert_array_equal(world.recv(np.empty(5), 0, tag=5), np.arange(5.0))
    assert other.wait() is not None and other.done


def test_the_debug_fingerprints_sent_are_let_go_once_received(world):
    world.debug = 1
    for k in range(3):
        world.send(np.full(2, float(k)), 0, tag=k)
        np.testing.assert_array_equal(world.recv(np.empty(2), 0, tag=k), [k, k])
        assert len(world._headers) == 1  # the one just sent: the earlier ones completed and were freed


def test_a_device_message_reaches_mpi_as_a_host_copy_and_is_uploaded_into_the_receive(world, on_the_double):
    from minidl.testing import cupy_double
    x = on_the_double.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    into = on_the_double.zeros((2, 3), dtype=np.float32)
    with cupy_double.count_host_syncs() as copies:
        world.send(x, 0, tag=2)
        assert world.recv(into, 0, tag=2) is into
    # MPI here cannot read or write device memory: the send gets a host copy, the receive a host
    # buffer uploaded into ``into`` afterwards
    assert (copies.by_reason, copies.uploads) == ({"get": 1}, 1), (copies.by_reason, copies.uploads)
    np.testing.assert_array_equal(into.get(), x.get())


def test_without_the_watch_channel_a_stalled_message_names_its_peer(world, monkeypatch):
    from minidl_parallel.comm import mpi as backend
    from minidl_parallel.comm.base import CallInfo
    monkeypatch.setitem(backend._watch, "watch", None)
    call = CallInfo("recv", 3, (4,), "float32", peer=2, tag=6)
    assert world._stall_message(call, 1.0, "has waited").endswith(
        "recv #3 from rank 2 (tag 6, shape=(4,), dtype=float32) has waited 1.0 s; ranks that have not arrived: [2] "
        "(no watch channel: this communicator was not made through init)")


def test_a_receive_that_did_not_fit_says_the_same_when_waited_again(world):
    """MPI fills a receive's status once: a second wait must not complete the request again (MPI
    would then report an empty status, 0 bytes)."""
    world.send(np.ones(2), 0)
    request = world.irecv(np.empty(3), 0)
    message = ("minidl_parallel: rank 0 of 1 (mpi backend): recv #0 from rank 0 (tag 0, shape=(3,), dtype=float64): "
               "rank 0 sent 16 bytes, this rank expects 24")
    for _ in range(2):
        with pytest.raises(RuntimeError, match=re.escape(message)):
            request.wait()


# ---- the nccl backend's host messages and debug fingerprints, over its inner communicator -------

@pytest.mark.parametrize("on", ["host", "device"])
def test_a_nccl_receive_waiting_on_the_inner_communicator_is_named_when_its_sender_is_gone(fakes, on):
    """A host array's receive, and a device receive's debug fingerprint, wait on the inner
    communicator (a threads one here) under the receive's own name."""
    def body(rank):
        comm = nccl_backend.NcclCommunicator(timeout=30, stall_warning=0, debug=1)
        try:
            if rank == 0:
                return None  # returns without sending
            into = np.empty(1, np.int64) if on == "host" else nccl_tests._dev(np.empty(3))
            return nccl_tests._outcome(lambda: comm.recv(into, 0, tag=5))
        finally:
            comm.release()

    what = "shape=(1,), dtype=int64" if on == "host" else "shape=(3,), dtype=float64"
    assert nccl_tests._run(2, body)[1] == ("CollectiveAborted", f"threads backend: rank 1 of 2: recv #0 from rank 0 "
                                           f"(tag 5, {what}) can never complete: rank 0 returned without sending it")


# ---- the base class and the local backend (tools/mutation.py comm) ------------------------------

def test_a_backend_without_messages_says_so_and_counts_none():
    from .test_base import _Stub
    comm = _Stub()
    for start in (lambda: comm.send(np.ones(1), 1), lambda: comm.irecv(np.ones(1), 1)):
        with pytest.raises(NotImplementedError, match=re.escape("the stub backend has no point-to-point messages")):
            start()
    assert (comm.sent_messages, comm.received_messages) == (0, 0)


def test_a_world_of_one_names_the_receive_whose_message_does_not_fit():
    comm = create_communicator("local")
    comm.send(np.ones(2), 0, tag=3)
    with pytest.raises(RuntimeError) as info:
        comm.recv(np.empty(3), 0, tag=3)
    assert str(info.value) == (
        "minidl_parallel: rank 0 of 1 (local backend): recv #0 from rank 0 (tag 3, shape=(3,), dtype=float64): rank "
        "0's send #0 (shape=(2,), dtype=float64) does not match what this rank expects: message #0 of shape=(3,), "
        "dtype=float64 (the two ranks' sends and receives differ in order or in their arrays)")


# ---- the threads backend's mailboxes (tools/mutation.py comm) -------------------------------------

def test_a_labelled_receive_prints_its_label_and_the_label_ends_with_its_block():
    def body():
        comm = mp.get_communicator()
        if comm.rank == 0:
            time.sleep(0.6)  # past rank 1's stall warning
            comm.send(np.array([1.0]), 1)
            comm.send(np.array([2.0]), 1, tag=1)
            return None
        comm.stall_warning = 0.2
        with comm.labelled("stage 1, F3: the activation from stage 0"):
            with comm.labelled("inner"):
                pass
            got = comm.recv(np.empty(1), 0)
        later = comm.irecv(np.empty(1), 0, tag=1)  # begun after the block: no label
        return got, str(comm._call), later.wait()

    with pytest.warns(CollectiveStallWarning) as warned:
        got, after, later = mp.run_threads(2, body, timeout=20)[1]
    assert len(warned) == 1 and re.fullmatch(re.escape(
        "threads backend: rank 1 of 2: recv #0 from rank 0 (tag 0, shape=(1,), dtype=float64) (stage 1, F3: the "
        "activation from stage 0) has waited ") + r"0\.\d" + re.escape(
        " s; ranks that have not arrived: [0] (the sender has not sent it)"), str(warned[0].message)), warned[0]
    assert after == "recv #0 from rank 0 (tag 1, shape=(1,), dtype=float64)"
    assert got.tolist() == [1.0] and later.tolist() == [2.0]


def _late_sender(comm):
    time.sleep(1.0)  # past the receiver's timeout; then returns without sending


@pytest.mark.parametrize("failure, reason", [
    ("raised", "rank 0 raised ValueError: stage 0 fails"),
    ("returned", "threads backend: rank 1 of 3: recv #0 from rank 0 (tag 0, shape=(1,), dtype=float64) can never "
                 "complete: rank 0 returned without sending it"),
    ("timed out", "threads backend: rank 1 of 3: recv #0 from rank 0 (tag 0, shape=(1,), dtype=float64) timed out "
                  "after "),
])
def test_a_receive_that_fails_tells_the_ranks_waiting_on_it_why(failure, reason):
    """Rank 1 waits for rank 0, which raises, returns or sleeps past rank 1's timeout; rank 2 waits
    for rank 1 and is told the first failure (the receive's own message where it failed first)."""
    told = {}

    def body():
        comm = mp.get_communicator()
        if comm.rank == 0:
            if failure == "raised":
                raise ValueError("stage 0 fails")
            if failure == "timed out":
                _late_sender(comm)
            return None
        comm.timeout = 0.3 if comm.rank == 1 else 20.0
        try:
            comm.recv(np.empty(1), comm.rank - 1)
        except (CollectiveAborted, CollectiveTimeout) as exc:
            told[comm.rank] = str(exc)
            raise

    with pytest.raises((ValueError, CollectiveAborted, CollectiveTimeout)):
        mp.run_threads(3, body, timeout=20)
    waits = [(1, 0)] if failure == "raised" else [(2, 1)]
    for rank, peer in waits:
        assert told[rank].startswith(f"threads backend: rank {rank}: recv #0 from rank {peer} (tag 0, shape=(1,), "
                                     f"dtype=float64) aborted because {reason}"), told[rank]
