"""The threads backend: every collective against NumPy, for world sizes 1-8."""
import re
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import minidl_parallel as mp
from minidl_parallel import run_threads
from minidl_parallel.comm.base import CollectiveStallWarning, CollectiveTimeout
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


def test_debug_mode_catches_every_argument_that_differs_between_ranks(monkeypatch):
    monkeypatch.setenv("MINIDL_DIST_DEBUG", "1")
    x = np.zeros((4, 4))
    # (the collective called, the call on rank r, how each rank's call is described, their arguments)
    cases = [("allreduce", lambda c, r: c.allreduce(x, ["sum", "max"][r]),
              "allreduce(shape=(4, 4), dtype=float64, op={})", ["'sum'", "'max'"]),
             ("allreduce_", lambda c, r: c.allreduce_(x.copy(), ["sum", "min"][r]),
              "allreduce_(shape=(4, 4), dtype=float64, op={})", ["'sum'", "'min'"]),
             ("iallreduce_", lambda c, r: c.iallreduce_(x.copy(), ["mean", "prod"][r]),
              "iallreduce_(shape=(4, 4), dtype=float64, op={})", ["'mean'", "'prod'"]),
             ("reduce_scatter", lambda c, r: c.reduce_scatter(x, ["sum", "max"][r]),
              "reduce_scatter(shape=(4, 4), dtype=float64, axis=0, op={})", ["'sum'", "'max'"]),
             ("reduce_scatter", lambda c, r: c.reduce_scatter(x, "sum", r),
              "reduce_scatter(shape=(4, 4), dtype=float64, axis={}, op='sum')", ["0", "1"]),
             ("broadcast", lambda c, r: c.broadcast(x, r), "broadcast(shape=(4, 4), dtype=float64, root={})",
              ["0", "1"]),
             ("allgather", lambda c, r: c.allgather(x, r), "allgather(shape=(4, 4), dtype=float64, axis={})",
              ["0", "1"]),
             ("alltoall", lambda c, r: c.alltoall(x, r, 0),
              "alltoall(shape=(4, 4), dtype=float64, concat_axis=0, split_axis={})", ["0", "1"]),
             ("alltoall", lambda c, r: c.alltoall(x, 0, r),
              "alltoall(shape=(4, 4), dtype=float64, concat_axis={}, split_axis=0)", ["0", "1"]),
             (("allgather_object", "barrier"), lambda c, r: c.allgather_object(r) if r == 0 else c.barrier(), "{}()",
              ["allgather_object", "barrier"])]

    def body():
        comm, rank = mp.get_communicator(), mp.get_rank()
        messages = []
        for _, call, _, _ in cases:
            with pytest.raises(RuntimeError) as info:
                call(comm, rank)
            messages.append(str(info.value))
        return messages

    for rank, messages in enumerate(run(2, body)):
        for seq, ((name, _, describe, args), msg) in enumerate(zip(cases, messages)):
            mine = name if isinstance(name, str) else name[rank]
            assert msg == (f"MINIDL_DIST_DEBUG=1: ranks disagree at collective #{seq} ({mine} on rank {rank}): "
                           f"rank 0: #{seq} {describe.format(args[0])}; rank 1: #{seq} {describe.format(args[1])}")


@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_every_collective_matches_numpy_for_every_op_and_dtype(dtype):
    n = 3
    xs = [(np.arange(12).reshape(6, 2) * (r + 1) - 5 * r).astype(dtype) for r in range(n)]
    ops = ["sum", "max", "min", "prod"] + (["mean"] if dtype == np.float32 else [])

    def body():
        comm = mp.get_communicator()
        x = xs[comm.rank]
        return ([comm.allreduce(x, op) for op in ops], [comm.reduce_scatter(x, op) for op in ops],
                comm.allgather(x[0, 0]), comm.broadcast(x, 2), comm.alltoall(x))

    for r, (reduced, scattered, gathered, bcast, a2a) in enumerate(run(n, body)):
        for op, out, block in zip(ops, reduced, scattered):
            want = OPS[op](np.stack(xs)).astype(dtype)
            assert out.dtype == dtype and block.dtype == dtype, op
            np.testing.assert_allclose(out, want, rtol=1e-6, err_msg=op)
            np.testing.assert_allclose(block, want[2 * r:2 * r + 2], rtol=1e-6, err_msg=op)
        np.testing.assert_array_equal(gathered, np.array([x[0, 0] for x in xs], dtype=dtype))
        np.testing.assert_array_equal(bcast, xs[2])
        np.testing.assert_array_equal(a2a, np.concatenate([x[2 * r:2 * r + 2] for x in xs]))


