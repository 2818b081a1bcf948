"""The Communicator contract (comm/base.py): what every backend gets from the base class.

A stub backend of two ranks that all pass the same array checks what the primitives receive
(C-contiguous buffers, op never "mean") and drives the bounded wait that mpi and nccl use.
"""
import re
import time
import warnings

import numpy as np
import pytest

from minidl_parallel.comm.base import (CollectiveStallWarning, CollectiveTimeout, Communicator, Request,
                                       debug_enabled, debug_level)
from minidl_parallel.comm.local import LocalCommunicator


class _Stub(Communicator):
    """Rank 0 of ``size`` ranks that all pass the same x; records what the primitives get."""

    backend = "stub"

    def __init__(self, size=2, debug=0, **kw):
        super().__init__(0, size, debug=debug, **kw)
        self.seen = []  # (primitive, C-contiguous?, op)
        self.missing = None  # what _missing_ranks answers
        self.asked = []  # the calls _missing_ranks was asked about
        self.served = []  # the calls _serve_peers answered for

    def _reduce(self, buf, op):
        self.seen.append(("allreduce", buf.flags.c_contiguous, op))
        if self.debug:  # the fingerprints agreed; then the other rank never arrives
            self._wait_for(lambda: False)
        buf[...] = {"sum": buf * self.size, "prod": buf ** self.size}.get(op, buf)

    def _allreduce(self, buf, op):
        self._reduce(buf, op)

    def _iallreduce(self, buf, op):
        return lambda: self._reduce(buf, op)  # the reduction happens in wait(), as with MPI_Iallreduce

    def _allgather(self, x):
        return np.stack([x] * self.size)

    def _reduce_scatter(self, x, op):
        self.seen.append(("reduce_scatter", x.flags.c_contiguous, op))
        return x[0] * self.size

    def _bcast(self, buf, root):
        self.seen.append(("bcast", buf.flags.c_contiguous, None))

    def _alltoall(self, x):
        return x.copy()

    def _barrier(self):
        self._wait_for(lambda: False)  # the other rank never arrives

    def _allgather_object(self, obj):
        return [obj] * self.size

    def _split(self, ranks):
        return ranks

    def _serve_peers(self, call):
        self.served.append(str(call))

    def _missing_ranks(self, call):
        self.asked.append(str(call))
        return self.missing, " (rank 1 is in broadcast #7)" if self.missing else ""


def test_request_waits_once_and_finishes_once():
    calls = []
    array = np.zeros(2)
    req = Request(lambda: calls.append("wait"), array, lambda: calls.append("finish"))
    assert req.done is False and calls == []
    assert req.wait() is array and req.wait() is array
    assert req.done is True and calls == ["wait", "finish"]
    assert Request(None, array).wait() is array  # already complete: nothing to wait for


def test_non_blocking_allreduce_completes_in_wait_and_writes_back_into_a_strided_x():
    comm = _Stub()
    base = np.arange(12.0).reshape(3, 4)
    x = base[:, ::2]  # not C-contiguous: the backend gets a contiguous copy, wait() copies it back
    req = comm.iallreduce_(x, "mean")
    assert comm.seen == [] and not req.done  # started, not completed
    assert req.wait() is x
    np.testing.assert_array_equal(base, np.arange(12.0).reshape(3, 4))  # mean of two equal arrays
    x = base[:, ::2]
    assert comm.iallreduce_(x, "sum").wait() is x
    np.testing.assert_array_equal(base[:, ::2], 2 * np.arange(12.0).reshape(3, 4)[:, ::2])
    np.testing.assert_array_equal(base[:, 1::2], np.arange(12.0).reshape(3, 4)[:, 1::2])  # untouched
    assert comm.seen == [("allreduce", True, "sum")] * 2


