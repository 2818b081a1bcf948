"""The threads backend: every collective against NumPy, for world sizes 1-8."""
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import minidl_parallel as mp
from minidl_parallel import run_threads
from minidl_parallel.comm.threads import CollectiveAborted

OPS = {"sum": lambda xs: np.sum(xs, axis=0), "mean": lambda xs: np.mean(xs, axis=0),
       "max": lambda xs: np.max(xs, axis=0), "min": lambda xs: np.min(xs, axis=0),
       "prod": lambda xs: np.prod(xs, axis=0)}
TIMEOUT = 20.0


def run(n, fn, *args):
    return run_threads(n, fn, *args, timeout=TIMEOUT)


def inputs(n, shape, seed):
    return [np.random.default_rng([seed, r]).standard_normal(shape) for r in range(n)]


sizes = st.integers(1, 8)
small_shapes = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)


@given(n=sizes, shape=small_shapes, op=st.sampled_from(sorted(OPS)), seed=st.integers(0, 99))
def test_allreduce_variants_match_numpy(n, shape, op, seed):
    xs = inputs(n, shape, seed)

    def body():
        comm = mp.get_communicator()
        x = xs[comm.rank]
        out = comm.allreduce(x, op)
        y = x.copy()
        same = comm.allreduce_(y, op)
        z = x.copy()
        req = comm.iallreduce_(z, op)
        assert req.wait() is z
        return out, y, same is y, z, comm.collective_count

    want = OPS[op](xs)
    for out, y, same, z, count in run(n, body):
        np.testing.assert_allclose(out, want, rtol=1e-12)
        np.testing.assert_array_equal(y, out)
        np.testing.assert_array_equal(z, out)
        assert same and count == 3
    assert all(x.shape == shape for x in xs)  # inputs untouched by the out-of-place call


@given(n=sizes, rows=st.integers(1, 2), cols=st.integers(1, 3), axis=st.sampled_from([0, 1, -1]),
       op=st.sampled_from(sorted(OPS)), root=st.integers(0, 7), seed=st.integers(0, 99))
def test_gather_scatter_broadcast_alltoall_match_numpy(n, rows, cols, axis, op, root, seed):
    xs = inputs(n, (rows * n, cols * n), seed)
    root %= n

    def body():
        comm = mp.get_communicator()
        x = xs[comm.rank]
        return (comm.allgather(x, axis), comm.reduce_scatter(x, op, axis), comm.broadcast(x, root),
                comm.alltoall(x, split_axis=axis, concat_axis=1 - axis % 2))

    for r, (gathered, scattered, bcast, a2a) in enumerate(run(n, body)):
        np.testing.assert_array_equal(gathered, np.concatenate(xs, axis))
        np.testing.assert_allclose(scattered, np.split(OPS[op](xs), n, axis)[r], rtol=1e-12)
        np.testing.assert_array_equal(bcast, xs[root])
        blocks = [np.split(xs[q], n, axis)[r] for q in range(n)]
        np.testing.assert_array_equal(a2a, np.concatenate(blocks, 1 - axis % 2))


@settings(max_examples=6)
@given(n=st.integers(2, 8), seed=st.integers(0, 99))
def test_subgroups_reduce_within_their_members(n, seed):
    xs = inputs(n, (3,), seed)
    groups = [list(range(0, n, 2)), list(range(1, n, 2))[::-1]]

    def body():
        comm = mp.get_communicator()
        mine = groups[comm.rank % 2]
        sub = comm.new_group(mine)
        sub.barrier()
        return sub.rank, sub.size, sub.allreduce(xs[comm.rank]), sub.allgather(xs[comm.rank])

    for r, (sub_rank, sub_size, reduced, gathered) in enumerate(run(n, body)):
        mine = groups[r % 2]
        assert (sub_rank, sub_size) == (mine.index(r), len(mine))
        np.testing.assert_allclose(reduced, np.sum([xs[q] for q in mine], 0), rtol=1e-12)
        np.testing.assert_array_equal(gathered, np.concatenate([xs[q] for q in mine]))


def test_ranks_and_context_are_per_thread():
    out = run(3, lambda: (mp.get_rank(), mp.get_group_size(), mp.get_local_rank(), mp.get_local_rank_size(),
                          mp.init("threads") is mp.get_communicator()))
    assert out == [(r, 3, r, 3, True) for r in range(3)]
    assert (mp.get_rank(), mp.get_group_size()) == (0, 1)  # the caller's world is untouched


