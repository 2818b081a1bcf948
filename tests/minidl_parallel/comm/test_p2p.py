"""Point-to-point messages (send, recv, isend, irecv, batch_isend_irecv) on the threads and local
backends: delivery and order against what each sender sent, the checks, and bounded waits that
name the sender. The mpi backend's are in test_mpi.py (under mpirun and in a world of one), the
nccl backend's in test_nccl_backend.py."""
import re
import time

import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl_parallel as mp
from minidl_parallel import run_threads
from minidl_parallel.comm import create_communicator
from minidl_parallel.comm.base import CollectiveStallWarning, CollectiveTimeout
from minidl_parallel.comm.p2p import MAX_TAG, P2POp
from minidl_parallel.comm.threads import CollectiveAborted

TIMEOUT = 20.0
DTYPES = [np.float64, np.float32, np.int64, np.uint8]


def run(n, fn):
    return run_threads(n, fn, timeout=TIMEOUT)


def payload(sender, receiver, k, shape, dtype):
    """The k-th message sender sends receiver: a value both sides can compute."""
    base = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    return np.asarray((base + 31 * sender + 7 * receiver + 3 * k) % 97, dtype=dtype)


# messages: (sender, receiver, tag, shape, dtype index), in the order each sender sends them
messages = st.integers(2, 5).flatmap(lambda n: st.tuples(st.just(n), st.lists(
    st.tuples(st.integers(0, n - 1), st.integers(1, n - 1), st.integers(0, 2),
              st.lists(st.integers(0, 3), max_size=2).map(tuple), st.integers(0, len(DTYPES) - 1))
    .map(lambda m: (m[0], (m[0] + m[1]) % n) + m[2:]), max_size=12)))


@given(messages, st.booleans())
def test_each_message_arrives_once_in_order_per_sender_and_tag(drawn, receive_newest_tag_first):
    n, plan = drawn

    def body():
        comm = mp.get_communicator()
        me = comm.rank
        mine = [(i, m) for i, m in enumerate(plan) if m[0] == me]
        requests = [comm.isend(payload(me, m[1], i, m[3], DTYPES[m[4]]), m[1], m[2]) for i, m in mine]
        incoming = [(i, m) for i, m in enumerate(plan) if m[1] == me]
        # Receive in another order than sent across tags (never within a sender and tag).
        incoming.sort(key=lambda im: -im[1][2] if receive_newest_tag_first else im[1][2])
        got = {}
        for i, (sender, _, tag, shape, d) in incoming:
            got[i] = comm.recv(np.empty(shape, DTYPES[d]), sender, tag)
        for r in requests:
            r.wait()
        return got, comm.sent_messages, comm.received_messages, comm.collective_count

    for rank, (got, sent, received, collectives) in enumerate(run(n, body)):
        expected = {i: payload(m[0], rank, i, m[3], DTYPES[m[4]]) for i, m in enumerate(plan) if m[1] == rank}
        assert sorted(got) == sorted(expected)
        for i, want in expected.items():
            assert got[i].dtype == want.dtype and got[i].shape == want.shape
            np.testing.assert_array_equal(got[i], want)
        assert sent == sum(m[0] == rank for m in plan) and received == len(expected)
        assert collectives == 0  # messages are not collectives


def test_a_ring_in_one_batch_and_both_directions_of_a_pair_complete_without_waiting_on_each_other():
    def body():
        comm = mp.get_communicator()
        me, n = comm.rank, comm.size
        into = np.empty((2, 3))
        nxt, prev = (me + 1) % n, (me - 1) % n
        requests = comm.batch_isend_irecv([P2POp("send", payload(me, nxt, 0, (2, 3), np.float64), nxt, tag=4),
                                           P2POp(comm.irecv, into, prev, tag=4)])
        assert requests[1].wait() is into and requests[0].wait() is not into
        return into, comm.sent_bytes, comm.received_bytes

    for rank, (into, sent, received) in enumerate(run(3, body)):
        np.testing.assert_array_equal(into, payload((rank - 1) % 3, rank, 0, (2, 3), np.float64))
        assert sent == received == 48