@pytest.mark.parametrize("name,shape", [("allreduce", "(4,)"), ("allgather", "(4,)"), ("broadcast", "(4,)"),
                                        ("reduce_scatter", "(2, 2)"), ("alltoall", "(2, 2)")])  # (size, block)
def test_a_dtype_that_differs_between_ranks_raises_naming_the_collective_and_each_rank(name, shape):
    def body():
        comm = mp.get_communicator()
        x = np.zeros(4, dtype=[np.float32, np.float64][comm.rank])
        with pytest.raises(RuntimeError) as info:
            getattr(comm, name)(x)
        return str(info.value)

    for msg in run(2, body):
        assert msg == (f"threads backend: {name}: ranks passed different shapes/dtypes "
                       f"(rank 0: {shape} float32, rank 1: {shape} float64)")


@pytest.mark.parametrize("name,what", [("allreduce", "allreduce(op='sum')"), ("allgather", "allgather"),
                                       ("reduce_scatter", "reduce_scatter(op='max')"),
                                       ("broadcast", "broadcast(root=1)"), ("alltoall", "alltoall"),
                                       ("barrier", "barrier"), ("allgather_object", "debug check")])
def test_a_collective_that_can_never_complete_names_itself(name, what):
    calls = {"allreduce": lambda c: c.allreduce(np.ones(2)), "allgather": lambda c: c.allgather(np.ones(2)),
             "reduce_scatter": lambda c: c.reduce_scatter(np.ones(2), "max"),
             "broadcast": lambda c: c.broadcast(np.ones(2), 1), "alltoall": lambda c: c.alltoall(np.ones(2)),
             "barrier": lambda c: c.barrier(), "allgather_object": lambda c: c.allgather_object("x")}

    def body():
        if mp.get_rank() == 1:
            return None
        calls[name](mp.get_communicator())

    with pytest.raises(CollectiveAborted) as info:
        run(2, body)
    assert str(info.value) == (f"rank 0 of 2: threads backend: rank 0: {what} can never complete: rank(s) [1] "
                               f"already returned (ranks called different collectives)")


def _wait_out(comm, seconds):
    """Keeps this rank away from the collectives until the others time out (then they abort the world)."""
    time.sleep(seconds)


def test_a_timeout_names_the_collective_its_phase_and_the_missing_ranks(monkeypatch):
    def body():
        comm = mp.get_communicator()
        if comm.rank == 1:
            return _wait_out(comm, 0.8)
        comm.timeout = 0.2
        with pytest.raises(CollectiveTimeout) as info:
            comm.allreduce(np.zeros(2))
        return str(info.value)

    pattern = (r"threads backend: rank 0 of 2: allreduce #0\(shape=\(2,\), dtype=float64\){phase} timed out after "
               r"\d\.\d s; ranks that have not arrived: \[1\] \[{what}\] \(set MINIDL_COLLECTIVE_TIMEOUT or "
               r"init\(timeout=\.\.\.\) to change the limit\)")
    assert re.fullmatch(pattern.format(phase="", what=r"allreduce\(op='sum'\)"), run(2, body)[0])
    monkeypatch.setenv("MINIDL_DIST_DEBUG", "1")  # the fingerprint exchange comes first and times out
    assert re.fullmatch(pattern.format(phase=r" \(debug check\)", what="debug check"), run(2, body)[0])


def test_a_subgroup_stall_warns_naming_group_and_world_ranks():
    def body():
        comm = mp.get_communicator()
        sub = comm.split([1, 0])  # group rank 0 is world rank 1
        sub.stall_warning = 0.1
        if comm.rank == 0:
            time.sleep(0.5)
        sub.barrier()

    with pytest.warns(CollectiveStallWarning) as caught:
        run(2, body)
    messages = [str(w.message) for w in caught if "has waited" in str(w.message)]
    assert len(messages) == 1
    assert re.fullmatch(r"threads backend: rank 0 of 2: barrier #0\(\) has waited 0\.\d s; ranks that have not "
                        r"arrived: \[1\] \(world ranks \[0\]\) \[barrier\]", messages[0])


def test_the_ranks_that_wait_are_told_why_the_world_failed():
    seen = {}

    def body():
        comm = mp.get_communicator()
        if comm.rank == 0:
            time.sleep(0.2)
            raise ValueError("bad batch", 7)
        try:
            comm.barrier()
        except CollectiveAborted as exc:
            seen[comm.rank] = str(exc)
            raise

    with pytest.raises(ValueError) as info:
        run(2, body)
    assert info.value.args == ("rank 0 of 2: bad batch", 7)  # the other arguments are kept
    assert seen == {1: "threads backend: rank 1: barrier aborted because rank 0 raised ValueError: "
                       "('bad batch', 7)"}