def test_results_are_identical_on_every_rank():
    xs = inputs(5, (50,), 7)
    outs = run(5, lambda: mp.get_communicator().allreduce(xs[mp.get_rank()] * 1e3, "mean"))
    assert all(np.array_equal(o, outs[0]) for o in outs)


def test_a_rank_that_raises_is_reported_and_the_others_do_not_hang():
    def body():
        comm = mp.get_communicator()
        if comm.rank == 2:
            raise ValueError("bad batch")
        comm.allreduce(np.ones(2))
        comm.barrier()

    start = time.monotonic()
    with pytest.raises(ValueError, match="rank 2 of 4: bad batch"):
        run(4, body)
    assert time.monotonic() - start < 5


class _NoAddNote(ValueError):
    """An exception as Python 3.9 and 3.10 make them: without add_note (PEP 678 is 3.11)."""

    def __getattribute__(self, name):
        if name == "add_note":
            raise AttributeError(f"{type(self).__name__!r} object has no attribute 'add_note'")
        return super().__getattribute__(name)


@pytest.mark.parametrize("make", [lambda: KeyError("w"), lambda: ValueError(3), lambda: _NoAddNote(3)],
                         ids=["KeyError", "non-str-message", "no-add_note"])
def test_a_message_that_cannot_take_the_rank_gets_it_as_a_note(make):
    # KeyError's str() is repr(key), and args[0] may be no string: the rank goes to a note,
    # with add_note where it exists, else in __notes__ as 3.11 stores it.
    exc = make()

    def body():
        if mp.get_rank() == 1:
            raise exc

    with pytest.raises(type(exc), match="rank 1 of 2: raised in run_threads") as info:
        run(2, body)
    assert info.value is exc and exc.args == make().args  # the message itself is untouched
    assert exc.__notes__ == ["rank 1 of 2: raised in run_threads"]


def test_a_rank_that_returns_early_aborts_the_waiting_ranks():
    def body():
        if mp.get_rank() == 0:
            return None
        mp.get_communicator().barrier()

    start = time.monotonic()
    with pytest.raises(CollectiveAborted, match=r"rank\(s\) \[0\] already returned"):
        run(3, body)
    assert time.monotonic() - start < 5
    assert threading.active_count() < 20


def test_mismatched_shapes_raise_on_every_rank_without_debug():
    def body():
        try:
            mp.get_communicator().allreduce(np.ones(mp.get_rank() + 1))
        except RuntimeError as exc:
            return str(exc)

    for msg in run(2, body):
        assert "allreduce" in msg and "rank 0: (1,)" in msg and "rank 1: (2,)" in msg


def test_debug_mode_names_collective_sequence_number_and_shapes(monkeypatch):
    monkeypatch.setenv("MINIDL_DIST_DEBUG", "1")

    def body():
        comm = mp.get_communicator()
        comm.barrier()
        x = np.ones((2, mp.get_rank() + 1), dtype=np.float32)
        try:
            comm.allgather(x) if mp.get_rank() == 0 else comm.allreduce(x)
        except RuntimeError as exc:
            return comm.debug, str(exc)

    for debug, msg in run(3, body):
        assert debug
        assert "collective #1" in msg
        assert "rank 0: #1 allgather(shape=(2, 1), dtype=float32" in msg
        assert "rank 2: #1 allreduce(shape=(2, 3), dtype=float32, op='sum')" in msg


def test_bad_arguments_raise_naming_the_collective():
    def body():
        comm = mp.get_communicator()
        errors = []
        for call in (lambda: comm.allreduce(np.ones(2), "avg"), lambda: comm.reduce_scatter(np.ones(3)),
                     lambda: comm.broadcast(np.ones(2), root=2), lambda: comm.allgather(np.ones(2), axis=1),
                     lambda: comm.allreduce(np.ones(2, dtype=np.int64), "mean"),
                     lambda: comm.split([0, 5])):
            try:
                call()
            except (ValueError, TypeError) as exc:
                errors.append(str(exc))
        return errors

    errors = run(2, body)[0]
    assert len(errors) == 6
    assert "op must be one of" in errors[0] and "'avg'" in errors[0]
    assert "x.shape[0] = 3 must be divisible by the group size 2" in errors[1]
    assert "root must be an int in [0, 1], got 2" in errors[2]
    assert "allgather: axis must be an int in [-1, 0]" in errors[3]
    assert "op='mean' needs a floating dtype" in errors[4]
    assert "distinct ints in [0, 1]" in errors[5]


def test_run_threads_validates_n_and_times_out():
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        run_threads(0, lambda: None)
    with pytest.raises(TimeoutError, match=r"ranks \[0\] of 1 still running"):
        run_threads(1, time.sleep, 2.0, timeout=0.2)
