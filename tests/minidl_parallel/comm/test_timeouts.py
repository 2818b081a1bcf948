"""Bounded waits in a threads world: timeouts, stall warnings, their settings, and the debug levels.

The mpi backend's behaviour under mpirun is in tests/minidl_parallel/test_faults_mpirun.py;
here the same contract runs on thread-ranks (CollectiveTimeout instead of an abort), plus the
parsing of MINIDL_COLLECTIVE_TIMEOUT, MINIDL_STALL_WARNING_SECONDS and MINIDL_DIST_DEBUG, and
the mpi watchdog's loop against a stand-in communicator (no MPI needed).
"""
import re
import threading
import time

import numpy as np
import pytest

import minidl_parallel as mp
from minidl_parallel import context, run_threads
from minidl_parallel.comm import create_communicator
from minidl_parallel.comm.base import (CollectiveStallWarning, CollectiveTimeout, debug_level,
                                       stall_warning_from_env, timeout_from_env)
from minidl_parallel.comm.threads import CollectiveAborted

HANG_LIMIT_S = 20.0  # run_threads' own bound: a hang fails the test with TimeoutError


@pytest.fixture(autouse=True)
def _no_wait_settings_from_the_environment(monkeypatch):
    for name in ("MINIDL_COLLECTIVE_TIMEOUT", "MINIDL_STALL_WARNING_SECONDS", "MINIDL_DIST_DEBUG"):
        monkeypatch.delenv(name, raising=False)


def run(n, fn):
    return run_threads(n, fn, timeout=HANG_LIMIT_S)


def outcome(call):
    """(exception type name, message) of call(), or ("ok", result)."""
    try:
        return "ok", call()
    except (CollectiveTimeout, CollectiveAborted) as exc:
        return type(exc).__name__, str(exc)


# ---- the timeout -----------------------------------------------------------------------


def test_a_rank_that_sleeps_past_the_timeout_times_out_the_waiting_rank_and_aborts_the_others():
    def body():
        rank = mp.get_rank()
        # Rank 0 has the short timeout, so it is the one that times out; rank 1 waits too (with
        # a long one) and must be aborted, as must the sleeper when it finally arrives.
        comm = mp.init(timeout=0.3 if rank == 0 else 10.0, stall_warning=0)
        if rank == 2:
            time.sleep(1.5)  # far past rank 0's timeout, even on a loaded machine
        return outcome(lambda: comm.allreduce(np.ones(2)))

    start = time.monotonic()
    results = run(3, body)
    assert time.monotonic() - start < 5
    kind, message = results[0]
    assert kind == "CollectiveTimeout"
    assert re.search(r"rank 0 of 3: allreduce #0\(shape=\(2,\), dtype=float64\) timed out after 0\.\d s", message)
    assert "ranks that have not arrived: [2]" in message  # rank 1 had arrived
    assert "MINIDL_COLLECTIVE_TIMEOUT" in message  # says how to change the limit
    for rank in (1, 2):
        kind, message = results[rank]
        assert kind == "CollectiveAborted", results[rank]
        assert "aborted because threads backend: rank 0 of 3: allreduce #0" in message


def test_run_threads_reraises_the_timeout_naming_the_rank():
    def body():
        comm = mp.init(timeout=0.2)
        if mp.get_rank() == 1:
            time.sleep(1.0)
        comm.barrier()

    with pytest.raises(CollectiveTimeout, match=r"rank 0 of 2: .*barrier #0\(\) timed out after \d\.\d s; "
                                                r"ranks that have not arrived: \[1\]"):
        run(2, body)


def test_a_rank_arriving_after_the_others_timed_out_is_aborted_not_let_through():
    """The barrier must not complete for the late rank with a rank that already raised."""
    def body():
        comm = mp.init(timeout=0.2)
        if mp.get_rank() == 1:
            time.sleep(1.0)
        return outcome(comm.barrier)

    results = run(2, body)
    assert results[0][0] == "CollectiveTimeout"
    assert results[1][0] == "CollectiveAborted", results[1]


