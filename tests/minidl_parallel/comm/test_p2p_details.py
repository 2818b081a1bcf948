"""Details of the point-to-point checks that the mutation run (tools/mutation.py p2p) found untested:
the largest tag is allowed, a P2POp's default tag is 0 (it pairs with a send or receive without a
tag), and a P2POp prints without a shape when its array has none."""
import re

import numpy as np
import pytest

import minidl_parallel as mp
from minidl_parallel.comm.p2p import MAX_TAG, P2POp, check_tag


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