def test_primitives_get_c_contiguous_buffers_and_never_mean():
    comm = _Stub()
    x = np.arange(6.0).reshape(2, 3).T  # F-ordered
    np.testing.assert_array_equal(comm.allreduce(x, "mean"), x)
    np.testing.assert_array_equal(comm.allreduce(x, "prod"), x ** 2)
    np.testing.assert_array_equal(comm.broadcast(x, 1), x)
    y = np.arange(6.0).reshape(2, 3).T.copy(order="F")
    assert comm.allreduce_(y, "sum") is y
    np.testing.assert_array_equal(y, 2 * x)
    np.testing.assert_array_equal(comm.reduce_scatter(x, "mean", axis=1), x[:, :1])
    assert comm.seen == [("allreduce", True, "sum"), ("allreduce", True, "prod"), ("bcast", True, None),
                         ("allreduce", True, "sum"), ("reduce_scatter", True, "sum")]


def _raises(call, exc_type, message):
    with pytest.raises(exc_type) as info:
        call()
    assert str(info.value) == message


def test_argument_errors_name_the_collective_the_argument_and_what_is_expected():
    comm = _Stub()
    ops = "('sum', 'mean', 'max', 'min', 'prod')"
    x, ints = np.zeros((4, 2)), np.zeros(4, dtype=np.int32)
    for name in ("allreduce", "allreduce_", "iallreduce_", "reduce_scatter"):
        _raises(lambda: getattr(comm, name)(x, "avg"), ValueError, f"{name}: op must be one of {ops}, got 'avg'")
        _raises(lambda: getattr(comm, name)(ints, "mean"), TypeError,
                f"{name}: op='mean' needs a floating dtype, got int32; use op='sum' for integers")
    for axis in (2, -3, True, 1.0):
        expected = f"reduce_scatter: axis must be an int in [-2, 1] for an array of 2 dimensions, got {axis!r}"
        _raises(lambda: comm.reduce_scatter(x, axis=axis), ValueError, expected)
        _raises(lambda: comm.alltoall(x, split_axis=axis), ValueError, expected.replace("reduce_scatter", "alltoall"))
        _raises(lambda: comm.alltoall(x, concat_axis=axis), ValueError, expected.replace("reduce_scatter", "alltoall"))
    np.testing.assert_array_equal(comm.allgather(x, axis=-2), np.concatenate([x, x]))  # -ndim is an axis
    _raises(lambda: comm.alltoall(np.zeros((2, 3)), split_axis=1), ValueError,
            "alltoall: x.shape[1] = 3 must be divisible by the group size 2 (x of shape (2, 3))")
    for root in (2, -1, True, 0.0):
        _raises(lambda: comm.broadcast(x, root), ValueError, f"broadcast: root must be an int in [0, 1], got {root!r}")
    _raises(lambda: comm.split(3), TypeError, "split: ranks must be a list of ints, got 3")
    for ranks in ([], [0, 0], [0, 2], [-1, 0]):
        _raises(lambda: comm.split(ranks), ValueError, f"split: ranks must be distinct ints in [0, 1], got {ranks}")
    _raises(lambda: comm.split([1]), ValueError,
            "split: this rank (0) is not in ranks [1]; only members of the new group call split/new_group")
    assert comm.split([1, 0]) == (1, 0)


def test_constructor_settings_are_checked_and_named():
    comm = LocalCommunicator(debug=True, timeout=5, stall_warning=0)
    assert (comm.debug, comm.timeout, comm.stall_warning) == (1, 5.0, 0.0)
    assert LocalCommunicator(debug=False).debug == 0 and LocalCommunicator(debug=2).debug == 2
    np.testing.assert_array_equal(LocalCommunicator(debug=1).allreduce(np.ones(2)), np.ones(2))  # checks one rank
    assert repr(LocalCommunicator()) == "LocalCommunicator(rank=0, size=1)"
    assert (_Stub(local_rank=1, local_size=3).local_rank, _Stub(local_rank=1, local_size=3).local_size) == (1, 3)
    for debug in (3, "1", -1):
        _raises(lambda: LocalCommunicator(debug=debug), ValueError,
                f"debug must be 0, 1, 2, True or False, got {debug!r}")
    for name in ("timeout", "stall_warning"):
        _raises(lambda: LocalCommunicator(**{name: -1}), ValueError,
                f"{name} must be a finite number of seconds >= 0 (0 = off), got -1")