def test_the_stall_warning_names_the_collective_and_the_late_rank_and_the_wait_goes_on():
    def body():
        comm = mp.init(timeout=10.0, stall_warning=0.1)
        if mp.get_rank() == 1:
            time.sleep(0.4)
        return comm.allreduce(np.full(3, mp.get_rank() + 1.0, dtype=np.float32))

    with pytest.warns(CollectiveStallWarning) as caught:
        results = run(2, body)
    for out in results:
        np.testing.assert_array_equal(out, np.full(3, 3.0, dtype=np.float32))  # the wait completed
    messages = [str(w.message) for w in caught if w.category is CollectiveStallWarning]
    assert any(re.search(r"rank 0 of 2: allreduce #0\(shape=\(3,\), dtype=float32\) has waited 0\.\d s; "
                         r"ranks that have not arrived: \[1\]", m) for m in messages), messages


def test_each_stalled_call_warns_once_even_on_the_same_thread():
    def body():
        comm = mp.init(timeout=10.0, stall_warning=0.1)
        for _ in range(2):  # two stalled calls, one after the other, on the same threads
            if mp.get_rank() == 1:
                time.sleep(0.4)
            comm.allreduce(np.ones(3))

    with pytest.warns(CollectiveStallWarning) as caught:
        run(2, body)
    messages = [str(w.message) for w in caught if w.category is CollectiveStallWarning]
    for seq in (0, 1):  # rank 0 waited in each: one warning per call, not one per thread
        found = [m for m in messages if f"rank 0 of 2: allreduce #{seq}(" in m]
        assert len(found) == 1, messages


def test_timeout_zero_waits_as_long_as_it_takes():
    def body():
        comm = mp.init(timeout=0, stall_warning=0)
        if mp.get_rank() == 1:
            time.sleep(0.3)
        return comm.allreduce(np.ones(1))[0]

    assert run(2, body) == [2.0, 2.0]


def test_a_sub_communicator_times_out_naming_group_and_world_ranks():
    def body():
        comm = mp.init(timeout=0.2)
        rank = mp.get_rank()
        if rank not in (1, 3):
            return "not a member"
        sub = comm.split([1, 3])
        if rank == 3:
            time.sleep(1.0)
        return outcome(lambda: sub.allreduce(np.ones(1)))

    results = run(4, body)
    kind, message = results[1]
    assert kind == "CollectiveTimeout"
    assert "rank 0 of 2: allreduce #0(shape=(1,), dtype=float64) timed out" in message
    assert "ranks that have not arrived: [1] (world ranks [3])" in message
    assert results[3][0] == "CollectiveAborted"


# ---- settings --------------------------------------------------------------------------


@pytest.mark.parametrize("value, want", [(None, 600.0), ("", 600.0), ("0", 0.0), ("2.5", 2.5), (" 30 ", 30.0)])
def test_collective_timeout_from_the_environment(monkeypatch, value, want):
    if value is not None:
        monkeypatch.setenv("MINIDL_COLLECTIVE_TIMEOUT", value)
    assert timeout_from_env() == want
    assert create_communicator("local").timeout == want


@pytest.mark.parametrize("value, want", [(None, 60.0), ("0", 0.0), ("0.25", 0.25)])
def test_stall_warning_from_the_environment(monkeypatch, value, want):
    if value is not None:
        monkeypatch.setenv("MINIDL_STALL_WARNING_SECONDS", value)
    assert stall_warning_from_env() == want
    assert create_communicator("threads").stall_warning == want


@pytest.mark.parametrize("name", ["MINIDL_COLLECTIVE_TIMEOUT", "MINIDL_STALL_WARNING_SECONDS"])
@pytest.mark.parametrize("value", ["ten", "-1", "nan", "inf"])
def test_an_invalid_wait_setting_in_the_environment_raises_naming_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"{name} must be .*seconds.*0 = off.*got '{value}'"):
        create_communicator("local")