def test_a_receive_into_a_strided_view_writes_through_and_a_strided_send_sends_its_values():
    def body():
        comm = mp.get_communicator()
        if comm.rank == 0:
            comm.send(np.arange(12.0).reshape(3, 4)[:, ::2], 1)
            return None
        out = np.full((3, 4), -1.0)
        comm.recv(out[:, 1::2], 0)
        return out

    out = run(2, body)[1]
    np.testing.assert_array_equal(out[:, 1::2], np.arange(12.0).reshape(3, 4)[:, ::2])
    np.testing.assert_array_equal(out[:, ::2], -1.0)


def test_a_subgroup_numbers_its_own_ranks_and_its_messages_stay_in_it():
    def body():
        world = mp.get_communicator()
        odd = world.rank % 2
        group = world.split([r for r in range(4) if r % 2 == odd])  # {0, 2} and {1, 3}
        if group.rank == 0:
            group.send(np.array([10.0 * world.rank]), 1)
            world.send(np.array([-1.0]), (world.rank + 1) % 4)  # same tag, world's numbering
            return world.recv(np.empty(1), (world.rank - 1) % 4)
        got = group.recv(np.empty(1), 0)
        world.send(np.array([-1.0]), (world.rank + 1) % 4)
        world.recv(np.empty(1), (world.rank - 1) % 4)
        return got

    out = run(4, body)
    np.testing.assert_array_equal(out[2], [0.0])  # group {0, 2}: world rank 0 sent it
    np.testing.assert_array_equal(out[3], [10.0])  # group {1, 3}: world rank 1 sent it


def test_a_receive_of_another_shape_or_dtype_raises_naming_both_calls():
    def body(shape, dtype):
        def rank_body():
            comm = mp.get_communicator()
            if comm.rank == 0:
                comm.send(np.ones((2, 3)), 1, tag=3)
                comm.send(np.ones(4, np.float32), 1, tag=3)
                return None
            comm.recv(np.empty((2, 3)), 0, tag=3)
            comm.recv(np.empty(shape, dtype), 0, tag=3)
        return rank_body

    message = ("rank 1 of 2: minidl_parallel: rank 1 of 2 (threads backend): recv #1 from rank 0 (tag 3, "
               "shape={}, dtype={}): rank 0's send #1 (shape=(4,), dtype=float32) does not match what this rank "
               "expects: message #1 of shape={}, dtype={} (the two ranks' sends and receives differ in order or in "
               "their arrays)")
    for shape, dtype in [((5,), np.float32), ((4,), np.float64), ((2, 2), np.float32)]:
        with pytest.raises(RuntimeError) as info:
            run(2, body(shape, dtype))
        d = np.dtype(dtype).name
        assert str(info.value) == message.format(shape, d, shape, d)
    run(2, body((4,), np.float32))  # and the matching receive passes


@pytest.mark.call_site  # (the file:line of the send: mutmut's trampolines add frames)
def test_debug_level_2_names_the_line_of_the_send_that_does_not_match(monkeypatch):
    monkeypatch.setenv("MINIDL_DIST_DEBUG", "2")

    def body():
        comm = mp.get_communicator()
        if comm.rank == 0:
            comm.send(np.ones(2), 1)  # the line named
            return None
        comm.recv(np.empty(3), 0)

    with pytest.raises(RuntimeError, match=r"rank 0's send #0 \(shape=\(2,\), dtype=float64\) at "
                                           r".*test_p2p\.py:\d+ does not match") as info:
        run(2, body)
    line = int(re.search(r"test_p2p\.py:(\d+)", str(info.value)).group(1))
    with open(__file__) as f:
        assert "the line named" in f.read().splitlines()[line - 1]