@pytest.mark.parametrize("value,level", [("", 0), ("0", 0), ("false", 0), ("no", 0), (" Off ", 0), ("1", 1),
                                         ("true", 1), ("YES", 1), ("on", 1), ("On", 1), ("2", 2)])
def test_debug_levels_from_the_environment(monkeypatch, value, level):
    monkeypatch.setenv("MINIDL_DIST_DEBUG", value)
    assert debug_level() == level and debug_enabled() == (level > 0)
    assert LocalCommunicator().debug == level


def test_a_wait_that_never_ends_warns_then_times_out_naming_the_collective():
    comm = _Stub(timeout=0.5, stall_warning=0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.monotonic()
        with pytest.raises(CollectiveTimeout) as info:
            comm.barrier()
        waited = time.monotonic() - start
    assert 0.5 <= waited < 3.0
    stalls = [w for w in caught if issubclass(w.category, CollectiveStallWarning)]
    assert len(stalls) == 1  # once per wait
    assert re.fullmatch(r"minidl_parallel: rank 0 of 2 \(stub backend\): barrier #0\(\) has waited 0\.[1-4] s; "
                        r"ranks that have not arrived: unknown \(the timeout ends the job after 0\.5 s\)",
                        str(stalls[0].message))
    assert re.fullmatch(r"minidl_parallel: rank 0 of 2 \(stub backend\): barrier #0\(\) timed out after \d\.\d s; "
                        r"ranks that have not arrived: unknown \(set MINIDL_COLLECTIVE_TIMEOUT or "
                        r"init\(timeout=\.\.\.\) to change the limit\)", str(info.value))
    assert comm.asked == ["barrier #0()"] * 2
    assert comm.served and set(comm.served) == {"barrier #0()"}  # a long wait answers the peers' questions


def test_a_wait_without_timeout_returns_when_done():
    comm = _Stub(timeout=0, stall_warning=0)
    end = time.monotonic() + 0.05
    with warnings.catch_warnings():
        warnings.simplefilter("error", CollectiveStallWarning)
        comm._wait_for(lambda: time.monotonic() > end)
    assert time.monotonic() > end


def test_a_wait_after_the_debug_check_names_the_collective_not_the_check():
    comm = _Stub(debug=1, timeout=0.01, stall_warning=0)
    with pytest.raises(CollectiveTimeout, match=re.escape("(stub backend): allreduce #0(shape=(2,), dtype=float64) "
                                                          "timed out after")):
        comm.allreduce(np.zeros(2))


def test_a_backend_that_cannot_tell_who_is_missing_says_unknown():
    comm = LocalCommunicator(timeout=0.01, stall_warning=0)
    with pytest.raises(CollectiveTimeout, match=re.escape("ranks that have not arrived: unknown (set ")):
        comm._wait_for(lambda: False)


@pytest.mark.parametrize("missing,who", [(None, "unknown"), (set(), "none"), ({3, 1}, "[1, 3]")])
def test_timeout_names_the_ranks_that_have_not_arrived(missing, who):
    comm = _Stub(timeout=0.01, stall_warning=0)
    comm.missing = missing
    comm.allreduce(np.zeros((2, 3), dtype=np.float32))  # the call a later wait names
    note = " (rank 1 is in broadcast #7)" if missing else ""
    with warnings.catch_warnings(), pytest.raises(CollectiveTimeout, match=re.escape(f"arrived: {who}{note} (set")):
        warnings.simplefilter("error", CollectiveStallWarning)  # stall_warning=0: never
        comm._wait_for(lambda: False)  # what mpi's and nccl's blocking waits call
    assert comm.asked == ["allreduce #0(shape=(2, 3), dtype=float32)"]


def test_a_watchdog_thread_warns_at_the_waiting_line():
    comm = _Stub(timeout=3)
    with pytest.warns(CollectiveStallWarning) as caught:
        comm._on_stall(comm._call, 61.0, where=("train.py", 12))
    assert (caught[0].filename, caught[0].lineno) == ("train.py", 12)
    assert str(caught[0].message) == ("minidl_parallel: rank 0 of 2 (stub backend): (none) #-1() has waited 61.0 s; "
                                      "ranks that have not arrived: unknown (the timeout ends the job after 3 s)")