@pytest.mark.parametrize("value, want", [(None, 0), ("0", 0), ("off", 0), ("false", 0), ("1", 1), ("true", 1),
                                         ("TRUE", 1), ("yes", 1), ("2", 2), (" 2 ", 2)])
def test_dist_debug_levels_from_the_environment(monkeypatch, value, want):
    if value is not None:
        monkeypatch.setenv("MINIDL_DIST_DEBUG", value)
    assert debug_level() == want
    assert create_communicator("local").debug == want


@pytest.mark.parametrize("value", ["3", "verbose", "-1"])
def test_an_invalid_dist_debug_raises_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("MINIDL_DIST_DEBUG", value)
    with pytest.raises(ValueError, match=rf"MINIDL_DIST_DEBUG must be 0, 1 or 2 .*got '{value.lower()}'"):
        create_communicator("local")


@pytest.mark.parametrize("kwargs, what", [({"timeout": -1}, "init: timeout"), ({"timeout": "10"}, "init: timeout"),
                                          ({"timeout": True}, "init: timeout"),
                                          ({"timeout": float("nan")}, "init: timeout"),
                                          ({"stall_warning": -0.5}, "init: stall_warning")])
def test_init_rejects_invalid_waits_before_making_a_world(kwargs, what):
    with pytest.raises(ValueError, match=rf"{what} must be a finite number of seconds >= 0 \(0 = off\)"):
        mp.init("local", **kwargs)
    assert context.current_world().comm is None  # no world was made (nor leaked)


def test_init_sets_and_updates_the_waits_of_the_existing_world():
    comm = mp.init("local", timeout=3, stall_warning=1)
    try:
        assert (comm.timeout, comm.stall_warning) == (3.0, 1.0)
        again = mp.init(timeout=5)
        assert again is comm and (comm.timeout, comm.stall_warning) == (5.0, 1.0)
        assert mp.init(stall_warning=0) is comm and (comm.timeout, comm.stall_warning) == (5.0, 0.0)
        with pytest.raises(ValueError, match="init: timeout must be"):
            mp.init(timeout=-2)
        assert comm.timeout == 5.0  # a rejected value changes nothing
    finally:
        mp.release()


def test_init_updates_a_thread_ranks_world_communicator():
    def body():
        comm = mp.get_communicator()
        same = mp.init(timeout=4.5, stall_warning=2)
        return same is comm, comm.timeout, comm.stall_warning

    assert run(2, body) == [(True, 4.5, 2.0)] * 2


def test_split_inherits_timeout_stall_warning_and_debug(monkeypatch):
    monkeypatch.setenv("MINIDL_DIST_DEBUG", "2")

    def body():
        comm = mp.init(timeout=7, stall_warning=3)
        sub = comm.split([0, 1]) if mp.get_rank() < 2 else comm.split([2, 3])
        subsub = sub.split([0]) if sub.rank == 0 else sub.split([1])
        return [(c.timeout, c.stall_warning, c.debug) for c in (comm, sub, subsub)]

    for settings in run(4, body):
        assert settings == [(7.0, 3.0, 2)] * 3
    local = create_communicator("local", timeout=9, stall_warning=4, debug=1)
    assert (lambda s: (s.timeout, s.stall_warning, s.debug))(local.split([0])) == (9.0, 4.0, 1)


# ---- MINIDL_DIST_DEBUG=2: the call site --------------------------------------------------


def reorder_body():
    comm = mp.get_communicator()
    weights, biases = np.full(3, comm.rank + 1.0), np.full(3, 10.0 * (comm.rank + 1))
    try:
        if comm.rank == 0:
            first = comm.allreduce(weights)  # rank 0's first call
            comm.allreduce(biases)
        else:
            first = comm.allreduce(biases)  # rank 1's first call
            comm.allreduce(weights)
    except RuntimeError as exc:
        return "raised", str(exc)
    return "ok", float(first[0])