def test_a_receive_whose_sender_never_sends_times_out_naming_it_and_aborts_the_world():
    def body():
        comm = mp.get_communicator()
        comm.timeout = 0.5 if comm.rank == 2 else 10.0
        if comm.rank == 2:
            comm.recv(np.empty((1, 2), np.float32), 0, tag=9)
        else:
            comm.barrier()  # ranks 0 and 1 wait here, and are told why the world failed

    with pytest.raises(CollectiveTimeout) as info:
        run(3, body)
    assert str(info.value) == (
        "rank 2 of 3: threads backend: rank 2 of 3: recv #0 from rank 0 (tag 9, shape=(1, 2), dtype=float32) "
        "timed out after 0.5 s; ranks that have not arrived: [0] (the sender has not sent it) (set "
        "MINIDL_COLLECTIVE_TIMEOUT or init(timeout=...) to change the limit)")


def test_a_receive_in_a_subgroup_names_the_sender_by_group_and_world_rank_when_it_stalls():
    def body():
        world = mp.get_communicator()
        group = world.split([1, 2]) if world.rank else None
        if world.rank == 2:
            group.stall_warning, group.timeout = 0.2, 5.0
            return group.recv(np.empty(1), 0)
        if world.rank == 1:
            time.sleep(0.6)
            group.send(np.array([4.0]), 1)
        return None

    with pytest.warns(CollectiveStallWarning) as warned:
        out = run(3, body)
    np.testing.assert_array_equal(out[2], [4.0])
    assert [str(w.message) for w in warned] == [
        "threads backend: rank 1 of 2: recv #0 from rank 0 (tag 0, shape=(1,), dtype=float64) has waited 0.2 s; "
        "ranks that have not arrived: [0] (world rank 1) (the sender has not sent it)"]


def test_a_sender_that_returned_or_a_rank_that_failed_ends_the_wait_at_once():
    def returned():
        comm = mp.get_communicator()
        if comm.rank == 1:
            comm.recv(np.empty(1), 0)

    start = time.monotonic()
    with pytest.raises(CollectiveAborted, match=re.escape(
            "rank 1 of 2: threads backend: rank 1 of 2: recv #0 from rank 0 (tag 0, shape=(1,), dtype=float64) "
            "can never complete: rank 0 returned without sending it")):
        run(2, returned)

    def failed():
        comm = mp.get_communicator()
        if comm.rank == 0:
            raise ValueError("stage 0 fails")
        comm.recv(np.empty(1), 0)

    with pytest.raises(ValueError, match="rank 0 of 2: stage 0 fails"):
        run(2, failed)
    assert time.monotonic() - start < 5.0  # neither waited for the 600 s timeout


def test_messages_sent_before_the_sender_returned_are_still_received():
    def body():
        comm = mp.get_communicator()
        if comm.rank == 0:
            comm.send(np.array([1.0, 2.0]), 1)
            return None
        time.sleep(0.2)  # rank 0 has returned by now
        return comm.recv(np.empty(2), 0)

    np.testing.assert_array_equal(run(2, body)[1], [1.0, 2.0])


@pytest.mark.parametrize("call, error, message", [
    (lambda c: c.send(np.ones(1), 2), ValueError,
     "send: the peer must be an int in [0, 1] (a rank of this communicator of size 2), got 2"),
    (lambda c: c.recv(np.ones(1), -1), ValueError,
     "recv: the peer must be an int in [0, 1] (a rank of this communicator of size 2), got -1"),
    (lambda c: c.isend(np.ones(1), True), ValueError,
     "send: the peer must be an int in [0, 1] (a rank of this communicator of size 2), got True"),
    (lambda c: c.irecv(np.ones(1), 1.0), ValueError,
     "recv: the peer must be an int in [0, 1] (a rank of this communicator of size 2), got 1.0"),
    (lambda c: c.send(np.ones(1), c.rank), ValueError,
     "send: rank {rank} cannot exchange a message with itself (peer {rank}); pass another rank of the 2"),
    (lambda c: c.send(np.ones(1), 1 - c.rank, tag=MAX_TAG + 1), ValueError,
     f"send: tag must be an int in [0, {MAX_TAG}], got {MAX_TAG + 1}"),
    (lambda c: c.recv(np.ones(1), 1 - c.rank, tag=-1), ValueError, f"recv: tag must be an int in [0, {MAX_TAG}], got -1"),
    (lambda c: c.recv(np.ones(1), 1 - c.rank, tag=False), ValueError,
     f"recv: tag must be an int in [0, {MAX_TAG}], got False"),
    (lambda c: c.send(np.float64(1.0), 1 - c.rank), TypeError,
     "send: takes a NumPy or CuPy array, got numpy.float64 (a 0-d array is numpy.asarray(value))"),
    (lambda c: c.recv([1.0], 1 - c.rank), TypeError,
     "recv: takes a NumPy or CuPy array, got builtins.list (a 0-d array is numpy.asarray(value))"),
    (lambda c: c.batch_isend_irecv([("send", np.ones(1), 1)]), TypeError,
     "batch_isend_irecv: ops must be P2POp objects, got tuple: ('send', array([1.]), 1)"),
])
def test_bad_arguments_raise_before_anything_is_sent_naming_the_value(call, error, message):
    def body():
        comm = mp.get_communicator()
        with pytest.raises(error) as info:
            call(comm)
        assert (comm.sent_messages, comm.received_messages) == (0, 0)
        return str(info.value)

    assert run(2, body) == [message.format(rank=r) for r in range(2)]