def test_an_early_return_is_reported_to_the_ranks_that_arrive_later():
    seen = {}

    def body():
        comm = mp.get_communicator()
        if comm.rank == 0:
            time.sleep(0.2)  # rank 1 is waiting in the barrier by then
            return None
        if comm.rank == 2:
            time.sleep(1.0)  # rank 1 has found rank 0 gone by then
        try:
            comm.barrier()
        except CollectiveAborted as exc:
            seen[comm.rank] = str(exc)
            raise

    with pytest.raises(CollectiveAborted):
        run(3, body)
    assert seen[1] == ("threads backend: rank 1: barrier can never complete: rank(s) [0] already returned "
                       "(ranks called different collectives)")
    assert seen[2] == ("threads backend: rank 2: barrier aborted because rank(s) [0] returned while rank 1 waited "
                       "for them in barrier")


def test_the_first_real_error_wins_over_the_aborts_it_did_not_cause():
    def body():
        rank = mp.get_rank()
        if rank == 2:
            return None  # rank 1's barrier aborts first ...
        if rank == 0:
            time.sleep(0.3)
            raise ValueError("bad batch")  # ... but this is the error to report
        mp.get_communicator().barrier()

    with pytest.raises(ValueError, match="^rank 0 of 3: bad batch$"):
        run(3, body)


def test_rank_threads_are_named_daemons_and_a_timeout_aborts_the_stragglers():
    assert run(2, lambda: (threading.current_thread().name, threading.current_thread().daemon)) == \
        [("minidl-rank-0", True), ("minidl-rank-1", True)]  # a stuck rank cannot keep the process alive
    seen, done = [], threading.Event()

    def straggler():
        time.sleep(0.5)
        try:
            mp.get_communicator().barrier()
        except CollectiveAborted as exc:
            seen.append(str(exc))
        finally:
            done.set()

    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^run_threads: ranks \[0\] of 1 still running after 0.2 s$"):
        run_threads(1, straggler, timeout=0.2)
    assert time.monotonic() - start < 0.9  # it waits its timeout, not a second per rank
    assert done.wait(5)
    assert seen == ["threads backend: rank 0: barrier aborted because run_threads timed out after 0.2 s"]
    for n in (True, 2.0, 0):
        with pytest.raises(ValueError, match=f"^run_threads: n must be an int >= 1, got {n!r}$"):
            run_threads(n, lambda: None)


def test_a_note_is_added_after_the_notes_already_there():
    exc = _NoAddNote(3)
    exc.__notes__ = ["first"]

    def body():
        if mp.get_rank() == 1:
            raise exc

    with pytest.raises(_NoAddNote):
        run(2, body)
    assert exc.__notes__ == ["first", "rank 1 of 2: raised in run_threads"]


def test_sub_communicators_inherit_settings_and_each_split_is_a_new_group(monkeypatch):
    monkeypatch.delenv("MINIDL_DIST_DEBUG", raising=False)

    def body():
        comm = mp.get_communicator()
        comm.debug, comm.timeout = 1, 0.3
        pair = comm.split([0, 1] if comm.rank < 2 else [2, 3])
        inner = pair.split([1, 0])  # nested groups of two parents with the same rank lists
        objects, reduced = inner.allgather_object(("rank", comm.rank)), inner.allreduce(np.array([comm.rank]))
        splits = [pair.split([0, 1]) for _ in range(3)]
        try:  # each split is a new group: their barriers do not meet (and the timeout ends the world)
            splits[1 + pair.rank].barrier()
        except (CollectiveTimeout, CollectiveAborted):
            met = False
        else:
            met = True
        return inner.debug, inner.timeout, reduced, objects, met

    for rank, (debug, timeout, reduced, objects, met) in enumerate(run(4, body)):
        pair = [0, 1] if rank < 2 else [2, 3]
        assert (debug, timeout) == (1, 0.3)
        assert reduced.tolist() == [sum(pair)]
        assert objects == [("rank", pair[1]), ("rank", pair[0])]
        assert not met


def test_repr_names_the_backend_rank_and_size():
    assert run(2, lambda: repr(mp.get_communicator())) == ["ThreadsCommunicator(rank=0, size=2)",
                                                          "ThreadsCommunicator(rank=1, size=2)"]