def _line_of(marker):
    import inspect
    lines, start = inspect.getsourcelines(reorder_body)
    return next(start + i for i, line in enumerate(lines) if line.rstrip().endswith(marker))


@pytest.mark.call_site
def test_debug_level_2_catches_same_shape_collectives_reordered_across_ranks(monkeypatch):
    monkeypatch.setenv("MINIDL_DIST_DEBUG", "2")
    results = run(2, reorder_body)
    site0, site1 = (f"{__file__}:{_line_of(m)}" for m in ("# rank 0's first call", "# rank 1's first call"))
    for kind, message in results:
        assert kind == "raised"
        assert "MINIDL_DIST_DEBUG=2: ranks disagree at collective #0" in message
        assert f"rank 0: #0 allreduce(shape=(3,), dtype=float64, op='sum') at {site0}" in message
        assert f"rank 1: #0 allreduce(shape=(3,), dtype=float64, op='sum') at {site1}" in message


def test_debug_level_1_does_not_see_the_reorder_and_the_sums_are_wrong(monkeypatch):
    """Level 1's blind spot: rank 0's weights are summed with rank 1's biases (1 + 20)."""
    monkeypatch.setenv("MINIDL_DIST_DEBUG", "1")
    assert run(2, reorder_body) == [("ok", 21.0), ("ok", 21.0)]


@pytest.mark.call_site
def test_debug_level_2_rejects_one_collective_called_from_different_lines(monkeypatch):
    """The price of level 2: the same call made from two lines (a rank-dependent branch) is
    rejected although it would pair correctly."""
    monkeypatch.setenv("MINIDL_DIST_DEBUG", "2")

    def body():
        comm = mp.get_communicator()
        try:
            if comm.rank == 0:
                comm.allreduce(np.ones(2))
            else:
                comm.allreduce(np.ones(2))
        except RuntimeError as exc:
            return str(exc)
        return "no error"

    for message in run(2, body):
        assert "MINIDL_DIST_DEBUG=2: ranks disagree at collective #0" in message


def test_debug_level_2_accepts_the_same_calls_from_the_same_lines(monkeypatch):
    monkeypatch.setenv("MINIDL_DIST_DEBUG", "2")

    def body():
        comm = mp.get_communicator()
        return [float(comm.allreduce(np.full(1, float(i)))[0]) for i in range(3)]

    assert run(2, body) == [[0.0, 2.0, 4.0]] * 2


# ---- the mpi watchdog's loop, on a stand-in communicator (no MPI) ------------------------


class _StandIn:
    """What the watchdog asks of a communicator; records the calls instead of aborting."""

    def __init__(self, timeout, stall_warning):
        self.timeout, self.stall_warning = timeout, stall_warning
        self.events = []
        self.done = threading.Event()

    def _serve_peers(self, call):
        if "serve" not in self.events:
            self.events.append("serve")

    def _on_stall(self, call, waited, where=None):
        self.events.append(("stall", call, round(waited, 1)))

    def _on_timeout(self, call, waited):
        self.events.append(("timeout", call))
        self.done.set()


def test_the_watchdog_serves_warns_once_then_times_out_a_long_call():
    from minidl_parallel.comm.mpi import Watchdog
    comm = _StandIn(timeout=0.5, stall_warning=0.2)
    dog = Watchdog()
    try:
        dog.inflight[1] = (comm, "allreduce #4", time.monotonic())
        assert comm.done.wait(5.0), comm.events
        del dog.inflight[1]
    finally:
        dog.stop()
    assert comm.events[0] == "serve"
    stalls = [e for e in comm.events if e[0] == "stall"]
    assert len(stalls) == 1 and stalls[0][1] == "allreduce #4" and 0.2 <= stalls[0][2] < 0.5
    assert comm.events.index(stalls[0]) < comm.events.index(("timeout", "allreduce #4"))