def test_a_p2p_op_names_send_or_recv_and_refuses_anything_else():
    comm = create_communicator("local")
    assert P2POp(comm.isend, np.ones(2), 0).op == "send" and P2POp("irecv", np.ones(2), 0).op == "recv"
    assert repr(P2POp("recv", np.ones((2, 3)), 1, tag=5)) == "P2POp('recv', shape=(2, 3), peer=1, tag=5)"
    for bad in ("broadcast", comm.allreduce, None):
        with pytest.raises(ValueError, match=re.escape(
                f"P2POp: op must be 'send' or 'recv' (or a communicator's isend / irecv), got {bad!r}")):
            P2POp(bad, np.ones(2), 0)


def test_a_world_of_one_receives_what_it_sent_itself_and_says_when_nothing_was_sent():
    comm = create_communicator("local")
    comm.send(np.arange(3.0), 0, tag=1)
    comm.send(np.arange(2.0), 0)
    np.testing.assert_array_equal(comm.recv(np.empty(2), 0), [0.0, 1.0])
    np.testing.assert_array_equal(comm.recv(np.empty(3), 0, tag=1), [0.0, 1.0, 2.0])
    with pytest.raises(RuntimeError, match=re.escape(
            "minidl_parallel: recv #1 from rank 0 (tag 1, shape=(3,), dtype=float64) can never complete: in a world "
            "of one, only this rank sends, and it has not sent a message with tag 1")):
        comm.recv(np.empty(3), 0, tag=1)
    comm.send(np.ones(2), 0)
    with pytest.raises(RuntimeError, match=re.escape("rank 0's send #1 (shape=(2,), dtype=float64) does not match")):
        comm.recv(np.empty(3), 0)


def test_a_request_says_whether_its_message_completed_without_waiting():
    def body():
        comm = mp.get_communicator()
        if comm.rank == 0:
            sent = comm.isend(np.arange(3.0), 1)
            done_at_once = sent.test() and sent.done  # buffered: complete once started
            comm.barrier()  # rank 1 tests its receive before this send exists...
            comm.send(np.arange(3.0), 1, tag=1)
            comm.barrier()
            return done_at_once
        first = comm.recv(np.empty(3), 0)
        pending = comm.irecv(np.zeros(3), 0, tag=1)
        before = pending.test()  # ...and finds nothing yet
        comm.barrier()
        comm.barrier()
        deadline = time.monotonic() + 5
        while not pending.test() and time.monotonic() < deadline:
            time.sleep(0.01)
        return before, pending.done, pending.wait(), first

    done_at_once, (before, done, got, first) = run(2, body)
    assert done_at_once and not before and done
    np.testing.assert_array_equal(got, np.arange(3.0))
    np.testing.assert_array_equal(first, np.arange(3.0))
    comm = create_communicator("local")
    pending = comm.irecv(np.empty(1), 0)
    assert not pending.test() and not pending.done
    comm.send(np.ones(1), 0)
    assert pending.test() and pending.wait()[0] == 1.0