def test_the_watchdog_warns_for_each_stalled_call_of_the_same_thread():
    """Warned once per call, not once per thread: a rank's thread stalls in many calls in a job."""
    from minidl_parallel.comm.mpi import Watchdog
    comm = _StandIn(timeout=0, stall_warning=0.1)
    dog = Watchdog()
    try:
        for seq in range(2):  # thread 1 stalls in one call, then in the next
            call = f"allreduce #{seq}"
            dog.inflight[1] = (comm, call, time.monotonic())
            deadline = time.monotonic() + 5.0
            while ("stall", call) not in [e[:2] for e in comm.events if e != "serve"] and time.monotonic() < deadline:
                time.sleep(0.01)
            del dog.inflight[1]
    finally:
        dog.stop()
    assert [e[1] for e in comm.events if e != "serve" and e[0] == "stall"] == ["allreduce #0", "allreduce #1"]


def test_a_polled_wait_warns_for_each_stalled_call_of_the_same_thread():
    """Communicator._wait_for (the mpi backend's polled calls, nccl's barrier): one warning per call."""
    from minidl_parallel.comm.base import CallInfo
    from minidl_parallel.comm.local import LocalCommunicator
    comm = LocalCommunicator(timeout=10.0, stall_warning=0.05)
    with pytest.warns(CollectiveStallWarning) as caught:
        for seq in range(2):
            done_at = time.perf_counter() + 0.2
            comm._wait_for(lambda: time.perf_counter() >= done_at, CallInfo("allreduce", seq, (3,), "float32"))
    messages = [str(w.message) for w in caught if w.category is CollectiveStallWarning]
    for seq in (0, 1):
        assert len([m for m in messages if f"allreduce #{seq}(shape=(3,), dtype=float32) has waited" in m]) == 1, \
            messages


def test_the_watchdog_leaves_calls_shorter_than_its_period_alone():
    """The common path: a collective that ends within PERIOD_S is never served, warned or timed
    out, even with limits below the period (they are only checked at the period)."""
    from minidl_parallel.comm.mpi import Watchdog
    comm = _StandIn(timeout=0.01, stall_warning=0.01)
    dog = Watchdog()
    try:
        for i in range(100):
            dog.inflight[1] = (comm, f"allreduce #{i}", time.monotonic())
            time.sleep(0.0005)
            del dog.inflight[1]
        time.sleep(2 * Watchdog.PERIOD_S)
    finally:
        dog.stop()
    assert comm.events == []


def test_the_watchdog_survives_a_failure_of_its_own_and_still_times_out(capfd):
    """A watchdog thread that died on an error would leave every later wait unbounded."""
    from minidl_parallel.comm.mpi import Watchdog

    class FailsOnce(_StandIn):
        def _serve_peers(self, call):
            if not self.events:
                self.events.append("failed")
                raise OSError("the side channel broke")

    comm = FailsOnce(timeout=0.3, stall_warning=0)
    dog = Watchdog()
    try:
        dog.inflight[1] = (comm, "barrier #0", time.monotonic())
        assert comm.done.wait(5.0), comm.events
    finally:
        dog.stop()
    assert comm.events == ["failed", ("timeout", "barrier #0")]
    assert "minidl_parallel: the collective watchdog failed (it goes on checking):\nTraceback (most recent call " \
           "last)" in capfd.readouterr().err


class _Recorder(_StandIn):
    """A stand-in that records what the watchdog passes: the call served, the wait, where it waits."""

    def _serve_peers(self, call):
        self.events.append(("serve", call))

    def _on_stall(self, call, waited, where=None):
        self.events.append(("stall", call, waited, where))

    def _on_timeout(self, call, waited):
        self.events.append(("timeout", call, waited))
        self.done.set()


def test_the_watchdog_passes_the_call_its_wait_and_the_waiting_line():
    """The stall warning names the line the rank waits at (the waiting thread's frame), and a
    call that ends at once beside a long one does not hide the long one."""
    from minidl_parallel.comm.mpi import Watchdog
    comm, quick = _Recorder(timeout=0.4, stall_warning=0.1), _Recorder(timeout=0.01, stall_warning=0.01)
    waiting, leave = [], []

    def wait_in_a_collective():
        waiting.append(threading.get_ident())
        while not leave:
            time.sleep(0.001)  # the waiting line

    thread = threading.Thread(target=wait_in_a_collective, daemon=True)
    thread.start()
    dog = Watchdog()
    try:
        while not waiting:
            time.sleep(0.001)
        dog.inflight[-1] = (quick, "allreduce #0", time.monotonic() + 3600)  # first in order: never long
        dog.inflight[waiting[0]] = (comm, "allreduce #7", time.monotonic())
        assert comm.done.wait(5.0), comm.events
    finally:
        leave.append(True)
        dog.stop()
        thread.join(5.0)
    assert quick.events == []
    assert comm.events[0] == ("serve", "allreduce #7")
    stall = next(e for e in comm.events if e[0] == "stall")
    timeout = next(e for e in comm.events if e[0] == "timeout")
    assert stall[:2] == ("stall", "allreduce #7") and 0.1 <= stall[2] < 0.4
    first = wait_in_a_collective.__code__.co_firstlineno
    assert stall[3] in [(__file__, first + 2), (__file__, first + 3)], stall  # the loop, mostly its sleep
    assert timeout[:2] == ("timeout", "allreduce #7") and timeout[2] >= 0.4


class _Side:
    """The watch channel as the watchdog uses it: records the states it answers with."""

    def __init__(self):
        self.states = []

    def serve(self, state=None):
        self.states.append(state)


def test_the_watchdog_answers_outside_any_collective_with_the_latest_call(monkeypatch):
    from minidl_parallel.comm import mpi as backend
    side = _Side()
    monkeypatch.setitem(backend._watch, "watch", side)
    dog = backend.Watchdog()
    try:
        assert dog._thread.name == "minidl-mpi-watchdog" and dog._thread.daemon  # never holds up the exit
        deadline = time.monotonic() + 5.0
        while not side.states and time.monotonic() < deadline:
            time.sleep(0.01)
        assert side.states and side.states[0] == ("outside", None, None)  # no collective yet
        dog.latest = (None, "barrier #4()", time.monotonic() - 2.0)
        count = len(side.states)
        while len(side.states) <= count + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        dog.stop()
    assert not dog._thread.is_alive()
    kind, latest, ago = side.states[-1]
    assert (kind, latest) == ("outside", "barrier #4()") and 2.0 <= ago < 4.0


def test_stopping_the_watchdog_waits_at_most_wait_s_for_it():
    """A watchdog stuck in a check (a survey waits up to 1 s) must not hold up the exit."""
    from minidl_parallel.comm.mpi import Watchdog
    release = threading.Event()

    class Stuck(_StandIn):
        def _serve_peers(self, call):
            self.done.set()
            release.wait(10.0)

    comm = Stuck(timeout=0, stall_warning=0)
    dog = Watchdog()
    try:
        dog.inflight[1] = (comm, "barrier #0", time.monotonic())
        assert comm.done.wait(5.0)
        start = time.monotonic()
        dog.stop(wait_s=0.2)
        assert time.monotonic() - start < 2.0 and dog._thread.is_alive()
    finally:
        release.set()
        dog._thread.join(5.0)


@pytest.mark.parametrize("status, code", [(3, 3), (255, 255), (256, 1), (-1, 1), (512, 1)])
def test_a_nonzero_exit_status_aborts_with_a_code_the_shell_reads_as_failure(status, code):
    """sys.exit(256) must not abort the job with an error code that reaches the shell as 0."""
    from minidl_parallel.world import _abort_code
    assert _abort_code(status) == code and code % 256 != 0
